"""The `replan` subflow and the state one `sailor` run carries between its steps.

Contract: `replan(ctx, job, events, calibration, progress)` is called when monitoring saw
something that may change the best plan (a preemption notice, a lost worker, a price or capacity
change, or measured iteration time off the estimate). It decides with the decision core the trace
replay shares (sailor_core/decisions.py): `assess` says why the current plan cannot go on and what to
plan, the subflow plans it against current offerings and the calibrated profiles, and `choose` says
whether a new plan is worth the switch (gain over the remaining work against the cost of
reconfiguring). Then `_apply` makes every change the decision implies, in one place: the calibration
it used, the VMs lost, the decision and its reason in the run history, and when switching: it
provisions only the difference (the new VMs boot while the old
plan trains on, if it is still whole), ends the old generation at a step with a checkpoint, hands the
new plan to every worker in place and then releases the VMs the new plan drops: processes on kept VMs
go on running, and a rank that keeps its shard keeps its state in memory (others load the checkpoint).
It returns the job to monitor next (the same one when staying). Workers lost with no feasible plan left fail the run.

After a loss it weighs three replacements with `sailor_core.decisions.best_replacement`, as the replay's
Sailor policy does: the best plan on the VMs still held, the best plan on everything offered, and the
lost plan's own shape moved to where it fits now. Each is charged its own start (`RunContext.startup_times`):
the reconfiguration alone on VMs held; for new VMs also their start, the median the store measured for
this provider (`vm_start` measurements, one per run's cold start; an assumption per provider before
any), and loading the largest shard at the rate the run measured its checkpoint writes. The
reconfiguration time is measured too (`RunContext.reconfiguration`): this run's switches in place,
else earlier runs', else this provider's measured VM start; the Deps' estimate only when nothing was
measured.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from prefect import flow
from prefect.logging import get_run_logger

from flows.params import SailorParams
from infra.provider import AgentExitCodes, Provider, ProviderEvent, Vm
from infra.scenario import load_scenario
from profiles_store.spot_risk import spot_risk_from_store
from profiles_store.tables import HistoryRecord
from sailor_core.decisions import (
    WEIGHED_AS,
    Assessment,
    Happened,
    Measured,
    Option,
    PlanCost,
    Replacement,
    RunningJob,
    StartupTimes,
    Verdict,
    assess,
    calibrated_factors,
    choose,
    known_reconfiguration,
    within_limits,
)
from sailor_core.domain import Capacity, Market, ModelSpec, ParallelPlan, ResourcePool
from sailor_core.errors import CapacityError, SailorError
from sailor_core.plan_format import plan_to_dict
from sailor_core.planner.request import (
    Constraints,
    FrontierPoint,
    Objective,
    PlanRequest,
    PlanResult,
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
from sailor_core.units import sig, usd
from tasks.checkpointing import interval_for, measured_checkpoint, notice_s
from tasks.control import Controller
from tasks.decisions import lost_vms
from tasks.history import Decision, DecisionKind, Measurement, RunEvent, RunHistory, RunStatus
from tasks.jobs import Job, Progress, Switch, node_request, nodes, place
from tasks.ledger import Ledger
from tasks.planning import (
    NoPlanError,
    book_now,
    chosen_plan,
    estimate,
    pool_from,
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
    loss: float | None = None  # the latest step's loss the run saw
    # each switch this run measured, by the plan version it started: (seconds, whether it rented no VM)
    switches: dict[int, tuple[float, bool]] = field(default_factory=dict)
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
            options=SearchOptions(max_stages=p.max_stages or SearchOptions.max_stages, max_search_s=p.max_search_s),
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
    @property
    def reconfigurations_s(self) -> list[float]:
        """Every switch this run measured, in plan version order."""
        return [s for _, (s, _) in sorted(self.switches.items())]

    def reconfiguration(self) -> tuple[float, str]:
        """A switch on VMs already held, as the decisions assume it, and where the figure comes from
        (`sailor_core.decisions.known_reconfiguration`, which the replay of this run calls too): this
        run's switches in place, else those earlier runs measured in the store, else this provider's
        measured VM start, else the estimate."""
        in_place = [s for s, kept in self.switches.values() if kept]
        rows = [] if in_place else [*self._rows(Measurement.RECONFIGURATION), *self._rows(Measurement.VM_START)]
        return known_reconfiguration(run_id=self.run_id, provider=self.provider.name, this_run_in_place_s=in_place,
                                     measured=[m for r in rows if (m := Measured.of(r.run_id, r.kind, r.payload))],
                                     assumed_s=self.setup.reconfiguration_estimate_s)

    def reconfiguration_s(self) -> float:
        return self.reconfiguration()[0]

    def _rows(self, kind: Measurement) -> list[HistoryRecord]:
        """The store's `kind` measurements (none when unreadable)."""
        try:
            return self.history.store.read_history("measurements", kind=kind.value)
        except Exception as e:  # noqa: BLE001 - an unreadable history only costs the measured figure: log it
            get_run_logger().warning("%s measurements unreadable (%s)", kind.value, e)
            return []

    def _measured(self, kind: Measurement, key: str, keep: Callable[[HistoryRecord], bool]) -> list[float]:
        """The figures `key` of the store's `kind` measurements that `keep` accepts (none when unreadable)."""
        return [float(r.payload[key]) for r in self._rows(kind) if key in r.payload and keep(r)]

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
        got = vm_start_from_history(self._measured(Measurement.VM_START, "vm_start_s",
                                                   lambda r: r.payload.get("provider") == name))
        return got if got is not None else assumed_vm_start_s(name)

    def observe(self, job: Job, progress: Progress | None) -> None:
        if progress is not None:
            self.steps_done = max(self.steps_done, progress.step)
            self.loss = progress.loss if progress.loss is not None else self.loss
            self.iteration_times[job.version] = progress.iteration_times
        if job.reconfiguration_s is not None:  # measured at the version's first step; seen once per version
            in_place = isinstance(job.started_by, Switch) and job.started_by.new_vms == 0
            self.switches[job.version] = (job.reconfiguration_s, in_place)

    def training_s(self) -> float:
        return sum(sum(t) for t in self.iteration_times.values())

    def cost_table(self) -> CostTable:
        return {"usd_so_far": round(self.ledger.usd_so_far(), 6), "vms_rented": len(self.ledger),
                "usd_per_hour_now": round(self.ledger.usd_per_hour_now(), 6),
                "plan_version": self.version, "steps_done": self.steps_done, "total_steps": self.total_steps}

    def summary(self, status: RunStatus, t0: float) -> RunSummary:
        wall = time.time() - t0
        seq = self.base_book.model.sequence_length if self.base_book is not None else 0
        return {"run_id": self.run_id, "status": status.value, "steps_done": self.steps_done,
                "total_steps": self.total_steps, "final_loss": None if self.loss is None else round(self.loss, 4),
                "tokens": self.steps_done * self.params.global_batch_size * seq, "plan_versions": self.version,
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
            f"{sig(iteration_time_s)} s/it, {usd(usd_per_hour)} USD/h")


@dataclass(frozen=True, kw_only=True)
class _Planned:
    """What the flow keeps of an option beside the decision core's view of it: the simulator's estimate
    (recorded with an adopted plan) and the frontier it was chosen from."""

    est: SimulationResult
    frontier: tuple[FrontierPoint, ...] = ()


@flow(name="replan", log_prints=True)
def replan(ctx: RunContext, job: Job, events: list[ProviderEvent], calibration: Calibration | None,
           progress: Progress | None) -> Job:
    """Weigh the change with the decision core (`weigh`), then apply the result in one place (`_apply`)."""
    p = ctx.params
    offers = fetch_offerings(ctx.provider, regions=p.regions, gpu_types=p.gpu_types, markets=p.markets)
    w = weigh(ctx, job, events=events, calibration=calibration, step=progress.step if progress else job.start_step,
              offers=offers)
    for note in w.notes:
        get_run_logger().info("replan: %s", note)
    return _apply(ctx, job, w, events=events, calibration=calibration)


@dataclass(frozen=True, kw_only=True)
class Weighing:
    """What the flow's replan weighed, before it changes anything: the decision core's assessment and
    verdict, and what it needs to apply them."""

    assessment: Assessment
    verdict: Verdict
    options: tuple[Option, ...]  # what was weighed, as `verdict.weighed` lists it
    planned: dict[int, _Planned]  # id(option) -> the simulator's estimate and frontier of that option
    current_est: SimulationResult
    lost: set[str]
    factors: dict[str, float]  # the layer-time calibration the decision was made with
    times: StartupTimes
    notes: tuple[str, ...] = ()  # requests that had no feasible plan, and why
    prices: tuple[dict[str, object], ...] = ()  # the offerings' prices it read (a replay's pool at this replan)


def weigh(ctx: RunContext, job: Job, *, events: Sequence[ProviderEvent], calibration: Calibration | None,
          step: int, offers: Sequence[Capacity],
          plan: Callable[[PlanRequest, ProfileBook], PlanResult] = make_plan) -> Weighing:
    """The flow's decision at `step` after `events` (and a calibration), over what `offers` can be rented
    now: `assess` (sailor_core/decisions.py), the plans it asks for (`plan`: the planner task), then
    `choose`. Changes nothing: `_apply` does."""
    p = ctx.params
    assert ctx.base_book is not None
    lost = lost_vms(events, [v.vm_id for v in job.vms])
    kinds = tuple(sorted({e.kind.value for e in events}) + (["iteration_time"] if calibration else []))
    factors = ctx.calibration if calibration is None else calibrated_factors(
        ctx.calibration, calibration.ratio, {r.gpu_type for st in job.plan.stages for r in st.replicas})
    held = [v for v in job.vms if v.vm_id not in lost]
    book = book_now(ctx.base_book, offers, factors)
    current_est = estimate(job.plan, book)
    held_pool = pool_from([dataclasses.replace(o, gpus=0) for o in offers], held) if lost and held else None
    a = assess(Happened(kinds=kinds, step=step, gone=_gone(job.vms, lost)),
               RunningJob(plan=job.plan, cost=plan_cost(current_est), total_steps=ctx.total_steps,
                          checkpoint_interval=job.checkpoint_interval),
               limits=ctx.plan_request(pool_from(offers, held)), held=held_pool)
    # Only a loss weighs new VMs: other replans wait for a switch in place, and read no store for VM starts.
    times = ctx.startup_times(job, book.model) if lost else StartupTimes(reconfiguration_s=ctx.reconfiguration_s())
    options, planned, notes = _options(a, job.plan, held, book, plan)
    verdict = choose(a, options, objective=p.objective, times=times, min_gain=p.min_gain)
    prices: tuple[dict[str, object], ...] = tuple(
        {"zone": o.zone, "gpu_type": o.gpu_type, "market": o.market.value, "usd_per_gpu_hour": o.usd_per_gpu_hour}
        for o in offers)
    return Weighing(assessment=a, verdict=verdict, options=tuple(options), planned=planned, current_est=current_est,
                    lost=lost, factors=dict(factors), times=times, notes=tuple(notes), prices=prices)


def plan_cost(est: SimulationResult) -> PlanCost:
    return PlanCost(iteration_time_s=est.iteration_time_s, usd_per_iteration=est.usd_per_iteration,
                    usd_per_hour=est.usd_per_hour)


def _gone(vms: Sequence[Vm], lost: set[str]) -> dict[tuple[str, str, Market], int]:
    """The GPUs of the lost VMs, per place (zone, GPU type, market), as the decision core counts them."""
    out: dict[tuple[str, str, Market], int] = {}
    for v in vms:
        if v.vm_id in lost:
            k = (v.zone, v.gpu_type, v.market)
            out[k] = out.get(k, 0) + max(1, v.gpus)
    return out


def _options(a: Assessment, current: ParallelPlan, held: Sequence[Vm], book: ProfileBook,
             plan: Callable[[PlanRequest, ProfileBook], PlanResult],
             ) -> tuple[list[Option], dict[int, _Planned], list[str]]:
    """The plans the assessment asks for, planned (a request with no feasible plan gives none, and a
    note), and after a loss the lost plan's own shape moved to where it fits now; with what the flow
    keeps of each."""
    options: list[Option] = []
    planned: dict[int, _Planned] = {}
    notes: list[str] = []

    def add(kind: str, plan: ParallelPlan, est: SimulationResult, frontier: Sequence[FrontierPoint] = ()) -> None:
        new = place(plan, list(held))[1]
        rep = Replacement(cost=plan_cost(est), new_vms=len(new),
                          load_bytes=float(largest_shard_bytes(plan, book.model)) if new else 0.0)
        options.append(Option(kind=kind, plan=plan, replacement=rep))
        planned[id(options[-1])] = _Planned(est=est, frontier=tuple(frontier))

    for kind, req in a.requests:
        try:
            r = plan(req, book)
        except NoPlanError as e:
            notes.append(f"no plan for {WEIGHED_AS.get(kind, kind)}: {e}")
            continue
        add(kind, *chosen_plan(r), frontier=r.frontier)
    if a.move_current:
        limits = a.requests[-1][1]
        moved = relocate(current, limits.restrictions.apply(limits.pool), limits.restrictions.markets,
                         lambda pl: _priceable(pl, book))
        if moved is not None and all(moved != o.plan for o in options):
            est = estimate(moved, book)
            if within_limits(limits, plan_cost(est)):
                add("moved", moved, est)
    return options, planned, notes


def _priceable(plan: ParallelPlan, book: ProfileBook) -> bool:
    try:
        estimate(plan, book)
    except SailorError:
        return False
    return True


def _apply(ctx: RunContext, job: Job, w: Weighing, *, events: Sequence[ProviderEvent],
           calibration: Calibration | None) -> Job:
    """Everything the decision changes, in one place: the calibration it was made with, the current
    plan's estimate, the VMs lost, the decision and its reason in the run's history, and on a switch
    the reconfiguration. A loss with nothing that can run fails the run (a flow does not wait)."""
    a, verdict, factors, lost, times = w.assessment, w.verdict, w.factors, w.lost, w.times
    if calibration is not None:
        for g, factor in sorted(factors.items()):
            if factor != ctx.calibration.get(g, 1.0):
                record(ctx.history.measurement, ctx.run_id, Measurement.CALIBRATION,
                       {"gpu_type": g, "factor": factor, "ratio": calibration.ratio, "plan_version": job.version},
                       f"iteration time x{calibration.ratio:.2f} of the estimate; layer times of {g} now scaled "
                       f"x{factor:.2f}")
        ctx.calibration = dict(factors)
        job.calibrated = True
    job.estimate_s = w.current_est.iteration_time_s
    ctx.ledger.release(lost)
    if verdict.kind == "wait":
        raise NoPlanError(f"{verdict.reason}; the run cannot go on without a plan")
    opt = verdict.option
    chosen = w.planned[id(opt)] if opt is not None else None
    detail: dict[str, object] = {
        "trigger": list(a.happened.kinds), "step": a.happened.step, "current": _describe(job.plan, w.current_est),
        "startup": {"reconfiguration_s": times.reconfiguration_s, "reconfiguration_from": ctx.reconfiguration()[1],
                    "vm_start_s": times.vm_start_s, "load_bytes_per_s": times.load_bytes_per_s},
        "replacements": [{"kind": o.kind, "plan": _describe(o.plan, w.planned[id(o)].est),
                          "new_vms": o.replacement.new_vms, "startup_s": took, "finish": total}
                         for o, (_, took, total) in zip(w.options, verdict.weighed, strict=True)],
        "prices": list(w.prices)}
    if verdict.decision is not None:
        detail["decision"] = verdict.decision.to_json()
    if opt is not None and chosen is not None:
        detail["candidate"] = _describe(opt.plan, chosen.est)
    _decide(ctx, DecisionKind.SWITCH if verdict.kind == "switch" else DecisionKind.STAY, verdict.reason, detail)
    if opt is None or chosen is None:
        return job
    trigger_at = min((e.at for e in events), default=datetime.now(UTC)).timestamp()
    return _reconfigure(ctx, job, opt.plan, chosen.est, [v for v in job.vms if v.vm_id not in lost], lost,
                        trigger_at, list(a.happened.kinds), chosen.frontier, a.happened.step, verdict.reason)


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
