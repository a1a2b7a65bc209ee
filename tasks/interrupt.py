"""The user's stop (SIGINT or SIGTERM) as a fact, not only as an exception.

Contract: the `sailor` CLI's signal handlers call `request(signum)` before they raise (KeyboardInterrupt
or their own BaseException). Library code on the way may swallow that exception (Prefect's task engine
once turned it into `ValueError: Task run is not set`, or a retried task ate it and the run trained on),
so the flow also calls `check()` at its safe points (each monitoring poll, before and after a replan):
once a stop was requested it raises `Interrupted` again there. `requested()` tells the CLI which signal
to report (exit 128 + signum) whatever the flow returned or raised. One process, one user: the state
is process-wide like the signal disposition it mirrors; `clear()` is for tests and the end of a command.
`Terminated` is the CLI's SIGTERM as an exception; `is_stop(e)` tells a stop (the user's, or Prefect
cancelling the run) from a failure, by the exception's class.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading

_lock = threading.Lock()
_signum: list[int] = []


class Interrupted(BaseException):  # noqa: N818 - a stop, like KeyboardInterrupt, not an error
    """The user stopped the command; a BaseException so that no `except Exception` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class Terminated(BaseException):
    """SIGTERM turned into an exception, so `finally` blocks clean up before the process exits 143."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


def is_stop(e: BaseException) -> bool:
    """Whether an exception ends the run as stopped (cancelled) rather than failed: the user's signal
    (KeyboardInterrupt, `Terminated`, `Interrupted`), or Prefect cancelling or terminating the run."""
    from prefect.exceptions import TerminationSignal

    return isinstance(e, KeyboardInterrupt | Terminated | Interrupted | TerminationSignal | asyncio.CancelledError
                      | concurrent.futures.CancelledError)


def request(signum: int) -> None:
    """Note that the user asked to stop (the first signal counts)."""
    with _lock:
        if not _signum:
            _signum.append(int(signum))


def requested() -> int | None:
    """The signal of the user's stop, None when none came."""
    with _lock:
        return _signum[0] if _signum else None


def check() -> None:
    """At a safe point: raise `Interrupted` when a stop was requested."""
    if (s := requested()) is not None:
        raise Interrupted(s)


def clear() -> None:
    with _lock:
        _signum.clear()
