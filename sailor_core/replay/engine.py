"""The discrete-event replay of one training job over a trace, under one reaction policy.

Contract: `replay(trace, book, job, policy)` is pure and deterministic. Time jumps from decision
point to decision point: every trace point (availability or prices changed) and, for a policy
with a period, every tick. At each point the engine prices the current plan at the prices in
force (`simulate`, as the flow's `estimate`), notes whether GPUs the plan holds are gone and
whether it now breaks a limit, and asks the policy (policies.py) what to do: stay, switch to a
plan, or wait with nothing rented. Between points the job trains at the simulated iteration time
and pays the plan's USD per hour. What a change costs, modelled on what the flow and the runtime
do (docs/replay.md):

- switch (voluntary): the old plan stops at once (SIGTERM: the runtime checkpoints on stop), the
  new plan trains `reconfiguration_s` later and is billed from the decision (as decide_switch
  assumes: its VMs are billed while they start);
- preemption (the trace takes GPUs the plan holds): the notice comes `grace_s` before the VMs go.
  With `checkpoint_on_notice` (the runtime writes a just-in-time checkpoint on a notice) the old
  plan keeps training until it is stopped, min(grace, reconfiguration) later, and loses nothing;
  without it the old plan trains until its VMs go and every step since the last periodic
  checkpoint (each `checkpoint_interval` steps) is redone. The old plan is billed for that window.
- waiting: nothing is rented and nothing trains; a restart is a reconfiguration.
- new VMs: a plan that replaces one that lost GPUs (or restarts from waiting) on GPUs the job does
  not hold also waits `vm_start_s` for its new VMs and loads its largest shard at `load_bytes_per_s`
  (`sailor_core.decisions.startup_s`, as the flow charges it). A voluntary switch of a whole plan
  rents its new VMs while the old plan trains on, so it waits for the reconfiguration alone.

The planner is memoised per pool (availability and price vector); with `reuse_dominating_plans`
a pool with no more GPUs anywhere than a pool already planned, at the same prices, reuses that
pool's best plan when it still fits (for the exact optimum it is still the best).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sailor_core.decisions import (
    Assessment,
    Happened,
    PlanCost,
    Replacement,
    RunningJob,
    StartupTimes,
    SwitchDecision,
    assess,
    startup_s,
)
from sailor_core.domain import Capacity, Market, ModelSpec, ParallelPlan, ResourcePool
from sailor_core.errors import SailorError
from sailor_core.planner import Constraints, Objective, PlanRequest, Restrictions, SearchOptions, summarize
from sailor_core.planner import plan as run_planner
from sailor_core.planner.costs import SimCosts
from sailor_core.planner.risk import (  # the flow's stand-ins before it has measured or planned
    DEFAULT_CHECKPOINT_INTERVAL_STEPS,
    DEFAULT_RECONFIGURATION_S,
    largest_shard_bytes,
)
from sailor_core.planner.verify import sim_options
from sailor_core.profiles import ProfileBook, calibrated_book
from sailor_core.replay.trace import Trace, TracePoint
from sailor_core.simulator import simulate

# GCP gives a Spot VM 30 s between the preemption notice and the stop (AWS gives 120 s).
DEFAULT_GRACE_S = 30.0
# The deployment's cost-aware rerun runs every 6 hours (prefect.yaml: cron "0 */6 * * *").
DEFAULT_PERIOD_S = 6 * 3600.0
# After the trace's last point its state holds; a job still waiting for GPUs by then stops here.
HORIZON_AFTER_TRACE_S = 30 * 86_400.0

PlaceKey = tuple[str, str, Market]

# The replay's default search: the planner's, narrowed (one stage count past the best, one replica
# shape per stage, 4 plans re-scored, uniform/balanced partitions beyond 8) so a 2,048-GPU pool
# plans in a fraction of a second; `sailor replay --search full` is the flow's own search. It keeps
# the flow's second pipeline groups (mixed_pipelines): without them the plans after a loss were
# 36-43% slower on bench/bench_replay.py's pools, and Sailor's policy decided on plans the
# flow would never choose. One shape per stage (max_shapes=1) chose the same plans there at about
# half the search time.
FAST_SEARCH: dict[str, Any] = dict(patience=1, mixed_pipelines=4, max_shapes=1, rescore_top=4,
                                   exhaustive_partitions_up_to=8)


@dataclass(frozen=True, kw_only=True)
class ReplayJob:
    """The job to replay and the costs of changing its plan."""

    model: str
    global_batch_size: int
    total_steps: int
    tokens_per_step: int
    objective: str = "max-throughput"
    constraints: Constraints = field(default_factory=Constraints)
    restrictions: Restrictions = field(default_factory=Restrictions)
    search: SearchOptions = field(default_factory=SearchOptions)
    checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL_STEPS
    reconfiguration_s: float = DEFAULT_RECONFIGURATION_S
    # A replacement on GPUs the job does not hold: its new VMs' start (provisioning request to the first
    # step) and the rate its ranks load their state at (0 and inf: not charged).
    vm_start_s: float = 0.0
    load_bytes_per_s: float = math.inf
    grace_s: float = DEFAULT_GRACE_S
    checkpoint_on_notice: bool = True
    min_gain: float = 0.0
    period_s: float = DEFAULT_PERIOD_S
    reuse_dominating_plans: bool = True
    # After a loss, the sailor policy weighs its replacements as the flow does (policies.py); False: shrink
    # first, the flow's former rule.
    weigh_replacements: bool = True

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "total_steps", "tokens_per_step", "checkpoint_interval"):
            if getattr(self, name) < 1:
                raise SailorError(
                    f"replay: {name} must be >= 1, got {getattr(self, name)}; to fix: pass a positive value"
                )
        if not self.load_bytes_per_s > 0:
            raise SailorError(f"replay: load_bytes_per_s must be > 0, got {self.load_bytes_per_s}")
        for name in ("reconfiguration_s", "vm_start_s", "grace_s", "min_gain"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise SailorError(f"replay: {name} must be >= 0, got {v}; to fix: pass a non-negative number")
        if not self.period_s > 0:
            raise SailorError(f"replay: period_s must be > 0, got {self.period_s}")

    def request(self, pool: ResourcePool) -> PlanRequest:
        """What the job asks the planner for on `pool` (the flow's `RunContext.plan_request`)."""
        return PlanRequest(model=self.model, global_batch_size=self.global_batch_size, pool=pool,
                           objective=Objective.parse(self.objective), constraints=self.constraints,
                           restrictions=self.restrictions, options=self.search)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    plan: ParallelPlan
    cost: PlanCost


def as_replacement(plan: ParallelPlan, cost: PlanCost, held: ResourcePool | None,
                   current: ParallelPlan | None, model: ModelSpec) -> Replacement:
    """`plan` replacing `current`, of which `held` is left after a loss (None: all of it is held): new VMs
    when it needs GPUs the job does not hold, and then the largest shard its ranks load."""
    have = counts_of(held) if held is not None else (current.gpus_by_place() if current is not None else {})
    per_vm = {(r.zone, r.gpu_type, r.market): max(1, r.gpus_per_node) for st in plan.stages for r in st.replicas}
    new = sum(-(-max(0, n - have.get(k, 0)) // per_vm[k]) for k, n in plan.gpus_by_place().items())
    return Replacement(cost=cost, new_vms=new, load_bytes=float(largest_shard_bytes(plan, model)) if new else 0.0)


def pool_key(pool: ResourcePool) -> tuple[tuple[str, str, str, int, float], ...]:
    return tuple(sorted((e.zone, e.gpu_type, e.market.value, e.gpus, e.usd_per_gpu_hour) for e in pool.entries))


def counts_of(pool: ResourcePool) -> dict[PlaceKey, int]:
    return {(e.zone, e.gpu_type, e.market): e.gpus for e in pool.entries}


def missing_gpus(plan: ParallelPlan, pool: ResourcePool) -> dict[PlaceKey, int]:
    """GPUs the plan uses that the pool does not offer, per place (empty: the plan fits)."""
    have = counts_of(pool)
    return {k: n - have.get(k, 0) for k, n in plan.gpus_by_place().items() if n > have.get(k, 0)}


class Planner:
    """The planner and the simulator behind the policies, memoised (pure: same answers, fewer calls)."""

    def __init__(self, book: ProfileBook, job: ReplayJob, *, root: Planner | None = None) -> None:
        self.book = book
        self.job = job
        self.calls = 0
        self.hits = 0
        self.search_s = 0.0
        self._root = root or self  # calibrated variants count their calls on the planner they came from
        self._best: dict[Any, Candidate | None] = {}
        self._by_prices: dict[Any, list[tuple[dict[PlaceKey, int], Candidate]]] = {}
        self._cost: dict[Any, PlanCost] = {}
        self._keep: list[ParallelPlan] = []
        self._calibrated: dict[tuple[tuple[str, float], ...], Planner] = {}
        self._costs: SimCosts | None = None  # the search's memoised costs, shared by every pool of this book

    def calibrated(self, factors: tuple[tuple[str, float], ...]) -> Planner:
        """The same planner over the book with these GPU types' layer times scaled (memoised too)."""
        if not factors:
            return self
        key = tuple(sorted(factors))
        child = self._calibrated.get(key)
        if child is None:
            child = Planner(calibrated_book(self.book, dict(key)), self.job, root=self._root)
            self._calibrated[key] = child
        return child

    def best(self, pool: ResourcePool) -> Candidate | None:
        """The planner's best plan for the pool (None: nothing feasible)."""
        key = pool_key(pool)
        if key in self._best:
            self._root.hits += 1
            return self._best[key]
        prices = tuple(sorted((e.zone, e.gpu_type, e.market.value, e.usd_per_gpu_hour) for e in pool.entries))
        if self.job.reuse_dominating_plans:
            have = counts_of(pool)
            for counts, known in self._by_prices.get(prices, ()):
                if all(have.get(k, 0) <= n for k, n in counts.items()) and set(have) <= set(counts) \
                        and not missing_gpus(known.plan, pool):
                    self._root.hits += 1
                    self._best[key] = known
                    return known
        req = self.job.request(pool)
        t0 = time.perf_counter()
        if self._costs is None:
            self._costs = SimCosts(self.book, precision=self.job.search.precision)
        result = run_planner(req, self.book, costs=self._costs)
        self._root.search_s += time.perf_counter() - t0
        self._root.calls += 1
        cand: Candidate | None = None
        est = result.estimate
        if result.plan is not None and est is not None:
            cand = Candidate(plan=result.plan, cost=PlanCost(iteration_time_s=est.iteration_time_s,
                                                             usd_per_iteration=est.usd_per_iteration,
                                                             usd_per_hour=est.usd_per_hour))
            self._by_prices.setdefault(prices, []).append((counts_of(pool), cand))
        self._best[key] = cand
        return cand

    def cost(self, plan: ParallelPlan, pool: ResourcePool) -> PlanCost:
        """The plan's simulated time and cost at the pool's prices (the flow's `estimate`)."""
        opts = sim_options(pool, self.job.search.precision, self.job.search.schedule)
        prices = opts.prices_usd_per_gpu_hour or {}
        key = (id(plan), tuple(sorted((k[0], k[1], k[2].value, prices.get(k, -1.0)) for k in plan.gpus_by_place())))
        got = self._cost.get(key)
        if got is None:
            r = simulate(plan, self.book, options=opts)
            got = PlanCost(iteration_time_s=r.iteration_time_s, usd_per_iteration=r.usd_per_iteration,
                           usd_per_hour=r.usd_per_hour)
            self._keep.append(plan)  # id() stays unique while the plan is alive
            self._cost[key] = got
        return got


@dataclass(frozen=True, kw_only=True)
class View:
    """What a policy sees at a decision point."""

    t_s: float
    trigger: str  # "start" | "change" | "tick"
    pool: ResourcePool
    job: ReplayJob
    planner: Planner
    current: ParallelPlan | None  # None: nothing rented (waiting)
    current_cost: PlanCost | None
    lost: bool  # GPUs the current plan holds are gone
    broken: str  # why the current plan cannot go on as it is ("" if it can)
    initial: ParallelPlan | None  # the job's first plan (None before it has one)
    remaining_steps: int
    lost_steps: int  # after a loss, steps since the last periodic checkpoint (what decide_switch charges); else 0
    reconfiguration_s: float  # the reconfiguration time in force (the job's, or one measured since)
    assessment: Assessment  # the decision core's ground (sailor_core.decisions.assess), also for the fields above
    held: ResourcePool | None = None  # when GPUs were lost: those of the current plan still there

    @property
    def startup(self) -> StartupTimes:
        """What starting a replacement takes now (`replacement` charges a plan its own)."""
        return StartupTimes(reconfiguration_s=self.reconfiguration_s, vm_start_s=self.job.vm_start_s,
                            load_bytes_per_s=self.job.load_bytes_per_s)

    def replacement(self, plan: ParallelPlan, cost: PlanCost) -> Replacement:
        """`plan` as a replacement of the current plan: new VMs when it uses GPUs the job does not hold."""
        return as_replacement(plan, cost, self.held if self.lost else None, self.current, self.planner.book.model)


@dataclass(frozen=True, kw_only=True)
class Action:
    kind: str  # "switch" | "stay" | "wait"
    reason: str
    plan: ParallelPlan | None = None
    decision: SwitchDecision | None = None
    record: bool = True  # False: a routine "nothing to do" not worth a line in the decisions


Policy = Callable[[View], Action]


@dataclass(frozen=True, kw_only=True)
class Segment:
    start_s: float
    end_s: float
    state: str  # "train" | "reconfigure" | "wait"
    gpus: int
    usd_per_hour: float


@dataclass(frozen=True, kw_only=True)
class Decision:
    t_s: float
    trigger: str
    kind: str
    reason: str
    step: int


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    policy: str
    trace: str
    finished: bool
    time_to_train_s: float
    usd: float
    total_steps: int
    steps_done: float
    tokens: int
    goodput_steps_per_s: float
    gpu_hours: float
    gpu_hours_wasted: float
    redone_steps: float
    reconfiguration_s: float
    waiting_s: float
    switches: int
    decisions: tuple[Decision, ...]
    segments: tuple[Segment, ...]
    progress: tuple[tuple[float, float, float], ...]  # (t_s, steps done, USD so far)
    planner_calls: int
    planner_hits: int
    planner_s: float
    wall_s: float
    cpu_s: float  # this process's CPU time for the replay (the wall time grows with the machine's load)

    def to_json(self, *, detail: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy, "trace": self.trace, "finished": self.finished,
            "time_to_train_s": round(self.time_to_train_s, 3), "time_to_train_h": round(self.time_to_train_s / 3600, 4),
            "usd": round(self.usd, 4), "total_steps": self.total_steps, "steps_done": round(self.steps_done, 3),
            "tokens": self.tokens, "goodput_steps_per_s": self.goodput_steps_per_s,
            "gpu_hours": round(self.gpu_hours, 4), "gpu_hours_wasted": round(self.gpu_hours_wasted, 4),
            "redone_steps": round(self.redone_steps, 3), "reconfiguration_s": round(self.reconfiguration_s, 3),
            "waiting_s": round(self.waiting_s, 3), "switches": self.switches,
            "decision_points": len(self.decisions), "planner_calls": self.planner_calls,
            "planner_hits": self.planner_hits, "planner_s": round(self.planner_s, 3), "wall_s": round(self.wall_s, 3),
            "cpu_s": round(self.cpu_s, 3),
        }
        if detail:
            out["decisions"] = [{"t_s": d.t_s, "trigger": d.trigger, "kind": d.kind, "step": d.step, "reason": d.reason}
                                for d in self.decisions]
        return out


@dataclass(kw_only=True)
class _State:
    t: float = 0.0
    step: float = 0.0
    plan: ParallelPlan | None = None
    cost: PlanCost | None = None
    gpus: int = 0
    ready_at: float = 0.0
    initial: ParallelPlan | None = None
    usd: float = 0.0
    gpu_hours: float = 0.0
    wasted_gpu_hours: float = 0.0
    redone: float = 0.0
    reconf_s: float = 0.0
    waiting_s: float = 0.0
    switches: int = 0
    done_at: float | None = None
    drain_until: float = 0.0  # a plan under notice trains until then (drain_* describe it)
    drain_it: float = 0.0
    drain_usd_per_hour: float = 0.0
    drain_gpus: int = 0
    reconf_now: float = 0.0  # the reconfiguration time in force
    calibration: tuple[tuple[str, float], ...] = ()
    decisions: list[Decision] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    progress: list[tuple[float, float, float]] = field(default_factory=list)

    def segment(self, a: float, b: float, state: str) -> None:
        if b <= a:
            return
        rate = self.cost.usd_per_hour if self.cost and state != "wait" else 0.0
        gpus = self.gpus if state != "wait" else 0
        last = self.segments[-1] if self.segments else None
        if last and last.state == state and last.end_s == a and last.gpus == gpus and last.usd_per_hour == rate:
            self.segments[-1] = Segment(start_s=last.start_s, end_s=b, state=state, gpus=gpus, usd_per_hour=rate)
        else:
            self.segments.append(Segment(start_s=a, end_s=b, state=state, gpus=gpus, usd_per_hour=rate))


def _advance(s: _State, until: float, total: int) -> None:
    """Train and pay from s.t to `until` (or to the last step, if it comes first)."""
    if s.drain_until > s.t:
        # A plan under a preemption notice trains on until it is stopped (its progress is kept:
        # the runtime checkpointed on the notice and checkpoints again when stopped).
        end = min(until, s.drain_until)
        need_s = (total - s.step) * s.drain_it
        if s.t + need_s <= end:
            end = s.t + need_s
            s.done_at = end
        s.step = min(float(total), s.step + (end - s.t) / s.drain_it)
        s.usd += s.drain_usd_per_hour * (end - s.t) / 3600.0
        s.gpu_hours += s.drain_gpus * (end - s.t) / 3600.0
        if s.done_at is not None:
            s.segment(s.t, end, "train")
            s.t = end
            return
    if s.plan is None or s.cost is None:
        s.segment(s.t, until, "wait")
        s.waiting_s += until - s.t
        s.t = until
        return
    start = max(s.t, s.ready_at)
    end = until
    if s.t < start < until:  # the timeline shows the pause while the plan starts
        s.progress.append((start, s.step, s.usd + s.cost.usd_per_hour * (start - s.t) / 3600.0))
    if start < until:
        it = s.cost.iteration_time_s
        need_s = (total - s.step) * it
        if start + need_s <= until:
            end = start + need_s
            s.done_at = end
        s.step = min(float(total), s.step + (end - start) / it)
    s.segment(s.t, min(start, end), "reconfigure")
    s.segment(min(start, end), end, "train")
    s.usd += s.cost.usd_per_hour * (end - s.t) / 3600.0
    s.gpu_hours += s.gpus * (end - s.t) / 3600.0
    s.t = end


def _when(pt: TracePoint, s: _State) -> float:
    """When a trace point takes effect: its time, or when the job reaches its step."""
    if pt.at_step is None:
        return pt.at_s
    if s.step + 1e-9 >= pt.at_step:
        return s.t
    step, t = s.step, s.t
    if s.drain_until > s.t:
        reach = s.t + (pt.at_step - s.step) * s.drain_it
        if reach <= s.drain_until:
            return reach
        step, t = s.step + (s.drain_until - s.t) / s.drain_it, s.drain_until
    if s.plan is None or s.cost is None:
        return math.inf  # nothing trains: the step is never reached
    return max(t, s.ready_at) + (pt.at_step - step) * s.cost.iteration_time_s


def _notice(s: _State, job: ReplayJob, t: float) -> None:
    """The trace took GPUs the plan holds: the old plan trains through the grace window, then goes."""
    assert s.plan is not None and s.cost is not None
    if job.checkpoint_on_notice:
        # Trains on until the flow stops it for the new plan (or the VMs go), progress kept.
        window = min(job.grace_s, s.reconf_now)
        if t + window > max(t, s.ready_at):
            s.drain_until, s.drain_it = t + window, s.cost.iteration_time_s
            s.drain_usd_per_hour, s.drain_gpus = s.cost.usd_per_hour, s.gpus
        return
    # No checkpoint on the notice: the old plan trains until its VMs go, then everything since the
    # last periodic checkpoint is lost and redone.
    training = max(0.0, t + job.grace_s - max(t, s.ready_at))
    reached = s.step + min(training / s.cost.iteration_time_s, job.total_steps - s.step)
    s.usd += s.cost.usd_per_hour * job.grace_s / 3600.0
    s.gpu_hours += s.gpus * job.grace_s / 3600.0
    kept = math.floor(reached / job.checkpoint_interval) * job.checkpoint_interval
    redone = reached - kept
    s.redone += redone
    s.wasted_gpu_hours += redone * s.cost.iteration_time_s * s.gpus / 3600.0
    s.step = float(kept)


def _kinds(trigger: str, lost: bool, trace: Trace, i: int) -> tuple[str, ...]:
    """What happened at a decision point, in the flow's words: what woke its replan where the point
    says (a run's history), else a preemption (GPUs of the plan taken), a price or capacity change
    against the point before, a scheduled tick, or the start."""
    if trigger == "start":
        return ("start",)
    if "change" in trigger and trace.points[i].happened:  # a run's history: what woke the flow's replan
        return trace.points[i].happened
    kinds = {"preemption"} if lost else set()
    if "change" in trigger and i > 0:
        before, now = trace.points[i - 1], trace.points[i]
        if before.usd_per_gpu_hour != now.usd_per_gpu_hour:
            kinds.add("price_change")
        if before.counts != now.counts and not lost:
            kinds.add("capacity_change")
    if "tick" in trigger:
        kinds.add("tick")
    return tuple(sorted(kinds)) or (trigger,)


def replay(trace: Trace, book: ProfileBook, job: ReplayJob, policy: Policy, *, name: str = "",
           period_s: float | None = None, planner: Planner | None = None) -> ReplayResult:
    """Replay the job over the trace under `policy` (ticks every `period_s` when given)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    planner = planner or Planner(book, job)
    calls0, hits0, search0 = planner.calls, planner.hits, planner.search_s
    s = _State(reconf_now=job.reconfiguration_s)
    times = [pt.at_s for pt in trace.points]
    horizon = times[-1] + HORIZON_AFTER_TRACE_S
    i = 0  # trace point in force
    next_tick = period_s if period_s else math.inf
    trigger = "start"
    while True:
        pool, pt = trace.pool_at(i), trace.points[i]
        if pt.calibration:
            s.calibration = pt.calibration
        if pt.reconfiguration_s is not None:
            s.reconf_now = pt.reconfiguration_s
        _decide(s, job, planner.calibrated(s.calibration), policy, pool, trigger, trace.taken_at(i) if i else {},
                trace, i)
        s.progress.append((s.t, s.step, s.usd))
        if s.step >= job.total_steps and s.done_at is None:
            s.done_at = s.t
        if s.done_at is not None:
            break
        nxt_change = _when(trace.points[i + 1], s) if i + 1 < len(times) else math.inf
        nxt = min(nxt_change, next_tick)
        if nxt == math.inf:
            # Nothing changes any more: train to the end, or stop if nothing is rented.
            if s.plan is None:
                _advance(s, horizon, job.total_steps)
                break
            _advance(s, math.inf, job.total_steps)
            break
        if nxt > horizon:
            _advance(s, horizon, job.total_steps)
            break
        _advance(s, nxt, job.total_steps)
        if s.done_at is not None:
            break
        if nxt == nxt_change:
            i += 1
            trigger = "change"
        if nxt == next_tick:
            next_tick += period_s or math.inf
            trigger = "tick" if nxt != nxt_change else "change+tick"
    s.progress.append((s.t, s.step, s.usd))
    finished = s.done_at is not None
    elapsed = s.done_at if finished and s.done_at is not None else s.t
    return ReplayResult(
        policy=name or getattr(policy, "__name__", "policy"), trace=trace.name, finished=finished,
        time_to_train_s=elapsed, usd=s.usd, total_steps=job.total_steps, steps_done=s.step,
        tokens=int(s.step) * job.tokens_per_step,
        goodput_steps_per_s=(s.step / elapsed) if elapsed > 0 else 0.0, gpu_hours=s.gpu_hours,
        gpu_hours_wasted=s.wasted_gpu_hours, redone_steps=s.redone, reconfiguration_s=s.reconf_s,
        waiting_s=s.waiting_s, switches=s.switches, decisions=tuple(s.decisions), segments=tuple(s.segments),
        progress=tuple(s.progress), planner_calls=planner.calls - calls0, planner_hits=planner.hits - hits0,
        planner_s=planner.search_s - search0, wall_s=time.perf_counter() - wall0, cpu_s=time.process_time() - cpu0,
    )


def _held_pool(plan: ParallelPlan, gone: dict[PlaceKey, int], trace: Trace, i: int) -> ResourcePool:
    """The GPUs of the plan that are still there, at the prices of trace point i."""
    info = {p.key: (p, u) for p, u in zip(trace.places, trace.points[i].usd_per_gpu_hour, strict=True)}
    entries = []
    for k, n in sorted(plan.gpus_by_place().items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2].value)):
        left = n - gone.get(k, 0)
        if left > 0 and k in info:
            pl, u = info[k]
            entries.append(Capacity(zone=pl.zone, region=pl.region, gpu_type=pl.gpu_type, gpus=left,
                                    market=pl.market, gpus_per_vm=pl.gpus_per_node, usd_per_gpu_hour=u,
                                    cloud=pl.cloud))
    return ResourcePool(entries=tuple(entries))


def _decide(s: _State, job: ReplayJob, planner: Planner, policy: Policy, pool: ResourcePool, trigger: str,
            taken: dict[PlaceKey, int], trace: Trace, i: int) -> None:
    gone: dict[PlaceKey, int] = {}
    if s.plan is not None:
        gone = missing_gpus(s.plan, pool)
        for k, n in s.plan.gpus_by_place().items():  # running VMs reclaimed: the job's among them
            if taken.get(k, 0) > 0:
                gone[k] = max(gone.get(k, 0), min(n, taken[k]))
    lost = bool(gone) and s.plan is not None
    if s.plan is not None and not lost:
        s.cost = planner.cost(s.plan, pool)  # the prices in force
    step_i = int(s.step + 1e-6)  # a step reached by arithmetic may fall a hair short
    held = _held_pool(s.plan, gone, trace, i) if lost and s.plan is not None else None
    a = assess(Happened(kinds=_kinds(trigger, lost, trace, i), step=step_i, gone=gone if lost else {}),
               RunningJob(plan=s.plan, cost=s.cost if s.plan is not None else None, total_steps=job.total_steps,
                          checkpoint_interval=job.checkpoint_interval),
               limits=job.request(pool), held=held)
    broken = a.broken if s.plan is not None else ""
    view = View(t_s=s.t, trigger=trigger, pool=pool, job=job, planner=planner, current=s.plan,
                current_cost=s.cost if s.plan is not None else None, lost=lost, broken=broken, initial=s.initial,
                remaining_steps=a.remaining_steps, lost_steps=a.lost_steps, reconfiguration_s=s.reconf_now,
                assessment=a, held=held)
    action = policy(view)
    kind = action.kind
    if kind == "stay" and (lost or s.plan is None):
        kind = "wait"
    if kind == "switch" and (action.plan is None or missing_gpus(action.plan, pool)):
        raise SailorError(
            f"policy chose a plan that does not fit the GPUs available at {s.t:.0f}s (a bug in the policy)"
        )
    if kind != "stay" or broken or action.record:
        s.decisions.append(Decision(t_s=s.t, trigger=trigger, kind=kind, reason=action.reason, step=step_i))
    if kind == "stay":
        return
    if lost:
        _notice(s, job, s.t)
    if kind == "wait":
        s.plan, s.cost, s.gpus = None, None, 0
        return
    assert action.plan is not None
    restart = s.initial is not None  # not the job's first launch
    previous = s.plan
    s.plan = action.plan
    s.cost = planner.cost(action.plan, pool)
    s.gpus = action.plan.num_gpus
    if s.initial is None:
        s.initial = action.plan
    # The first launch and every relaunch take a reconfiguration's time (VMs start, workers load the
    # checkpoint); only relaunches count as waste: every policy pays the first start. A replacement of a
    # plan that cannot go on (or a restart after waiting) on GPUs the job does not hold also waits for its
    # new VMs and their state; a whole plan's switch rents them while it trains on.
    took = s.reconf_now
    if restart and (lost or previous is None):
        took = startup_s(as_replacement(action.plan, s.cost, view.held if lost else None, previous,
                                        planner.book.model), view.startup)
    s.ready_at = s.t + took
    if restart:
        s.reconf_s += took
        s.wasted_gpu_hours += took * s.gpus / 3600.0
        s.switches += 1


def describe(plan: ParallelPlan | None) -> str:
    return summarize(plan) if plan is not None else "nothing rented"
