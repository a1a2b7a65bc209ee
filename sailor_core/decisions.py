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

The decision core, one for the flow's `replan` and the replay's Sailor policy alike (neither keeps
a copy of any step):

    assess(Happened, RunningJob, limits=PlanRequest, held=pool) -> Assessment
        why the current plan cannot go on (GPUs gone, or a limit it now breaks), the steps left and
        those a switch redoes, and the requests to plan: the best on the GPUs still held (after a
        loss) and the best on everything offered (`limits` with its pool)
    the caller plans them (and, after a loss, moves the lost plan's shape: `Assessment.move_current`)
    choose(Assessment, options, objective, times, min_gain) -> Verdict
        switch, stay or wait, the option chosen, and the reason a person reads in the run history

`reconfiguration_estimate(...)` is the reconfiguration time the decisions assume: what this run
measured of its own switches in place, else what earlier runs measured, else what starting this
provider's VMs measured, and a constant only when nothing was measured (the reason names which).
`known_reconfiguration(...)` picks those inputs out of the store's measurements (`Measured`): the
flow passes every row the store holds when it decides, the replay of a run the rows recorded before
that decision, so both assume the same figure from the same inputs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sailor_core.domain import Market, ParallelPlan, ResourcePool
from sailor_core.planner.request import PlanRequest
from sailor_core.planner.risk import vm_start_from_history
from sailor_core.units import sig, usd

PlaceKey = tuple[str, str, Market]  # (zone, GPU type, market)


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


# -- the decision core ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Happened:
    """What monitoring saw, as a decision weighs it."""

    kinds: tuple[str, ...]  # what happened: provider event kinds, "iteration_time", "tick", ...
    step: int  # steps done when deciding
    gone: Mapping[PlaceKey, int] = field(default_factory=dict)  # GPUs of the current plan gone, per place


@dataclass(frozen=True, kw_only=True)
class RunningJob:
    """The job as it stands: its plan (None: nothing rented) and that plan's cost at the prices in force."""

    plan: ParallelPlan | None
    cost: PlanCost | None
    total_steps: int
    checkpoint_interval: int


@dataclass(frozen=True, kw_only=True)
class Assessment:
    """What `assess` found: the ground a decision stands on, and what to plan for it."""

    happened: Happened
    job: RunningJob
    broken: str  # why the current plan cannot go on as it is ("" if it can)
    lost: bool  # GPUs the current plan holds are gone
    remaining_steps: int
    lost_steps: int  # steps a switch redoes: after a loss, those since the last periodic checkpoint
    requests: tuple[tuple[str, PlanRequest], ...]  # (kind, request): "held" first, then "best"

    @property
    def move_current(self) -> bool:
        """After a loss, the lost plan's own shape moved to where it fits now is a candidate too."""
        return self.lost and self.job.plan is not None

    @property
    def unusable(self) -> bool:
        """The current plan cannot go on: it lost GPUs, or nothing is rented."""
        return self.lost or self.job.plan is None


def gone_words(gone: Mapping[PlaceKey, int]) -> str:
    """GPUs gone, in words: "2 GPU(s) of the plan lost (2x A100-40 spot @us-east1-b)"."""
    places = ", ".join(f"{n}x {g} {m.value} @{z}" for (z, g, m), n in sorted(gone.items(), key=lambda kv: (
        kv[0][0], kv[0][1], kv[0][2].value)))
    return f"{sum(gone.values())} GPU(s) of the plan lost ({places})"


def assess(happened: Happened, job: RunningJob, *, limits: PlanRequest,
           held: ResourcePool | None = None) -> Assessment:
    """The ground for a decision (see the module's contract). `limits`: what the run asks the planner
    for, over everything offered now; `held`: after a loss, the GPUs of the current plan still there."""
    lost = bool(happened.gone) and job.plan is not None
    broken = ""
    if lost:
        broken = gone_words(happened.gone)
    elif job.plan is None:
        broken = "nothing rented"
    elif job.cost is not None:
        c = job.cost
        v = limits.constraints.violations(
            usd_per_iteration=c.usd_per_iteration, usd_per_hour=c.usd_per_hour,
            iterations_per_s=1.0 / c.iteration_time_s if c.iteration_time_s > 0 else math.inf)
        if v:
            broken = "the current plan now breaks a limit: " + "; ".join(v)
    step = happened.step
    every = max(1, job.checkpoint_interval)
    # a whole plan stops at a step boundary with a checkpoint (its state kept): only a loss risks steps
    lost_steps = step - (step // every) * every if lost else 0
    requests: list[tuple[str, PlanRequest]] = []
    if lost and held is not None and held.entries:
        requests.append(("held", replace(limits, pool=held)))
    requests.append(("best", limits))
    return Assessment(happened=happened, job=job, broken=broken, lost=lost,
                      remaining_steps=max(0, job.total_steps - step), lost_steps=lost_steps,
                      requests=tuple(requests))


def within_limits(limits: PlanRequest, cost: PlanCost) -> bool:
    """Whether a plan of this cost keeps every limit of the request."""
    return not limits.constraints.violations(
        usd_per_iteration=cost.usd_per_iteration, usd_per_hour=cost.usd_per_hour,
        iterations_per_s=1.0 / cost.iteration_time_s if cost.iteration_time_s > 0 else math.inf)


@dataclass(frozen=True, kw_only=True)
class Option:
    """A plan that could follow the current one, and what starting it takes."""

    kind: str  # "held" (on the GPUs still held) | "best" (on everything offered) | "moved" (the lost plan moved)
    plan: ParallelPlan
    replacement: Replacement


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What to do: "switch" (to `option`), "stay", or "wait" (nothing can run), and why."""

    kind: str
    reason: str
    option: Option | None = None
    decision: SwitchDecision | None = None
    startup_s: float = 0.0  # what the chosen option's start was charged
    weighed: tuple[tuple[str, float, float], ...] = ()  # (kind, start s, time or cost to finish), as `options`


# How each option a reason lists is named for people (Option.kind).
WEIGHED_AS = {"held": "the best plan on the VMs still held", "best": "the best plan on everything offered",
              "moved": "the lost plan moved to where it fits now"}


def choose(a: Assessment, options: Sequence[Option], *, objective: str, times: StartupTimes,
           min_gain: float = 0.0) -> Verdict:
    """Switch, stay or wait, over the options the caller planned for `a` (see the module's contract)."""
    said = f"after {', '.join(a.happened.kinds) or 'a check'} at step {a.happened.step}: "
    if not options:
        if a.unusable:
            return Verdict(kind="wait", reason=said + "no feasible plan with the GPUs available now; waiting")
        return Verdict(kind="stay",
                       reason=said + "no feasible plan with current offerings; staying on the current plan")
    if a.unusable:
        pick = best_replacement(objective=objective, candidates=[o.replacement for o in options],
                                remaining_steps=a.remaining_steps, lost_steps=a.lost_steps, times=times)
    else:  # a whole plan is weighed against the best plan on everything offered
        pick = next((i for i, o in enumerate(options) if o.kind == "best"), 0)
    chosen = options[pick]
    # A plan that cannot go on waits for its replacement's new VMs; a whole one trains on while they start.
    took = startup_s(chosen.replacement, times) if a.unusable else times.reconfiguration_s
    d = decide_switch(objective=objective, current=None if a.unusable else a.job.cost,
                      candidate=chosen.replacement.cost, remaining_steps=a.remaining_steps,
                      lost_steps=a.lost_steps, reconfiguration_s=took, min_gain=min_gain,
                      current_broken=a.broken, same_plan=chosen.plan == a.job.plan and not a.unusable)
    weighed = _weighed(a, options, times, objective)
    listed = "" if len(weighed) < 2 else "; replacements weighed: " + "; ".join(
        f"{WEIGHED_AS.get(k, k)} (starts in {s:.0f} s{_new_vms(options[i])}): "
        + (f"{sig(total)} s to finish" if objective == "max-throughput" else f"{usd(total)} USD to finish")
        + (" (chosen)" if i == pick else "") for i, (k, s, total) in enumerate(weighed))
    return Verdict(kind="switch" if d.switch else "stay", reason=said + d.reason + listed,
                   option=chosen if d.switch else None, decision=d, startup_s=took, weighed=weighed)


def _new_vms(o: Option) -> str:
    n = o.replacement.new_vms
    return f", {n} new VM{'s' if n != 1 else ''}" if n else ""


def _weighed(a: Assessment, options: Sequence[Option], times: StartupTimes,
             objective: str) -> tuple[tuple[str, float, float], ...]:
    at = 0 if objective == "max-throughput" else 1
    out = []
    for o in options:
        took = startup_s(o.replacement, times)
        total = switch_outcome(o.replacement.cost, remaining_steps=a.remaining_steps, lost_steps=a.lost_steps,
                               reconfiguration_s=took)[at]
        out.append((o.kind, took, total))
    return tuple(out)


def calibrated_factors(factors: Mapping[str, float], ratio: float, gpu_types: Iterable[str]) -> dict[str, float]:
    """The layer-time factors after measuring a plan on `gpu_types` at `ratio` x its estimate."""
    out = dict(factors)
    for g in sorted(set(gpu_types)):
        out[g] = out.get(g, 1.0) * ratio
    return out


def reconfiguration_estimate(*, this_run_in_place_s: Sequence[float], earlier_in_place_s: Sequence[float] = (),
                             vm_start_s: float | None = None, assumed_s: float) -> tuple[float, str]:
    """The seconds a switch in place is assumed to take, and where that figure comes from: the longest
    switch in place this run measured; else the median of those earlier runs measured; else the
    measured start of this provider's VMs (request to first step: a switch in place restarts no VM,
    so this bounds it from above); else `assumed_s`."""
    if this_run_in_place_s:
        return max(this_run_in_place_s), f"the longest of this run's {len(this_run_in_place_s)} measured switch(es)"
    if earlier_in_place_s:
        return (statistics.median(earlier_in_place_s),
                f"the median of {len(earlier_in_place_s)} switch(es) measured by earlier runs")
    if vm_start_s is not None:
        return vm_start_s, "this provider's measured VM start (no switch measured yet)"
    return assumed_s, "assumed (nothing measured yet)"


@dataclass(frozen=True, kw_only=True)
class Measured:
    """A figure of the store's history that the reconfiguration estimate reads: a switch some run
    measured (`kind` "reconfiguration", with the VMs it rented) or a provider's VM start ("vm_start")."""

    run_id: str
    kind: str
    seconds: float
    new_vms: int | None = None
    provider: str | None = None

    @classmethod
    def of(cls, run_id: str, kind: str, payload: Mapping[str, Any]) -> Measured | None:
        """The measurement row (its run, kind and payload) as such a figure; None for other rows."""
        key = {"reconfiguration": "reconfiguration_s", "vm_start": "vm_start_s"}.get(kind)
        if key is None or payload.get(key) is None:
            return None
        new_vms = payload.get("new_vms")
        return cls(run_id=run_id, kind=kind, seconds=float(payload[key]),
                   new_vms=None if new_vms is None else int(new_vms), provider=payload.get("provider"))


def known_reconfiguration(*, run_id: str, provider: str, this_run_in_place_s: Sequence[float],
                          measured: Iterable[Measured], assumed_s: float) -> tuple[float, str]:
    """`reconfiguration_estimate` over what run `run_id` on `provider` knew: its own switches in place,
    and in `measured` (what the store held when it decided) earlier runs' switches that rented no VM
    and this provider's VM starts (its own included)."""
    if this_run_in_place_s:
        return reconfiguration_estimate(this_run_in_place_s=this_run_in_place_s, assumed_s=assumed_s)
    rows = list(measured)
    earlier = [m.seconds for m in rows if m.kind == "reconfiguration" and m.new_vms == 0 and m.run_id != run_id]
    start = vm_start_from_history(m.seconds for m in rows if m.kind == "vm_start" and m.provider == provider)
    return reconfiguration_estimate(this_run_in_place_s=(), earlier_in_place_s=earlier, vm_start_s=start,
                                    assumed_s=assumed_s)
