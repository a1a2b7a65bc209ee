"""Notices that end or interrupt training: a preemption notice, a stop, a plan change.

Contract:
- `Notices` holds one process's flags: `checkpoint` (a preemption notice: SIGUSR1), `stop` (SIGTERM,
  or the worker's plan change) and `terminated` (SIGTERM came). `install()` points SIGUSR1 and
  SIGTERM at this instance (handlers only set flags; outside the main thread nothing is installed
  and files still work). The worker makes one per process and hands it to each generation's trainer.
- `NoticePoll(notices, preempt_file, stop_file)` is one trainer's view, read once per step by
  `poll()` -> (just-in-time checkpoint wanted, stop wanted), as floats for the step's all-reduce.
  A preemption notice is the file appearing or being rewritten, not its mere presence: one
  checkpoint each; `answered()` marks the file's current version as answered once every rank took
  the checkpoint. A new trainer (the next generation) has answered nothing yet.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any


class Notices:
    """One process's notice flags (see the module's contract)."""

    def __init__(self) -> None:
        self.checkpoint = False
        self.stop = False
        self.terminated = False  # SIGTERM came (`stop` is also set by a plan change)
        self.installed = False

    def install(self) -> None:
        """Point SIGUSR1 and SIGTERM at these flags (once; not possible outside the main thread)."""
        if self.installed:
            return
        try:
            signal.signal(signal.SIGUSR1, self._on_sigusr1)
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self.installed = True
        except ValueError:  # not the main thread (e.g. in a test harness): files still work
            pass

    def _on_sigusr1(self, *_: Any) -> None:
        self.checkpoint = True

    def _on_sigterm(self, *_: Any) -> None:
        self.stop = self.terminated = True


class NoticePoll:
    """One trainer's reading of the notices, its preemption file and its stop file, once per step."""

    def __init__(self, notices: Notices, preempt_file: str | None, stop_file: str | None) -> None:
        self.notices = notices
        self.preempt_file = preempt_file
        self.stop_file = stop_file
        self._seen: int | None = None  # the preemption file's version answered last (None: none)

    def poll(self) -> tuple[float, float]:
        """(just-in-time checkpoint wanted, stop wanted) on this rank; consumes a signal's notice."""
        jit = self.notices.checkpoint
        if self.preempt_file:
            stamp = self._stamp()
            if stamp is not None and stamp != self._seen:
                jit = True
            self._seen = stamp
        stop = self.notices.stop or bool(self.stop_file and os.path.exists(self.stop_file))
        self.notices.checkpoint = False
        return float(jit), float(stop)

    def answered(self) -> None:
        """Every rank takes this step's checkpoint: every rank has now answered the current notice."""
        if self.preempt_file:
            with contextlib.suppress(OSError):
                self._seen = os.stat(self.preempt_file).st_mtime_ns

    def _stamp(self) -> int | None:
        try:
            return os.stat(self.preempt_file).st_mtime_ns if self.preempt_file else None
        except OSError:
            return None
