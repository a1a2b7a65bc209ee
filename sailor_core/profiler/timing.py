"""Repeat-until-stable timing shared by the layer and the network profiler.

Contract: `measure(run_once, policy)` calls `run_once()` (which returns the seconds one repetition
took, already synchronised with the device) `policy.warmup` times without recording, then repeats
until the relative standard error of the mean is below `policy.rel_err`, or `policy.max_reps`
repetitions, or `policy.time_cap_s` seconds have passed (whichever comes first, but never fewer
than `policy.min_reps`). A `Measurement` keeps the recorded samples and summarises them by a
named statistic (`stat_s`: "mean", "median" or a percentile "p10"); `check_statistic` validates
one. The layer profiler reports the mean (a training step is a sum of layer times, so its expected
value is the sum of the layers' expected values, long tails included), the network profiler a low
percentile (see network.py). `StopRule` is the same rule as a step-by-step object, for loops where
every participant of a collective must agree on when to stop (the network profiler broadcasts
rank 0's decision).

Timers: `cpu_timer()` wraps perf_counter; on CUDA the callers record CUDA events around the work and
synchronise before reading them, so launch queueing is not mistaken for kernel time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from sailor_core.errors import SailorError


@dataclass(frozen=True, kw_only=True)
class RepeatPolicy:
    """When to stop repeating a measurement."""

    warmup: int = 2
    min_reps: int = 5
    max_reps: int = 200
    rel_err: float = 0.02  # target relative standard error of the mean
    time_cap_s: float = 2.0  # per measured quantity

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.min_reps < 2 or self.max_reps < self.min_reps:
            raise ValueError(
                f"repeat policy needs warmup >= 0 and 2 <= min_reps <= max_reps, got "
                f"warmup={self.warmup} min_reps={self.min_reps} max_reps={self.max_reps}"
            )
        if not (self.rel_err > 0 and self.time_cap_s > 0):
            raise ValueError(
                f"repeat policy needs rel_err > 0 and time_cap_s > 0, got {self.rel_err}, {self.time_cap_s}"
            )


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """The recorded repetitions of one quantity (seconds) and their summary."""

    samples: tuple[float, ...]
    rel_stderr: float
    stable: bool  # reached rel_err before the caps

    @staticmethod
    def of(samples: list[float], rel_err: float) -> Measurement:
        rse = _rel_stderr(samples)
        return Measurement(samples=tuple(samples), rel_stderr=rse, stable=rse <= rel_err)

    @property
    def reps(self) -> int:
        return len(self.samples)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.samples)

    def stat_s(self, statistic: str) -> float:
        """The samples summarised by `statistic`: "mean", "median" or "pNN" (the NN-th percentile)."""
        q = check_statistic(statistic)
        return self.mean_s if q is None else self.quantile_s(q)

    def quantile_s(self, q: float) -> float:
        """Linear-interpolated q-quantile (0 <= q <= 1) of the samples."""
        xs = sorted(self.samples)
        pos = q * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def check_statistic(statistic: str) -> float | None:
    """The quantile a statistic name stands for (None: the mean); a clear error for a bad name."""
    if statistic == "mean":
        return None
    if statistic == "median":
        return 0.5
    if statistic.startswith("p") and statistic[1:].isdigit() and 0 <= int(statistic[1:]) <= 100:
        return int(statistic[1:]) / 100
    raise SailorError(
        f"unknown statistic {statistic!r}; to fix: use mean, median or a percentile such as p10 or p20"
    )


def _rel_stderr(samples: list[float]) -> float:
    if len(samples) < 2:
        return math.inf
    mean = statistics.fmean(samples)
    if mean <= 0:
        return 0.0 if all(s == 0 for s in samples) else math.inf
    return statistics.stdev(samples) / math.sqrt(len(samples)) / mean


class StopRule:
    """Incremental form of the policy: `add(sample)` then `done()`; `warming()` while in warm-up."""

    def __init__(self, policy: RepeatPolicy, clock: Callable[[], float] = time.perf_counter) -> None:
        self.policy = policy
        self._clock = clock
        self._seen = 0
        self._t0: float | None = None
        self.samples: list[float] = []

    def warming(self) -> bool:
        return self._seen < self.policy.warmup

    def add(self, seconds: float) -> None:
        if self._t0 is None:
            self._t0 = self._clock()
        if self._seen >= self.policy.warmup:
            self.samples.append(seconds)
        self._seen += 1

    def done(self) -> bool:
        n = len(self.samples)
        if n < self.policy.min_reps:
            return False
        if n >= self.policy.max_reps:
            return True
        if self._t0 is not None and self._clock() - self._t0 >= self.policy.time_cap_s:
            return True
        return _rel_stderr(self.samples) <= self.policy.rel_err

    def result(self) -> Measurement:
        return Measurement.of(self.samples, self.policy.rel_err)


def measure(run_once: Callable[[], float], policy: RepeatPolicy) -> Measurement:
    """Time `run_once` (returns seconds of one repetition) until stable; warm-up excluded."""
    rule = StopRule(policy)
    while True:
        rule.add(run_once())
        if not rule.warming() and rule.done():
            return rule.result()


def cpu_timer(fn: Callable[[], object]) -> Callable[[], float]:
    """A `run_once` for CPU work: wall time of one call of `fn`."""

    def run_once() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run_once
