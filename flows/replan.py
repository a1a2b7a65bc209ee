"""The `replan` subflow and the state one `sailor` run carries between its steps.

Contract: `replan(ctx, job, events, calibration, progress)` is called when monitoring saw
something that may change the best plan (a preemption notice, a lost worker, a price or capacity
change, or measured iteration time off the estimate). It re-plans against current offerings and
the calibrated profiles, decides with `tasks.decisions.decide_switch` whether the new plan is worth
the switch (gain over the remaining work against the cost of reconfiguring), records the decision
and its reason, and when switching: provisions only the difference (the new VMs boot while the old
plan trains on, if it is still whole), ends the old generation at a step with a checkpoint, hands the
new plan to every worker in place and then releases the VMs the new plan drops: processes on kept VMs
go on running, and a rank that keeps its shard keeps its state in memory (others load the checkpoint).
It returns the job to monitor next (the same one when staying). Workers lost with no feasible plan left fail the run.

After a loss it weighs three replacements with `sailor_core.decisions.best_replacement`, as the replay's
Sailor policy does: the best plan on the VMs still held, the best plan on everything offered, and the
lost plan's own shape moved to where it fits now. Each is charged its own start (`RunContext.startup_times`):
the reconfiguration alone on VMs held; for new VMs also their start, the median the store measured for
this provider (`vm_start` measurements, one per run's cold start; an assumption per provider before
any), and loading the largest shard at the rate the run measured its checkpoint writes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from prefect import flow
from prefect.logging import get_run_logger

from flows.params import SailorParams
from infra.provider import AgentExitCodes, Provider, ProviderEvent, Vm
from infra.scenario import load_scenario
from profiles_store.spot_risk import spot_risk_from_store
from sailor_core.decisions import Replacement, StartupTimes, best_replacement, startup_s, switch_outcome
from sailor_core.domain import Capacity, Market, ModelSpec, ParallelPlan, ResourcePool
from sailor_core.errors import CapacityError, SailorError
from sailor_core.plan_format import plan_to_dict
from sailor_core.planner.request import (
    Constraints,
    FrontierPoint,
    Objective,
    PlanRequest,
    Restrictions,
    SearchOptions,
)
from sailor_core.planner.risk import (
    ASSUMED_LOAD_BYTES_PER_S,
    SpotRisk,
    assumed_vm_start_s,
    largest_shard_bytes,
    planning_checkpoint_interval,
    vm_start_from_history,
)
from sailor_core.profiles import ProfileBook
from sailor_core.replay.policies import relocate
from sailor_core.runtime.protocol import vm_of
from sailor_core.simulator.result import SimulationResult
from tasks.checkpointing import interval_for, measured_checkpoint, notice_s
from tasks.control import Controller
from tasks.decisions import PlanCost, decide_switch, lost_vms
from tasks.history import Decision, DecisionKind, Measurement, RunEvent, RunHistory, RunStatus
from tasks.jobs import Job, Progress, Switch, node_request, nodes, place
from tasks.ledger import Ledger
from tasks.planning import (
    NoPlanError,
    calibrated_book,
    chosen_plan,
    estimate,
    plan_violations,
    pool_from,
    priced_book,
)
from tasks.records import CostTable, RunSummary
from tasks.reporting import emit, publish_cost, publish_frontier, publish_plan, publish_timeline
from tasks.steps import (
    Calibration,
    fetch_offerings,
    hand_out,
    make_plan,
    provision,
    record,
    start_agents,
    terminate,
)


@dataclass(frozen=True, kw_only=True)
class RunSetup:
    """What a run is and what it talks to: fixed from its start to its end."""

    run_id: str
    params: SailorParams
    provider: Provider
    history: RunHistory
    run_dir: Path
    reconfiguration_estimate_s: float  # until the run has measured a switch of its own


@dataclass(kw_only=True)
class RunContext:
    """What a run has learned and holds as it goes: its profiles and their calibration, the adopted
    plan (`adopt_plan`), what it rents (`ledger`), its progress and its decisions. The `sailor` flow
    and its `replan` subflow both change it; everything fixed is in `setup`."""

    setup: RunSetup
    ledger: Ledger = field(default_factory=Ledger)
    base_book: ProfileBook | None = None
    calibration: dict[str, float] = field(default_factory=dict)
    version: int = 0
    plan: ParallelPlan | None = None
    estimate: SimulationResult | None = None  # the current plan's, as the simulator estimated it
    total_steps: int = 0
    steps_done: int = 0
    reconfigurations_s: list[float] = field(default_factory=list)
    in_place_s: list[float] = field(default_factory=list)  # those of switches that rented no VM
    iteration_times: dict[int, tuple[float, ...]] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    dry_run: str = ""

    @property
    def run_id(self) -> str:
        return self.setup.run_id

    @property
    def params(self) -> SailorParams:
        return self.setup.params

    @property
    def provider(self) -> Provider:
        return self.setup.provider

    @property
    def history(self) -> RunHistory:
        return self.setup.history

    @property
    def run_dir(self) -> Path:
        return self.setup.run_dir

    def plan_request(self, pool: ResourcePool) -> PlanRequest:
        """What the run asks the planner for on this pool: the parameters' objective, limits and
        restrictions, and the spot risk the store's history and the parameters give."""
        p = self.params
        local = p.provider == "local"  # the local provider has `workers` devices in all
        return PlanRequest(
            model=p.model, global_batch_size=p.global_batch_size, pool=pool, objective=p.objective,
            constraints=Constraints(max_usd_per_iteration=p.max_usd_per_iteration,
                                    max_usd_per_hour=p.max_usd_per_hour, min_iterations_per_s=p.min_iterations_per_s),
            restrictions=Restrictions(clouds=tuple(p.clouds or ()), regions=tuple(p.regions or ()),
                                      gpu_types=tuple(p.gpu_types or ()),
                                      markets=tuple(Market.parse(m) for m in p.markets or ()),
                                      max_gpus=min(p.max_gpus or p.workers, p.workers) if local else p.max_gpus),
            options=SearchOptions(max_stages=p.max_stages) if p.max_stages else SearchOptions(),
            spot_risk=self._spot_risk(),
        )

    def _spot_risk(self) -> SpotRisk:
        """Under max-goodput, the rates the store's history and the parameters give (read at every plan:
        the run's own preemptions count); other objectives ignore spot risk, so nothing is read."""
        p = self.params
        every = planning_checkpoint_interval(p.checkpoint_interval)  # the planner weighs one before a plan
        if p.objective is not Objective.MAX_GOODPUT:
            return SpotRisk(checkpoint_interval_steps=every)
        return self._spot_rates(every)

    def _spot_rates(self, every: int) -> SpotRisk:
        p = self.params
        return spot_risk_from_store(self.history.store, default_rate=p.spot_preemptions_per_vm_hour,
                                    checkpoint_interval=every, given_as="spot_preemptions_per_vm_hour")

    def checkpoint_interval(self, plan: ParallelPlan, est: SimulationResult,
                            measured: dict[str, float] | None = None) -> int:
        """Steps between checkpoints for this plan version (tasks/checkpointing.py); the choice and its
        reason are a decision of the run."""
        p = self.params
        graces = [e.grace_s for e in load_scenario(p.scenario).events if e.kind == "preemption"] \
            if p.provider == "local" and p.scenario else []
        choice = interval_for(p.checkpoint_interval, plan, est.iteration_time_s,
                              total_steps=max(1, self.total_steps), risk=self._spot_rates(1),
                              notice=notice_s(p.provider, p.spot_notice_s, graces), measured=measured)
        get_run_logger().info("plan v%s: checkpoint %s", self.version, choice.reason)
        record(self.history.measurement, self.run_id, Measurement.CHECKPOINT_INTERVAL,
               {"plan_version": self.version, "steps": choice.steps, "seconds": choice.seconds,
                "measured": measured}, choice.reason)
        return choice.steps

    def adopt_plan(self, plan: ParallelPlan, est: SimulationResult, reason: str,
                   frontier: Sequence[FrontierPoint] = ()) -> None:
        self.version += 1
        self.plan, self.estimate = plan, est
        record(self.history.plan, self.run_id, self.version, plan_to_dict(plan), est.to_json(), reason)
        publish_plan(self.run_id, self.version, plan, est, reason)
        publish_frontier(self.run_id, self.version, frontier, est)
        get_run_logger().info("plan v%d: %s", self.version, _describe(plan, est))

    # -- time ------------------------------------------------------------------------------------------
    def reconfiguration_s(self) -> float:
        """A switch on VMs already held: the longest the run measured, else the estimate."""
        return max(self.in_place_s) if self.in_place_s else self.setup.reconfiguration_estimate_s

    def startup_times(self, job: Job, model: ModelSpec) -> StartupTimes:
        """What starting a replacement takes, as the run knows it now (see the module's contract)."""
        measured = measured_checkpoint(job.controller.metrics(job.version)) if job.controller is not None else None
        rate = ASSUMED_LOAD_BYTES_PER_S
        if measured is not None and measured["write_s"] > 0:
            rate = largest_shard_bytes(job.plan, model) / measured["write_s"]
        return StartupTimes(reconfiguration_s=self.reconfiguration_s(), vm_start_s=self.vm_start_s(),
                            load_bytes_per_s=max(rate, 1.0))

    def vm_start_s(self) -> float:
        """This provider's new VMs, from the request to the first step: the store's median, else assumed."""
        name = self.provider.name
        try:
            rows = self.history.store.read_history("measurements", kind=Measurement.VM_START.value)
        except Exception as e:  # noqa: BLE001 - an unreadable history only costs the measured figure: log, assume
            get_run_logger().warning("VM start times unreadable (%s); assuming %ss for %s", e,
                                     assumed_vm_start_s(name), name)
            rows = []
        got = vm_start_from_history(float(r.payload["vm_start_s"]) for r in rows
                                    if r.payload.get("provider") == name and "vm_start_s" in r.payload)
        return got if got is not None else assumed_vm_start_s(name)

    def observe(self, job: Job, progress: Progress | None) -> None:
        if progress is not None:
            self.steps_done = max(self.steps_done, progress.step)
            self.iteration_times[job.version] = progress.iteration_times
        if job.reconfiguration_s is not None and not job.reconfiguration_counted:
            self.reconfigurations_s.append(job.reconfiguration_s)
            if isinstance(job.started_by, Switch) and job.started_by.new_vms == 0:
                self.in_place_s.append(job.reconfiguration_s)
            job.reconfiguration_counted = True

    def training_s(self) -> float:
        return sum(sum(t) for t in self.iteration_times.values())

    def cost_table(self) -> CostTable:
        return {"usd_so_far": round(self.ledger.usd_so_far(), 6), "vms_rented": len(self.ledger),
                "usd_per_hour_now": round(self.ledger.usd_per_hour_now(), 6),
                "plan_version": self.version, "steps_done": self.steps_done, "total_steps": self.total_steps}

    def summary(self, status: RunStatus, t0: float) -> RunSummary:
        wall = time.time() - t0
        return {"run_id": self.run_id, "status": status.value, "steps_done": self.steps_done,
                "total_steps": self.total_steps, "plan_versions": self.version,
                "usd_total": round(self.ledger.usd_so_far(), 6), "wall_s": round(wall, 2),
                "training_s": round(self.training_s(), 2),
                "orchestration_overhead_s": round(wall - self.training_s(), 2),
                "reconfigurations_s": [round(x, 2) for x in self.reconfigurations_s],
                "decisions": [{"kind": d.kind.value, "reason": d.reason} for d in self.decisions],
                "plan": _describe(self.plan, self.estimate) if self.plan else ""}


def _describe(plan: ParallelPlan | None, est: SimulationResult | None) -> str:
    if plan is None:
        return ""
    iteration_time_s, usd_per_hour = (est.iteration_time_s, est.usd_per_hour) if est is not None else (0.0, 0.0)
    places: dict[str, int] = {}
    for (zone, gpu, market), n in plan.gpus_by_place().items():
        places[f"{n}x {gpu} {market.value} @{zone}"] = n
    return (f"{plan.num_stages} stage(s) x {plan.data_parallel} replica(s) on {', '.join(places)}; "
            f"{iteration_time_s:.4f} s/it, {usd_per_hour:.4f} USD/h")


def _checkpoint_step(step: int, interval: int) -> int:
    return (step // interval) * interval


def _steps_at_risk(step: int, interval: int, *, lost: bool) -> int:
    """Steps a switch may redo. A whole plan is stopped at a step boundary with a checkpoint (its state
    kept in memory): none. After a loss, those since the last periodic checkpoint (the survivors'
    memory may still save them, runtime/memory_checkpoint.py, but that is not known here)."""
    return step - _checkpoint_step(step, interval) if lost else 0


@flow(name="replan", log_prints=True)
def replan(ctx: RunContext, job: Job, events: list[ProviderEvent], calibration: Calibration | None,
           progress: Progress | None) -> Job:
    p = ctx.params
    provider = ctx.provider
    assert ctx.base_book is not None and ctx.plan is not None
    step = progress.step if progress else job.start_step
    lost = lost_vms(events, [v.vm_id for v in job.vms])
    kinds = sorted({e.kind.value for e in events}) + (["iteration_time"] if calibration else [])
    trigger_at = min((e.at for e in events), default=datetime.now(UTC)).timestamp()
    if calibration:
        ratio = calibration.ratio
        for g in sorted({r.gpu_type for st in job.plan.stages for r in st.replicas}):
            factor = ctx.calibration.get(g, 1.0) * ratio
            ctx.calibration[g] = factor
            record(ctx.history.measurement, ctx.run_id, Measurement.CALIBRATION,
                   {"gpu_type": g, "factor": factor, "ratio": ratio, "plan_version": job.version},
                   f"iteration time x{ratio:.2f} of the estimate; layer times of {g} now scaled x{factor:.2f}")
        job.calibrated = True
    ctx.ledger.release(lost)
    held = [v for v in job.vms if v.vm_id not in lost]
    offers = fetch_offerings(provider, regions=p.regions, gpu_types=p.gpu_types, markets=p.markets)
    book = calibrated_book(priced_book(ctx.base_book, offers), ctx.calibration)
    current_est = estimate(job.plan, book)
    job.estimate_s = current_est.iteration_time_s
    broken = ""
    if lost:
        broken = f"{len(lost)} worker(s) of plan v{job.version} lost ({', '.join(kinds)})"
    else:
        v = plan_violations(current_est, max_usd_per_iteration=p.max_usd_per_iteration,
                            max_usd_per_hour=p.max_usd_per_hour, min_iterations_per_s=p.min_iterations_per_s)
        if v:
            broken = "the current plan now breaks a limit: " + "; ".join(v)
    # Only a loss weighs new VMs: other replans wait for a switch in place, and read no store for start times.
    times = ctx.startup_times(job, book.model) if lost else StartupTimes(reconfiguration_s=ctx.reconfiguration_s())
    try:
        options = _replacements(ctx, job, offers, held, book) if lost else []
        if not options:
            result = make_plan(ctx.plan_request(pool_from(offers, held)), book)
            options = [_option(*chosen_plan(result), held, book.model, frontier=result.frontier)]
    except NoPlanError as e:
        if lost:
            raise
        reason = (
            f"after {', '.join(kinds)}: no feasible plan with current offerings ({e}); staying on plan v{job.version}"
        )
        _decide(ctx, DecisionKind.STAY, reason, {"trigger": kinds, "step": step})
        return job
    remaining = ctx.total_steps - step
    lost_steps = _steps_at_risk(step, job.checkpoint_interval, lost=bool(lost))
    pick = best_replacement(objective=p.objective, candidates=[o.replacement for o in options],
                            remaining_steps=remaining, lost_steps=lost_steps, times=times)
    chosen = options[pick]
    cand, cand_est = chosen.plan, chosen.est
    same = plan_to_dict(cand) == plan_to_dict(job.plan) and not lost
    # A plan that cannot go on waits for its replacement's new VMs; a whole one trains on while they start.
    took = startup_s(chosen.replacement, times) if lost else ctx.reconfiguration_s()
    decision = decide_switch(
        objective=p.objective,
        current=None if lost else PlanCost(iteration_time_s=current_est.iteration_time_s,
                                           usd_per_iteration=current_est.usd_per_iteration,
                                           usd_per_hour=current_est.usd_per_hour),
        candidate=PlanCost(iteration_time_s=cand_est.iteration_time_s, usd_per_iteration=cand_est.usd_per_iteration,
                           usd_per_hour=cand_est.usd_per_hour),
        remaining_steps=remaining, lost_steps=lost_steps, reconfiguration_s=took,
        min_gain=p.min_gain, current_broken=broken, same_plan=same,
    )
    weighed = _weighed(options, pick, times, remaining, lost_steps, p.objective) if len(options) > 1 else ""
    reason = f"after {', '.join(kinds)} at step {step}: {decision.reason}{weighed}"
    detail = {"trigger": kinds, "step": step, "decision": decision.to_json(), "candidate": _describe(cand, cand_est),
              "current": _describe(job.plan, current_est),
              "startup": {"reconfiguration_s": times.reconfiguration_s, "vm_start_s": times.vm_start_s,
                          "load_bytes_per_s": times.load_bytes_per_s},
              "replacements": [{"kind": o.kind, "plan": _describe(o.plan, o.est), "new_vms": o.replacement.new_vms,
                                "startup_s": startup_s(o.replacement, times)} for o in options]}
    _decide(ctx, DecisionKind.SWITCH if decision.switch else DecisionKind.STAY, reason, detail)
    if not decision.switch:
        return job
    return _reconfigure(ctx, job, cand, cand_est, held, lost, trigger_at, kinds, chosen.frontier, step, reason)


@dataclass(frozen=True, kw_only=True)
class _Option:
    """A plan that could replace the current one, and what starting it takes."""

    plan: ParallelPlan
    est: SimulationResult
    replacement: Replacement
    frontier: tuple[FrontierPoint, ...] = ()
    kind: str = "best"  # "held" (on the VMs still held) | "best" (on everything offered) | "moved"


def _option(plan: ParallelPlan, est: SimulationResult, held: Sequence[Vm], model: ModelSpec, *,
            kind: str = "best", frontier: Sequence[FrontierPoint] = ()) -> _Option:
    """`plan` as a replacement: the VMs it must rent beside those `held`, and then the largest shard to load."""
    new = place(plan, list(held))[1]
    cost = PlanCost(iteration_time_s=est.iteration_time_s, usd_per_iteration=est.usd_per_iteration,
                    usd_per_hour=est.usd_per_hour)
    rep = Replacement(cost=cost, new_vms=len(new), load_bytes=float(largest_shard_bytes(plan, model)) if new else 0.0)
    return _Option(plan=plan, est=est, replacement=rep, frontier=tuple(frontier), kind=kind)


def _replacements(ctx: RunContext, job: Job, offers: Sequence[Capacity], held: list[Vm],
                  book: ProfileBook) -> list[_Option]:
    """After a loss, the plans that could replace the lost one, the one on the VMs still held first (it
    wins ties: it rents nothing): the best on those VMs, the best on everything offered, and the lost
    plan's own shape moved to where it fits now (as the replay's Sailor policy weighs them)."""
    out: list[_Option] = []
    none_free = [dataclasses.replace(o, gpus=0) for o in offers]  # their zones' regions, no capacity
    try:
        if held:
            r = make_plan(ctx.plan_request(pool_from(none_free, held)), book)
            out.append(_option(*chosen_plan(r), held, book.model, kind="held", frontier=r.frontier))
    except NoPlanError:
        pass  # no plan fits the VMs still held: only plans with new VMs remain
    everything = pool_from(offers, held)
    r = make_plan(ctx.plan_request(everything), book)  # NoPlanError: nothing can replace the lost plan
    out.append(_option(*chosen_plan(r), held, book.model, frontier=r.frontier))
    req = ctx.plan_request(everything)
    moved = relocate(job.plan, req.restrictions.apply(everything), req.restrictions.markets,
                     lambda pl: _priceable(pl, book))
    if moved is not None and all(moved != o.plan for o in out):
        est = estimate(moved, book)
        if not plan_violations(est, max_usd_per_iteration=ctx.params.max_usd_per_iteration,
                               max_usd_per_hour=ctx.params.max_usd_per_hour,
                               min_iterations_per_s=ctx.params.min_iterations_per_s):
            out.append(_option(moved, est, held, book.model, kind="moved"))
    return out


def _priceable(plan: ParallelPlan, book: ProfileBook) -> bool:
    try:
        estimate(plan, book)
    except SailorError:
        return False
    return True


def _weighed(options: Sequence[_Option], pick: int, times: StartupTimes, remaining: int, lost_steps: int,
             objective: str) -> str:
    """The replacements weighed, for the decision's reason: each one's start and time (or cost) to finish."""
    at, unit = (0, "s") if objective == "max-throughput" else (1, "USD")
    parts = []
    for k, o in enumerate(options):
        took = startup_s(o.replacement, times)
        total = switch_outcome(o.replacement.cost, remaining_steps=remaining, lost_steps=lost_steps,
                               reconfiguration_s=took)[at]
        mark = "*" if k == pick else ""
        vms = f", {o.replacement.new_vms} new VM(s)" if o.replacement.new_vms else ""
        parts.append(f"{mark}{o.kind} ({took:.0f}s start{vms}): {total:.6g} {unit}")
    return "; weighed " + ", ".join(parts)


def _decide(ctx: RunContext, kind: DecisionKind, reason: str, detail: dict[str, object]) -> None:
    get_run_logger().info("replan: %s (%s)", kind, reason)
    ctx.decisions.append(Decision(kind=kind, reason=reason))
    record(ctx.history.decision, ctx.run_id, kind, reason, detail)
    record(ctx.history.event, ctx.run_id, RunEvent.REPLAN, reason, {"decision": kind.value, **detail})
    emit("replan", ctx.run_id, {"decision": kind.value, "reason": reason})
    if kind is not DecisionKind.SWITCH:  # a switch publishes once its new plan is handed out
        _publish_progress(ctx)


def _publish_progress(ctx: RunContext) -> None:
    """The run's cost and timeline artifacts, kept current while it runs, not only at the end."""
    publish_cost(ctx.run_id, ctx.cost_table())
    shown = ctx.history.show(ctx.run_id)
    publish_timeline(ctx.run_id, shown["events"], shown["decisions"])


def _reconfigure(ctx: RunContext, job: Job, cand: ParallelPlan, cand_est: SimulationResult, held: list[Vm],
                 lost: set[str], trigger_at: float, kinds: list[str], frontier: Sequence[FrontierPoint], step: int,
                 reason: str) -> Job:
    """Switch to `cand` without restarting what stays: VMs the new plan keeps keep their worker
    processes (and, where a rank keeps its shard, its state in memory); new VMs boot while the old plan
    still trains if it is whole; then the old generation ends at a step with a checkpoint (without
    waiting for workers of lost VMs), every worker gets the new generation in place, and the VMs the
    new plan drops are released."""
    provider = ctx.provider
    ctl = job.controller
    assert ctl is not None, "a running job has its run's controller"
    placed, missing = place(cand, held)
    keep = {v.vm_id for v in placed.values()}
    drop = [v.vm_id for v in held if v.vm_id not in keep] + sorted(lost)
    ctx.adopt_plan(cand, cand_est, reason, frontier)
    requests = [node_request(ctx.run_id, ctx.version, n) for n in missing]
    # Workers on lost VMs never report the end of their generation: wait only for the others.
    members = [w for w in job.members if vm_of(w) not in lost]
    pids_before = ctl.worker_pids(sorted(keep))
    ended = False
    try:
        # Rent first, while the old plan still trains: the new VMs' start-up overlaps its last steps.
        new_vms = provision(provider, requests)
    except CapacityError:
        # The new plan needs capacity the old one still holds: end the old generation and free it first.
        ctl.end_generation(job.version, members, broken=bool(lost))
        ended = True
        terminate(provider, drop)
        ctx.ledger.release(drop)
        new_vms = provision(provider, requests)
    ctx.ledger.rent(new_vms)
    it = iter(new_vms)
    vms = [placed[k] if k in placed else next(it) for k in range(len(nodes(cand)))]
    record(ctx.history.event, ctx.run_id, RunEvent.PROVISIONED,
           f"plan v{ctx.version}: kept {len(keep)} VMs, rented {len(new_vms)}, released {len(drop)}",
           {"kept": sorted(keep), "rented": [v.vm_id for v in new_vms], "released": drop, "plan_version": ctx.version})
    measured = measured_checkpoint(ctl.metrics(job.version))
    every = ctx.checkpoint_interval(cand, cand_est, measured)
    new = Job(run_id=ctx.run_id, version=ctx.version, plan=cand, vms=vms, run_dir=job.run_dir, state=job.state,
              code=job.code, total_steps=job.total_steps, checkpoint_interval=every, seed=job.seed,
              data_uri=job.data_uri, estimate_s=cand_est.iteration_time_s, controller=ctl,
              started_by=Switch(trigger_at=trigger_at, trigger=tuple(kinds), pids_before=pids_before,
                                 new_vms=len(new_vms)))
    if new_vms:
        start_agents(provider, new, [v.vm_id for v in new_vms])
        ctl.watch(new_vms)
        if not lost and not ended:  # the old plan is whole: it trains on until the new VMs are up
            _wait_ready(ctl, [v.vm_id for v in new_vms], timeout_s=BOOT_TIMEOUT_S)
    if not ended:
        ctl.end_generation(job.version, members, broken=bool(lost))
    # A kept VM whose agent is gone (it failed, or was stopped) gets a fresh one; the rest go on in place.
    dead = [v for v in sorted(keep) if isinstance(provider, AgentExitCodes) and provider.agent_exit_code(v) is not None]
    if dead:
        start_agents(provider, new, dead)
    new.launched_at = hand_out(new)
    if not ended:
        # Released after the hand-out: stopping a VM's agent takes its grace period, which the new
        # plan need not wait for (their workers sit idle outside the new generation meanwhile).
        terminate(provider, drop)
        ctx.ledger.release(drop)
    _publish_progress(ctx)  # after the hand-out: the UI's artifacts are not on the switch's critical path
    return new


BOOT_TIMEOUT_S = 180.0  # how long the old plan may go on training while the new VMs start


def _wait_ready(ctl: Controller, vm_ids: list[str], *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ctl.ready(vm_ids) and time.monotonic() < deadline:
        time.sleep(0.2)
