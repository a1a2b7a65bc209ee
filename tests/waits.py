"""Waiting in tests: poll for the event a test waits for, with a deadline, never a fixed sleep.

`wait_for(cond, timeout_s, what)` calls `cond` until it returns something true (and returns that), and
fails the test with "timed out after N s waiting for WHAT" at the deadline. `hold_for(seconds, what)` is
for what a test scripts as a duration, not a wait for an event: an outage, a grace period, a client left
idle past a timeout. tests/test_waits.py checks that every `time.sleep` in tests/ is inside such a loop.

Wait on the event itself, not on a copy of it that lags: a run's progress is
`tests.flow_fixtures.steps_trained` (rank 0's own step records in the VMs' folders, live), not the run's
copies under its work folder (flushed every 10 s, uploaded every 30 s), and a run that started training is
its history's `training_started` event.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout_s: float, what: str, *, every_s: float = 0.05) -> T:
    """`cond()`'s first true value, polled every `every_s` until `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def hold_for(seconds: float, what: str) -> None:
    """A scripted duration (`what`: the outage, grace period or idle time it stands for), held on the clock."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        time.sleep(min(0.05, max(0.0, until - time.monotonic())))
