"""Abortable waits for torch.distributed work, so a lost peer never hangs a surviving rank.

Contract: a `Waiter` is how one process waits for async work handles. `Waiter()` waits directly
(tests, the profiler, torchrun launches). `Waiter(abortable=True)` (a controlled worker, whose
watcher sets `abort` when its controller announces a lost worker): `wait(work)` raises `PeerLost`
as soon as `abort` is set. Gloo reports a closed connection to collectives, but a pending
point-to-point receive stays blocked until its timeout, gloo's `is_completed` never turns true for
point-to-point work, and a timed-out gloo wait breaks the connection. So an abortable waiter runs
the blocking wait on a helper thread and the caller waits on that or on `abort`, whichever comes
first; an abandoned wait ends when the process group is torn down. The worker owns its process's
waiter and hands it to each generation's trainer; nothing here is module state. `barrier(device)`
is the world barrier through the same wait; `device_ids(device)` is what `dist.barrier` is given
(NCCL's barrier allocates on the device given, else it guesses).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from sailor_core.errors import PeerLost

# Threads for abandoned waits: one per wait a lost peer left blocked (they end with their group).
WAIT_THREADS = 256


def device_ids(device: torch.device) -> list[int] | None:
    """`device_ids` for `dist.barrier`: NCCL's barrier allocates on the device given (else it guesses)."""
    return (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
    )


class Waiter:
    """Waits for work handles; with `abortable`, gives up with `PeerLost` once `abort` is set."""

    def __init__(self, *, abortable: bool = False) -> None:
        self.abort = threading.Event()
        self._pool = (ThreadPoolExecutor(max_workers=WAIT_THREADS, thread_name_prefix="sailor-wait")
                      if abortable else None)

    @property
    def abortable(self) -> bool:
        return self._pool is not None

    def wait(self, work: Any) -> None:
        if self._pool is None:
            work.wait()
            return
        if self.abort.is_set():
            raise PeerLost("a peer was lost; abandoning this step")
        fut: Future[Any] = self._pool.submit(work.wait)
        while True:
            try:
                fut.result(timeout=0.05)
                return
            except TimeoutError:
                if self.abort.is_set():
                    raise PeerLost("a peer was lost; abandoning this step") from None

    def barrier(self, device: torch.device) -> None:
        """The world's barrier, on this rank's `device` where it is a GPU."""
        self.wait(dist.barrier(async_op=True, device_ids=device_ids(device)))
