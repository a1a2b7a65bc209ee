"""Is a new plan worth the switch? Pure arithmetic over the remaining work; no I/O, no Prefect.

Used by the replan subflow (through tasks.decisions) and by the trace replay (sailor_core.replay),
so a replayed job decides exactly as a live run does.

Contract: `decide_switch(...)` compares finishing the remaining steps on the current plan with
reconfiguring to the candidate and finishing there, under the run's objective, and returns a
`SwitchDecision` with the numbers and a one-line reason a person can read in the run history.

    stay:    time = R * t_cur                          cost = R * c_cur
    switch:  time = T_reconf + (R + L) * t_new         cost = T_reconf * h_new / 3600 + (R + L) * c_new

R remaining steps, L steps lost since the last checkpoint (redone under the new plan), t the
(calibrated) iteration time in s, c the USD per iteration, h the USD per hour of the new plan's
VMs (billed while they start up), T_reconf the reconfiguration time (measured in this run when it
has reconfigured before, else the caller's estimate). Under max-throughput the gain is seconds
saved; under the cost objectives it is dollars saved. A switch happens when gain > min_gain.
A current plan that cannot go on (workers lost) or now breaks a limit is always left, if the
candidate can run.

`best_replacement(...)` picks, among plans that could replace one that cannot go on (the best on
the GPUs still held, the best on everything that can be rented, the same shape moved elsewhere),
the one whose switch finishes the remaining work soonest (max-throughput) or cheapest (the cost
objectives), by the same arithmetic, each charged its own start (`startup_s`): a plan on the VMs
still held waits for the reconfiguration alone; one that needs new VMs also waits for them to start
(provisioning to the first step, as measured per provider) and for its ranks to load their state
(the largest shard at the checkpoint's read rate), and pays for them meanwhile. The first of equals
wins, so a caller lists the plan that needs no new VMs first. Without it a shrink onto the GPUs
still held would run until the next change however much slower it is, and over a long remainder
that costs far more than it saves; a move to new VMs that cannot win back their start is not made.
The flow's replan subflow and the replay's Sailor policy both decide with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class PlanCost:
    iteration_time_s: float
    usd_per_iteration: float
    usd_per_hour: float


@dataclass(frozen=True, kw_only=True)
class SwitchDecision:
    switch: bool
    forced: bool
    reason: str
    gain: float
    gain_unit: str
    stay_time_s: float
    stay_usd: float
    switch_time_s: float
    switch_usd: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def switch_outcome(candidate: PlanCost, *, remaining_steps: int, lost_steps: int,
                   reconfiguration_s: float) -> tuple[float, float]:
    """Seconds and USD to finish the remaining steps after switching to `candidate` (the formula above)."""
    n = max(0, remaining_steps) + lost_steps
    return (reconfiguration_s + n * candidate.iteration_time_s,
            reconfiguration_s * candidate.usd_per_hour / 3600.0 + n * candidate.usd_per_iteration)


@dataclass(frozen=True, kw_only=True)
class Replacement:
    """A plan that could replace one that cannot go on, and what it must wait for before its first step."""

    cost: PlanCost
    new_vms: int = 0  # VMs it must rent (0: it runs on the VMs the job still holds)
    load_bytes: float = 0.0  # the training state the largest rank on a new VM loads before its first step


@dataclass(frozen=True, kw_only=True)
class StartupTimes:
    """What starting a replacement takes, as the run knows it when it decides."""

    reconfiguration_s: float  # a switch on VMs already held (measured by the run, else its estimate)
    vm_start_s: float = 0.0  # new VMs, from the provisioning request to training (measured per provider)
    load_bytes_per_s: float = math.inf  # a rank reading its state from the checkpoint

    def __post_init__(self) -> None:
        if not (self.reconfiguration_s >= 0 and self.vm_start_s >= 0 and self.load_bytes_per_s > 0):
            raise ValueError(f"startup times must be >= 0 (and a positive read rate), got {self}")


def startup_s(r: Replacement, times: StartupTimes) -> float:
    """Seconds from the decision to the replacement's first step: the reconfiguration, and for a plan on
    new VMs their start and the load of the largest shard onto them (the new VMs start and load in
    parallel, so one of each counts)."""
    if r.new_vms <= 0:
        return times.reconfiguration_s
    return times.reconfiguration_s + times.vm_start_s + r.load_bytes / times.load_bytes_per_s


def best_replacement(*, objective: str, candidates: Sequence[Replacement], remaining_steps: int, lost_steps: int,
                     times: StartupTimes) -> int:
    """The index of the candidate whose switch finishes the remaining work soonest (max-throughput) or
    cheapest (other objectives), each with its own start; the first of equals (list the one that needs
    no new VMs first)."""
    if not candidates:
        raise ValueError("best_replacement needs at least one candidate")
    at = 0 if objective == "max-throughput" else 1
    scores = [switch_outcome(c.cost, remaining_steps=remaining_steps, lost_steps=lost_steps,
                             reconfiguration_s=startup_s(c, times))[at] for c in candidates]
    return min(range(len(scores)), key=lambda k: (scores[k], k))


def decide_switch(
    *,
    objective: str,
    current: PlanCost | None,
    candidate: PlanCost,
    remaining_steps: int,
    lost_steps: int,
    reconfiguration_s: float,
    min_gain: float = 0.0,
    current_broken: str = "",
    same_plan: bool = False,
) -> SwitchDecision:
    """`current` None or `current_broken` non-empty: the current plan cannot continue (or breaks a limit)."""
    r = max(0, remaining_steps)
    sw_time, sw_usd = switch_outcome(candidate, remaining_steps=r, lost_steps=lost_steps,
                                     reconfiguration_s=reconfiguration_s)
    unit = "s" if objective == "max-throughput" else "USD"
    if current is None or current_broken:
        why = current_broken or "the current plan cannot continue"
        return SwitchDecision(switch=True, forced=True, reason=f"{why}; adopting the new plan",
                              gain=float("inf"), gain_unit=unit, stay_time_s=float("inf"), stay_usd=float("inf"),
                              switch_time_s=sw_time, switch_usd=sw_usd)
    st_time = r * current.iteration_time_s
    st_usd = r * current.usd_per_iteration
    if same_plan:
        return SwitchDecision(switch=False, forced=False, reason="the best plan is the current plan", gain=0.0,
                              gain_unit=unit, stay_time_s=st_time, stay_usd=st_usd, switch_time_s=sw_time,
                              switch_usd=sw_usd)
    gain = st_time - sw_time if unit == "s" else st_usd - sw_usd
    if unit == "s":
        numbers = (f"{r} steps left: stay {st_time:.1f}s, switch {sw_time:.1f}s "
                   f"(incl. {reconfiguration_s:.1f}s reconfiguration, {lost_steps} steps redone)")
        fmt = f"{gain:+.1f}s"
    else:
        numbers = (f"{r} steps left: stay {st_usd:.6f} USD, switch {sw_usd:.6f} USD "
                   f"(incl. {reconfiguration_s:.1f}s reconfiguration, {lost_steps} steps redone)")
        fmt = f"{gain:+.6f} USD"
    switch = gain > min_gain
    verdict = "switch pays" if switch else "not worth the switch"
    return SwitchDecision(
        switch=switch,
        forced=False,
        reason=f"{verdict}: gain {fmt} (threshold {min_gain:g}); {numbers}",
        gain=gain,
        gain_unit=unit,
        stay_time_s=st_time,
        stay_usd=st_usd,
        switch_time_s=sw_time,
        switch_usd=sw_usd,
    )
