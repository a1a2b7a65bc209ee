"""Abortable waits for torch.distributed work, so a lost peer never hangs a surviving rank.

Contract: `ABORT` is a process-wide threading.Event. `wait(work)` waits for an async work handle and
raises `PeerLost` as soon as `ABORT` is set (a worker's watcher sets it when its controller
announces a lost worker). Gloo reports a closed connection to collectives, but a pending
point-to-point receive stays blocked until its timeout, gloo's `is_completed` never turns true for
point-to-point work, and a timed-out gloo wait breaks the connection. So in watched processes the
blocking wait runs on a helper thread and the caller waits on that or on ABORT, whichever comes
first; an abandoned wait ends when the process group is torn down. Unwatched processes (tests,
the profiler, torchrun launches) wait directly.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sailor_core.errors import PeerLost

ABORT = threading.Event()
_watched = [False]
_pool: list[ThreadPoolExecutor] = []


def set_watched(on: bool) -> None:
    """Turn on abortable waits (only processes whose ABORT can be set need them)."""
    _watched[0] = on
    if on and not _pool:
        _pool.append(ThreadPoolExecutor(max_workers=256, thread_name_prefix="sailor-wait"))


def wait(work: Any) -> None:
    if not _watched[0]:
        work.wait()
        return
    if ABORT.is_set():
        raise PeerLost("a peer was lost; abandoning this step")
    fut: Future[Any] = _pool[0].submit(work.wait)
    while True:
        try:
            fut.result(timeout=0.05)
            return
        except TimeoutError:
            if ABORT.is_set():
                raise PeerLost("a peer was lost; abandoning this step") from None
