"""The `sailor` flow: profile -> plan -> provision -> train -> monitor -> replan, with teardown.

Contract: `sailor(**parameters)` (deployment `sailor/train`) validates its parameters before
anything is provisioned (`InvalidParameters` names each bad field), then runs the job on the chosen
provider and returns a summary dict. Every run gets a unique id (`<run_name>-<flow run id prefix>`)
under which the store keeps its history (runs, events, decisions with reasons, plans, measured vs
estimated). Every VM the run rented is removed in a `finally` and again by the flow's
cancellation/crash hooks, so none outlives the run, also on failure or cancellation from the UI.

Side effects (provider, store, working folder, poll interval) arrive as `Deps`; the default
builds them from the parameters (local provider under `<workdir>/runs/<run_id>/local`, the store
at `store_uri`). Tests pass their own `Deps` (e.g. a provider whose agent cannot start).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import pydantic
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import flow_run as runtime_flow_run

from flows.params import InvalidParameters, SailorParams, takes_params, validate_params
from flows.profiling import profile
from flows.replan import RunContext, RunSetup, replan
from infra.provider import (
    ClusterInfo,
    DryRunReporting,
    HostedVms,
    Provider,
    ProviderEvent,
    ScriptedEvents,
    Vm,
    VmRequest,
)
from sailor_core.domain import Capacity, ParallelPlan, ResourcePool
from sailor_core.errors import CapacityError, SailorError, StorageUnavailable
from sailor_core.files import private_dir
from sailor_core.planner.request import PlanResult
from sailor_core.planner.risk import planning_checkpoint_interval
from sailor_core.units import usd
from tasks import interrupt
from tasks.control import Controller, HeartbeatBoard, checkpoint_steps
from tasks.history import DEFAULT_LEASE_S, LeaseKeeper, RunEvent, RunHistory, RunStatus, new_run_id
from tasks.jobs import CodeRef, ColdStart, Job, node_requests, ship_code
from tasks.outage import DEFAULT_OUTAGE_S, PrefectWatch
from tasks.planning import book_now, calibrated_book, chosen_plan, pool_from
from tasks.pump import ProviderPump
from tasks.records import RunSummary
from tasks.remote import VmCommands
from tasks.replay import job_of, what_if
from tasks.reporting import Logger, ProgressBar, emit, publish_cost, publish_timeline
from tasks.retention import KEEP_RUNS, prune_older_runs, prune_run
from tasks.runstate import (
    RunState,
    TestbedObjectStore,
    merge_workers_metrics,
    state_for,
)
from tasks.steps import (
    fetch_offerings,
    launch,
    make_plan,
    monitor,
    provision,
    record,
    save_metrics,
    teardown,
)

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun
    from prefect.states import State

    from profiles_store.store import ProfileStore

FIRST_PROVISION_TRIES = 3  # plans tried when the first provisioning meets a stockout


@dataclass(kw_only=True)
class Deps:
    provider: Provider
    store: ProfileStore
    workdir: Path
    poll_s: float = 0.5
    reconfiguration_estimate_s: float = 15.0
    stall_timeout_s: float = 180.0
    max_replans: int = 20
    # The one address the workers reach the flow's controller at (it binds only that one).
    controller_host: str = "127.0.0.1"
    board: HeartbeatBoard = field(default_factory=HeartbeatBoard)
    # Where the run's state lives (tasks/runstate.py); None: derived from the store URI.
    state: RunState | None = None
    # A wheel of this checkout for the VMs (tasks/runstate.py); False: VMs run what they have installed.
    ship_wheel: bool = True
    closers: list[Callable[[], None]] = field(default_factory=list)  # run after teardown (object store, ...)
    # the run's lease in the history (renewed every third of it)
    lease_s: float = field(default_factory=lambda: float(os.environ.get("SAILOR_LEASE_S", DEFAULT_LEASE_S)))


def make_provider(params: SailorParams, run_dir: Path, board: HeartbeatBoard | None = None) -> Provider:
    if params.provider == "local":
        from infra.local import LocalProvider
        from infra.scenario import load_scenario

        scenario = load_scenario(params.scenario) if params.scenario else None
        return LocalProvider(run_dir / "local", scenario=scenario, heartbeat_timeout_s=params.heartbeat_timeout_s,
                             heartbeats=board.get if board is not None else None, isolation=params.isolation)
    # aws / gcp: settings from the environment (regions, project, endpoints; docs in infra/cloud.py),
    # credentials from the SDKs' standard chains, never from parameters.
    import os

    from infra.registry import provider_from_env

    return provider_from_env(params.provider, env=os.environ, regions=params.regions)


def default_deps(params: SailorParams, run_id: str) -> Deps:
    from profiles_store.store import open_store

    workdir = Path(params.workdir).resolve()
    run_dir = workdir / "runs" / run_id
    import os

    from sailor_core.uris import s3_compat_settings

    # the flow's process is an edge: it hands the store its environment, and adds the AWS SDK's
    # S3-compatible settings there when the store names an endpoint (sailor_core/uris.py)
    os.environ.update(s3_compat_settings([params.store_uri or "", params.dataset or ""], os.environ))
    board = HeartbeatBoard()
    provider = make_provider(params, run_dir, board)
    deps = Deps(provider=provider, store=open_store(params.store_uri, env=os.environ), workdir=workdir, board=board,
                state=state_for(params.store_uri, run_id, run_dir))
    host = "127.0.0.1"
    if isinstance(provider, HostedVms):  # the local provider: where its VMs reach this machine
        host = provider.host_address(run_id)
        if provider.isolation == "netns" and deps.state is not None and not deps.state.is_object_storage:
            # Isolated VMs share no disk with the flow: the run's state goes to an object store they reach.
            objects = TestbedObjectStore(workdir / "objects", host)
            deps.closers.append(objects.close)
            deps.state = objects.state(run_id)
            provider.env.update(deps.state.vm_env)
    deps.controller_host = os.environ.get("SAILOR_CONTROLLER_HOST", host)
    return deps


def run_id_for(run_name: str, flow_run_id: str | None) -> str:
    return new_run_id(run_name, (flow_run_id or "").replace("-", "")[:8] or None)


def _cleanup_hook(flow: object, flow_run: FlowRun, state: State) -> None:
    """On cancellation or crash the flow's finally may not run; remove what the run left from here."""
    params = dict(flow_run.parameters or {})
    name = params.get("run_name") or "sailor"
    run_id = run_id_for(str(name), str(flow_run.id))
    try:
        p = SailorParams.model_validate({k: v for k, v in params.items() if k in SailorParams.model_fields})
    except pydantic.ValidationError:
        return  # invalid parameters: nothing was provisioned
    run_dir = Path(p.workdir).resolve() / "runs" / run_id
    if p.provider == "local" and not (run_dir / "local").exists():
        return
    make_provider(p, run_dir).cleanup(run_id)


@task(name="dry-run", cache_policy=NO_CACHE)
def dry_run_report(provider: Provider, requests: list[VmRequest]) -> str:
    """What provisioning the plan would do: the provider's exact API requests and the hourly cost."""
    vms = provider.provision(requests, dry_run=True)
    report = provider.last_dry_run if isinstance(provider, DryRunReporting) else None
    if report is not None:
        from infra.cloud import format_dry_run

        return format_dry_run(report)
    lines = [f"dry run on {provider.name}: nothing rented"]
    lines += [
        f"  vm {v.name}: {v.gpus}x {v.gpu_type} {v.market.value} in {v.zone} at ${v.usd_per_hour:.4f}/h" for v in vms
    ]
    lines.append(f"hourly cost: ${sum(v.usd_per_hour for v in vms):.4f}/h")
    return "\n".join(lines)


@task(name="check-runnable", cache_policy=NO_CACHE)
def check_runnable(plan: ParallelPlan, slots: int | None) -> None:
    """The runtime's own check, before any VM is rented."""
    from sailor_core.models.config import get_config
    from sailor_core.runtime.topology import check_runnable as runtime_check

    try:
        cfg = get_config(plan.model)
    except SailorError as e:  # a published model the runtime does not build: the cloud workers will say
        get_run_logger().warning("the runtime has no config for %s (%s); its workers will check the plan",
                                 plan.model, e)
        return
    runtime_check(plan, cfg, slots=slots)


def _reap_crashed(history: RunHistory, deps: Deps, params: SailorParams, run_id: str, log: Logger) -> None:
    """Runs whose flow died (lease expired): write them down as crashed and remove what they left."""
    for r in history.list_runs():
        if not r.get("crash_detected") or r["run_id"] == run_id:
            continue
        history.mark_crashed(r["run_id"], str(r.get("status_reason", "lease expired")))
        try:
            if r.get("provider", params.provider) == params.provider:
                left = deps.provider.cleanup(r["run_id"]) if params.provider != "local" else \
                    make_provider(params, deps.workdir / "runs" / r["run_id"]).cleanup(r["run_id"])
                history.event(r["run_id"], RunEvent.TEARDOWN, f"run {run_id} found this run crashed and removed "
                              f"{len(left)} VM(s) it left", {"removed": list(left), "by": run_id})
                # its agents uploaded rank 0's own step records as they stopped: steps it trained after its
                # flow's last save reach its history too
                merge_workers_metrics(_state_of(deps, r["run_id"]))
        except Exception as e:  # noqa: BLE001 - `sailor infra cleanup` is the fallback; this run goes on
            log.warning("could not clean up after crashed run %s: %s", r["run_id"], e)


def _check_resume(history: RunHistory, run_id: str, state: RunState, num_layers: int, or_start: bool,
                  log: Logger) -> int | None:
    """Resume never starts over by accident: invalid checkpoints are quarantined and reported. Returns the
    step it resumes at (None: none, and `or_start`)."""
    from sailor_core.runtime import checkpoint as ckpt

    uri = state.checkpoints("flow")
    step, skipped = ckpt.resume_point(ckpt.open_storage(uri), num_layers)
    for s in skipped:
        record(history.event, run_id, RunEvent.CHECKPOINT_SKIPPED, s.line(), {"step": s.step, "moved_to": s.moved_to})
        log.warning("%s", s.line())
    if step is None and not or_start:
        raise ckpt.no_resume_error(uri, skipped)
    return step


def _replan_requests(keeper: LeaseKeeper) -> Callable[[], list[ProviderEvent]]:
    """Re-plan requests from other runs as monitoring sees them: a price event beside the provider's, so
    the replan subflow re-plans against current prices and capacity and records its decision."""

    def requested() -> list[ProviderEvent]:
        from datetime import UTC, datetime

        from infra.provider import EventKind

        req = keeper.take_request()
        if req is None:
            return []
        return [ProviderEvent(kind=EventKind.PRICE_CHANGE, at=datetime.now(UTC), zone="*", gpu_type="*",
                              detail={"old_usd_per_gpu_hour": "as planned",
                                      "new_usd_per_gpu_hour": f"current (re-plan requested by {req['requested_by']})",
                                      "requested_by": req["requested_by"]})]

    return requested


def _previous_checkpoint(history: RunHistory, deps: Deps, run_name: str, run_id: str) -> RunState | None:
    """The state of the newest earlier run of this name that left a checkpoint."""
    from sailor_core.runtime.checkpoint import open_storage

    prev = [r for r in history.list_runs() if r.get("name") == run_name and r["run_id"] != run_id]
    for r in reversed(prev):
        state = _state_of(deps, r["run_id"])
        try:
            names = open_storage(state.checkpoints()).listdir("")
        except StorageUnavailable:
            raise  # a store that does not answer must not turn a resume into a start from step 0
        except (SailorError, OSError) as e:  # that run's storage is gone or unreadable: an older one may do
            get_run_logger().warning("run %s's checkpoints cannot be listed (%s); looking further back", r["run_id"], e)
            continue
        if any(d.startswith("step_") for d in names):
            return state
    return None


def _state_of(deps: Deps, run_id: str) -> RunState:
    """Another run's state, reached the way this run reaches its own."""
    assert deps.state is not None
    mine = deps.state.uri.rstrip("/").rsplit("/", 1)[0]
    if deps.state.is_object_storage:
        base, _, query = deps.state.flow_uri.partition("?")
        other = base.rstrip("/").rsplit("/", 1)[0] + f"/{run_id}" + (f"?{query}" if query else "")
        return RunState(uri=f"{mine}/{run_id}", flow_uri=other, vm_uri=other)
    folder = str(deps.workdir / "runs" / run_id / "state")
    return RunState(uri=folder, flow_uri=folder, vm_uri=folder)


def _copy_checkpoints(src: RunState, dst: RunState) -> int:
    """Copy every checkpoint file of one run's state into another's; returns the files copied."""
    from sailor_core.runtime.checkpoint import open_storage

    a, b = open_storage(src.checkpoints()), open_storage(dst.checkpoints())
    n = 0
    for step in a.listdir(""):
        for name in a.listdir(step):
            b.write(f"{step}/{name}", a.read(f"{step}/{name}"))
            n += 1
    return n


@flow(name="sailor", log_prints=True, on_cancellation=[_cleanup_hook], on_crashed=[_cleanup_hook])
@takes_params(SailorParams)
def sailor(deps: Deps | None = None, **parameters: object) -> RunSummary:
    """The run (see the module's contract). Its parameters are `SailorParams`' fields, one keyword each
    (flows/params.py declares them once); `deps` replaces the side effects built from them (tests)."""
    params = validate_params({k: v for k, v in parameters.items() if v is not None})  # before anything is rented
    run_id = run_id_for(params.run_name, str(runtime_flow_run.id or ""))
    built = deps is None
    deps = deps or default_deps(params, run_id)
    try:
        check_model(deps.store, params.model)  # before the run is recorded, let alone queued behind another
    except InvalidParameters:
        if built:  # nothing is rented yet, but the local provider made the run's testbed to learn its address
            deps.provider.cleanup(run_id)
            for close in deps.closers:
                close()
        raise
    return run_job(params, deps, run_id)


def check_model(store: ProfileStore, model: str) -> None:
    """A model the flow can plan and train: one the store has (published, or stored by `sailor profile model
    --model-config`) or one the runtime builds. Anything else is refused at once, with the names it knows
    and the fix that works for a flow run (it takes no config file)."""
    from sailor_core.models.config import BUILTIN_CONFIGS, get_config

    stored = store.model_names()
    if model in stored:
        return
    try:
        get_config(model)
        return
    except SailorError:
        pass
    raise InvalidParameters(f"invalid parameters: model: unknown model {model!r} (known: "
                            f"{', '.join(sorted(set(stored) | set(BUILTIN_CONFIGS)))}); to fix: set model to one of "
                            f"those, or store a Hugging Face config.json first with `sailor profile model "
                            f"--model-config config.json --model {model}`")


@dataclass(kw_only=True)
class _Run:
    """What one run holds while it goes: released in `_finish` whatever happened."""

    ctx: RunContext
    deps: Deps
    state: RunState
    keeper: LeaseKeeper
    t0: float = field(default_factory=time.time)
    controller: Controller | None = None
    code: CodeRef = field(default_factory=CodeRef)
    job: Job | None = None
    pump: ProviderPump | None = None  # a local provider's: scripted events at their step (tasks/pump.py)
    prefect: PrefectWatch | None = None  # the Prefect server's health (tasks/outage.py)

    @property
    def params(self) -> SailorParams:
        return self.ctx.params

    @property
    def run_id(self) -> str:
        return self.ctx.run_id


def run_job(params: SailorParams, deps: Deps, run_id: str) -> RunSummary:
    """Plan, rent, train and re-plan until the run completes; tear everything down in any case."""
    run = _open(params, deps, run_id)
    status, reason = RunStatus.FAILED, ""
    try:
        ended = _defer_to_live_run(run)
        if ended is not None:
            status = RunStatus.COMPLETED
            reason = (f"deferred to the live run {ended['deferred_to']}; rented nothing" if "deferred_to" in ended
                      else f"nothing left to train after run {ended['nothing_to_do_after']}; rented nothing")
            return ended
        plan = _first_plan(run)
        if params.what_if_trace:  # before anything is rented: the job over that trace, per policy
            _what_if(run)
        if params.dry_run:
            run.ctx.dry_run = dry_run_report(run.deps.provider, node_requests(run_id, run.ctx.version, plan))
            get_run_logger().info("%s", run.ctx.dry_run)
            status, reason = RunStatus.COMPLETED, "dry run: planned, rented nothing"
            summary = run.ctx.summary(status, run.t0)
            summary["dry_run"] = run.ctx.dry_run
            return summary
        resumed = _resume_from_earlier_run(run)
        if resumed is not None and resumed[0] >= run.ctx.total_steps:
            status, reason = RunStatus.COMPLETED, f"nothing left to train after run {resumed[1]}; rented nothing"
            return _nothing_to_do(run, f"the checkpoint of run {resumed[1]} is at step {resumed[0]}, and "
                                       f"{run.ctx.total_steps} steps are asked: nothing is left to train", resumed[1])
        _record_cluster(run, "where the run's VMs and state live")
        requested_at = time.time()
        vms = _provision_first(run)
        run.job = _start_training(run, vms, requested_at)
        _train(run)
        status, reason = RunStatus.COMPLETED, f"{run.ctx.total_steps} steps done"
        record(run.ctx.history.event, run_id, RunEvent.COMPLETED, reason, {"steps": run.ctx.total_steps})
        return run.ctx.summary(status, run.t0)
    except BaseException as e:
        stopped = interrupt.requested() is not None or interrupt.is_stop(e)
        status = RunStatus.CANCELLED if stopped else RunStatus.FAILED
        reason = f"{type(e).__name__}: {e}"[:500]
        raise
    finally:
        _finish(run, status, reason)


def _open(params: SailorParams, deps: Deps, run_id: str) -> _Run:
    """The run's context and state, its `running` status and lease; runs found crashed are cleaned up."""
    log = get_run_logger()
    history = RunHistory(deps.store)
    run_dir = deps.workdir / "runs" / run_id
    private_dir(run_dir, what="run folder")  # 0700 and ours: what it records, the run acts on (files.private_dir)
    ctx = RunContext(setup=RunSetup(run_id=run_id, params=params, provider=deps.provider, history=history,
                                    run_dir=run_dir, reconfiguration_estimate_s=deps.reconfiguration_estimate_s))
    deps.state = deps.state or state_for(params.store_uri, run_id, run_dir)
    record(history.run_status, run_id, RunStatus.RUNNING, f"started on provider {params.provider}",
           {"name": params.run_name, "provider": params.provider, "model": params.model,
            "flow_run_id": str(runtime_flow_run.id or ""), "params": params.model_dump(mode="json")})
    keeper = LeaseKeeper(history, run_id, ttl_s=deps.lease_s).start()  # the run is owned by this process
    run = _Run(ctx=ctx, deps=deps, state=deps.state, keeper=keeper, prefect=_prefect_watch())
    if run.prefect is not None:
        run.prefect.on_lost = lambda why: _stop_without_prefect(run, why)
    _reap_crashed(history, deps, params, run_id, log)
    # runs that may have trained (a rerun that rented nothing does not push a job's checkpoint out), and ended
    ended = [r["run_id"] for r in history.list_runs() if r.get("name") == params.run_name and r["run_id"] != run_id
             and r.get("status") != RunStatus.RUNNING and r.get("plan_versions", 1) != 0]
    try:
        pruned = prune_older_runs(ended, lambda other: _state_of(deps, other))
        if pruned:
            log.info("removed the checkpoints of %d earlier run(s) of %s beyond the newest %d (tasks/retention.py)",
                     len({p.split("/")[0] for p in pruned}), params.run_name, KEEP_RUNS)
    except Exception as e:  # noqa: BLE001 - pruning saves space; this run goes on
        log.warning("could not prune earlier runs' checkpoints: %s", e)
    emit("run.started", run_id, {"name": params.run_name, "model": params.model})
    log.info("run %s: %s on %s, objective %s", run_id, params.model, params.provider, params.objective)
    return run


def _defer_to_live_run(run: _Run) -> RunSummary | None:
    """One job of a name at a time, decided before anything is rented. A rerun (resume, as the schedule
    sends) of a job that still trains asks that run to re-plan against current prices and capacity, and
    ends; any other run beside it is refused. A rerun of a job that trained all its steps ends too,
    renting nothing (`_nothing_left`); a rerun of a failed, cancelled or crashed job goes on to resume it."""
    history, run_id, params = run.ctx.history, run.run_id, run.params
    live = history.live_run(params.run_name, exclude=run_id)
    if live is None:
        return _nothing_left(run)
    until = live["lease_expires_at"][11:19]
    if not params.resume:
        raise SailorError(f"run {live['run_id']} of the name {params.run_name!r} is training (its lease runs until "
                          f"{until} UTC), and one job of a name trains at a time; to fix: wait for it to end, pass "
                          f"resume=true to have it re-plan now, or give this run another run_name")
    why = (f"run {run_id} (resume) found run {live['run_id']} of the same name training (lease until {until} UTC) "
           f"and asked it to re-plan against current prices and capacity")
    history.request_replan(live["run_id"], run_id, why)
    record(history.event, run_id, RunEvent.DEFERRED, why + "; rented nothing", {"live_run": live["run_id"]})
    get_run_logger().info("%s; rented nothing", why)
    return {"run_id": run_id, "status": "completed", "deferred_to": live["run_id"]}


def _nothing_left(run: _Run) -> RunSummary | None:
    """The schedule's rerun (resume_or_start) of a job whose last run completed at least the steps asked now:
    nothing to train, decided from the history before anything is planned or rented (were the job's checkpoints
    found invalid, resume_or_start would otherwise start it over). A plain resume is not decided here: it asks
    to continue from the checkpoint, so the checkpoint is checked first (`_resume_from_earlier_run`), and
    then it too ends renting nothing when that checkpoint is at the last step, or fails naming each invalid one."""
    history, run_id, params = run.ctx.history, run.run_id, run.params
    schedule = params.resume and params.resume_or_start
    last = history.last_job(params.run_name, exclude=run_id) if schedule else None
    total = _steps_asked(params)
    if last is None or last.get("status") != RunStatus.COMPLETED or total is None:
        return None
    done = int(last.get("steps_done") or 0)
    if done < total:
        return None
    return _nothing_to_do(run, f"run {last['run_id']} of this name completed {done} steps, and {total} are asked: "
                               f"nothing is left to train", last["run_id"])


def _nothing_to_do(run: _Run, why: str, after: str) -> RunSummary:
    """The run ends completed without renting anything, and says why."""
    record(run.ctx.history.event, run.run_id, RunEvent.NOTHING_TO_DO, why + "; rented nothing", {"after": after})
    get_run_logger().info("%s; rented nothing", why)
    return {"run_id": run.run_id, "status": "completed", "nothing_to_do_after": after}


def _steps_asked(params: SailorParams) -> int | None:
    """The steps the parameters ask for, where that is known before profiling (None: a token budget over a
    model whose sequence length the runtime does not know)."""
    if params.steps is not None:
        return params.steps
    from sailor_core.models.config import get_config

    try:
        return params.total_steps(get_config(params.model).sequence_length)
    except SailorError:
        return None


def _offers(run: _Run) -> list[Capacity]:
    p = run.params
    return fetch_offerings(run.deps.provider, regions=p.regions, gpu_types=p.gpu_types, markets=p.markets)


def _first_plan(run: _Run) -> ParallelPlan:
    """Offerings, the run's code and controller, the profiles (measured on rented VMs where missing)
    and the first plan, adopted and returned."""
    ctx, params, provider = run.ctx, run.params, run.deps.provider
    offers = _offers(run)
    if not any(o.gpus > 0 for o in offers):
        raise RuntimeError(f"provider {params.provider} offers no GPUs matching the request; "
                           f"to fix: allow more regions, GPU types or markets")
    gpu_set = sorted({o.gpu_type for o in offers if o.gpus > 0})
    run.code = ship_code(run.deps.state, run.deps.provider.name, ship=run.deps.ship_wheel)
    run.controller = Controller(host=run.deps.controller_host)
    if isinstance(provider, ScriptedEvents):  # the workers hold at each scripted step until the provider saw it
        run.controller.hold_steps = lambda: provider.scripted_steps(run.run_id)
    remote = VmCommands(provider, run.controller, run.state, run.code, run.run_id)
    ctx.base_book = profile(run.deps.store, params.model, gpu_set, offers=offers, remote=remote)
    ctx.calibration = ctx.history.calibration(gpu_set)
    if ctx.calibration:
        get_run_logger().info("using online calibration from earlier runs: %s", ctx.calibration)
    result = _plan_now(ctx, offers)
    plan, est = chosen_plan(result)
    ctx.total_steps = params.total_steps(ctx.base_book.model.sequence_length)
    if isinstance(provider, ScriptedEvents):
        for step in (s for s in provider.scripted_steps(run.run_id) if s > ctx.total_steps):
            get_run_logger().warning("the scenario scripts an event at step %d, after the run's last step %d: it "
                                     "will not happen", step, ctx.total_steps)
    if params.provider == "local":  # cloud plans are checked by the workers on their VMs
        check_runnable(plan, params.workers)
    ctx.adopt_plan(plan, est, result.explanation or "best plan for the request", result.frontier)
    return plan


def _what_if(run: _Run) -> None:
    """The job replayed over `what_if_trace` under each policy (tasks.replay), published as an artifact."""
    ctx, p = run.ctx, run.params
    assert ctx.base_book is not None and p.what_if_trace
    job = job_of(ctx.plan_request(ResourcePool(entries=())), total_steps=ctx.total_steps,
                 sequence_length=ctx.base_book.model.sequence_length,
                 checkpoint_interval=planning_checkpoint_interval(p.checkpoint_interval),
                 reconfiguration_s=ctx.reconfiguration_s(), min_gain=p.min_gain)
    what_if(run.run_id, p.what_if_trace, calibrated_book(ctx.base_book, ctx.calibration), job, ctx.history)


def _resume_from_earlier_run(run: _Run) -> tuple[int, str] | None:
    """With resume: the newest earlier run's checkpoints copied in, and checked (never a silent restart);
    returns (the step it resumes at, that run's id), None when it starts at step 0."""
    params, ctx = run.params, run.ctx
    if not params.resume:
        return None
    log = get_run_logger()
    prev = _previous_checkpoint(ctx.history, run.deps, params.run_name, run.run_id)
    if prev is not None:
        _copy_checkpoints(prev, run.state)
        log.info("resuming from the checkpoints of %s", prev.uri)
    assert ctx.plan is not None
    step = _check_resume(ctx.history, run.run_id, run.state, ctx.plan.stages[-1].last_layer + 1,
                         params.resume_or_start, log)
    return None if step is None or prev is None else (step, prev.uri.rstrip("/").rsplit("/", 1)[-1])


def _record_cluster(run: _Run, what: str, *, at_teardown: bool = False) -> None:
    """Where the run's VMs, code and state are (`sailor runs show` "cluster"); at teardown written directly,
    outside any task (the flow may be cancelled), and without the controller, which is closed by then."""
    provider = run.deps.provider
    cluster = provider.cluster_info(run.run_id) if isinstance(provider, ClusterInfo) else \
        {"isolation": "cloud", "provider": provider.name}
    live = {"controller": run.controller.endpoint} if run.controller is not None and not at_teardown else {}
    payload = {"cluster": {**cluster, "wheel_sha256": run.code.sha256, "state_uri": run.state.uri,
                           "checkpoint_uri": run.state.checkpoints("public"), **live}}
    if at_teardown:
        run.ctx.history.event(run.run_id, RunEvent.CLUSTER, what, payload)
    else:
        record(run.ctx.history.event, run.run_id, RunEvent.CLUSTER, what, payload)


def _plan_now(ctx: RunContext, offers: Sequence[Capacity]) -> PlanResult:
    """The planner's answer on what is offered now, priced and calibrated as the run knows it."""
    assert ctx.base_book is not None
    return make_plan(ctx.plan_request(pool_from(offers)), book_now(ctx.base_book, offers, ctx.calibration))


def _provision_first(run: _Run) -> list[Vm]:
    """The first plan's VMs; a stockout between planning and renting plans again on what is offered."""
    ctx = run.ctx
    for _ in range(FIRST_PROVISION_TRIES - 1):
        try:
            return _provision_plan(run)
        except CapacityError as e:
            result = _plan_now(ctx, _offers(run))
            plan, est = chosen_plan(result)
            ctx.adopt_plan(plan, est, f"the first provisioning found less than planned ({e}); "
                                      f"planned again on what is offered now", result.frontier)
            record(ctx.history.event, run.run_id, RunEvent.CAPACITY_CHANGE, f"stockout at first provisioning: {e}",
                   {"plan_version": ctx.version})
    return _provision_plan(run)  # the last try: a stockout now fails the run


def _provision_plan(run: _Run) -> list[Vm]:
    """The VMs of the run's current plan."""
    assert run.ctx.plan is not None
    return provision(run.deps.provider, node_requests(run.run_id, run.ctx.version, run.ctx.plan))


def _start_training(run: _Run, vms: list[Vm], requested_at: float) -> Job:
    """The job of the first plan on its VMs (asked for at `requested_at`), its agents started and the plan
    handed out."""
    ctx, params, run_id = run.ctx, run.params, run.run_id
    assert ctx.plan is not None
    ctx.ledger.rent(vms)
    record(ctx.history.event, run_id, RunEvent.PROVISIONED, f"{len(vms)} VMs for plan v{ctx.version}",
           {"vms": [v.vm_id for v in vms], "plan_version": ctx.version})
    emit("provisioned", run_id, {"vms": [v.vm_id for v in vms]})
    assert ctx.estimate is not None
    every = ctx.checkpoint_interval(ctx.plan, ctx.estimate)
    job = Job(run_id=run_id, version=ctx.version, plan=ctx.plan, vms=vms, run_dir=ctx.run_dir, state=run.state,
              code=run.code, total_steps=ctx.total_steps, checkpoint_interval=every,
              seed=params.seed, data_uri=params.dataset or "", estimate_s=ctx.estimate.iteration_time_s,
              controller=run.controller,
              started_by=ColdStart(provisioned_at=time.time(), requested_at=requested_at,
                                   provider=run.deps.provider.name))
    if isinstance(run.deps.provider, ScriptedEvents):
        assert run.controller is not None
        run.pump = ProviderPump(run.deps.provider, run_id, run.controller, run.deps.board,
                                log=get_run_logger()).start()
    job.launched_at = launch(run.deps.provider, job)
    resumed = f", resuming from the checkpoint of step {job.start_step}" if job.start_step else ""
    record(ctx.history.event, run_id, RunEvent.TRAINING_STARTED, f"plan v{ctx.version} on {len(vms)} workers{resumed}",
           {"plan_version": ctx.version, "total_steps": ctx.total_steps, "resume_step": job.start_step})
    return job


def _train(run: _Run) -> None:
    """Monitor the job and re-plan on what monitoring saw, until every step is done."""
    ctx, params, deps = run.ctx, run.params, run.deps
    job = run.job
    assert job is not None
    bar = ProgressBar(run.run_id, ctx.total_steps)
    deadline_at = run.t0 + params.deadline_s if params.deadline_s else None
    requested = _replan_requests(run.keeper)
    seen: set[tuple[str, str, str]] = set()
    replans = 0
    while True:
        interrupt.check()  # a stop that library code swallowed on the way still ends the run here
        out = monitor(deps.provider, job, ctx.history, bar, deps.board, seen=seen, requested=requested,
                      poll_s=deps.poll_s, prefect=run.prefect,
                      deadline_at=deadline_at, tolerance=params.calibration_tolerance, calibrate_after=5,
                      calibrated=job.calibrated, stall_timeout_s=deps.stall_timeout_s)
        ctx.observe(job, out.progress)
        save_metrics(job)  # this version's steps so far, into the run's state
        if out.completed:
            return
        replans += 1
        if replans > deps.max_replans:
            raise RuntimeError(f"gave up after {deps.max_replans} replans; see the run's events for why")
        interrupt.check()
        job = run.job = replan(ctx, job, out.events, out.calibration, out.progress)


def _finish(run: _Run, status: RunStatus, reason: str) -> None:
    """Lease ended, every VM removed, every step's record saved, controller closed, the final status written."""
    ctx, deps, run_id = run.ctx, run.deps, run.run_id
    run.keeper.stop()  # the final status below ends the lease
    for thread in (run.pump, run.prefect):
        if thread is not None:
            thread.stop()
    removed: list[str] = []
    try:
        removed = teardown(deps.provider, run_id)
    except BaseException as e:  # the status must still be written; teardown is retried by the hooks
        reason = (reason + f"; teardown failed: {e}")[:800]
        status = RunStatus.FAILED
    ctx.ledger.release_all()
    # Teardown goes on past each of these, logging it: the run's outcome must still be written.
    _save_steps(run)  # after teardown: the agents uploaded rank 0's own step records as they stopped
    _prune(run)
    if run.controller is not None:
        run.controller.close()
    if isinstance(deps.provider, ClusterInfo) and run.job is not None:
        try:  # the VMs the run had, as they ended
            _record_cluster(run, "the run's VMs at teardown", at_teardown=True)
        except Exception as e:  # noqa: BLE001 - a record for people; the outcome below is what counts
            get_run_logger().warning("could not record the run's VMs at teardown: %s", e)
    for close in deps.closers:
        try:
            close()
        except Exception as e:  # noqa: BLE001 - a server or client the run opened; nothing else depends on it
            get_run_logger().warning("closing %s at teardown failed: %s", getattr(close, "__qualname__", close), e)
    _write_outcome(run, status, reason, removed)


def _prefect_watch() -> PrefectWatch | None:
    """A watch on the Prefect server this flow reports to (None: no HTTP server to watch)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            api = str(client.api_url or "")
    except Exception as e:  # noqa: BLE001 - the run goes on unwatched: an outage then blocks as Prefect does
        get_run_logger().warning("cannot watch the Prefect server's health: %s", e)
        return None
    if not api.startswith("http"):
        return None
    outage_s = float(os.environ.get("SAILOR_PREFECT_OUTAGE_S", DEFAULT_OUTAGE_S))
    return PrefectWatch(api.rstrip("/") + "/health", outage_s=outage_s).start()


def _stop_without_prefect(run: _Run, why: str) -> NoReturn:
    """The Prefect server is lost (tasks/outage.py): every Prefect call would block, so the job is stopped here,
    without it. The agents are stopped (the workers checkpoint first), the steps and the outcome go to the run
    history, one line goes to stderr, and the process leaves with status 1."""
    reason = f"{why}; the run stopped"
    try:
        for thread in (run.pump, run.keeper):
            if thread is not None:
                thread.stop()
        run.deps.provider.cleanup(run.run_id)  # SIGTERM to the agents: the workers checkpoint, then stop
        ctl = run.controller
        if ctl is not None:
            merge_workers_metrics(run.state, {v: ctl.metrics(v) for v in ctl.metric_versions()})
        if run.job is not None:
            at = checkpoint_steps(run.state.checkpoints("flow"), run.job.num_layers)
            reason += (f" with its checkpoint of step {at} kept at {run.state.checkpoints('public')}" if at else
                       f" at step {run.deps.board.max_step()} with no checkpoint")
        run.ctx.history.run_status(run.run_id, RunStatus.FAILED, reason, run.ctx.summary(RunStatus.FAILED, run.t0))
        if ctl is not None:
            ctl.close()
        for close in run.deps.closers:
            close()
    except BaseException as e:  # noqa: BLE001 - the line below still says what happened; the hooks clean up
        reason += f" (stopping it met: {type(e).__name__}: {e})"[:300]
    finally:
        # straight to the process's stderr: print() in a flow run goes to Prefect's logger (log_prints)
        os.write(2, f"error: {reason}; to fix: start the Prefect server again and rerun with resume=true\n".encode())
        os._exit(1)


def _prune(run: _Run) -> None:
    """The run's wheel copy and older checkpoints removed (tasks/retention.py), while its state is reachable."""
    if run.job is None:
        return
    try:
        removed = prune_run(run.state, checkpoint_steps(run.state.checkpoints("flow"), run.job.num_layers))
        if removed:
            get_run_logger().info("pruned %d file(s) of the run's state: its wheel copy and checkpoints older than "
                                  "its newest valid one", len(removed))
    except Exception as e:  # noqa: BLE001 - pruning saves space; the run's outcome comes first
        get_run_logger().warning("could not prune the run's state: %s", e)


def _save_steps(run: _Run) -> None:
    """Every plan version's step records (the controller's and the workers' own files) into the run's state,
    and the scripted events that did not happen into its history."""
    log = get_run_logger()
    if run.job is not None and run.job.controller is not None:
        try:
            save_metrics(run.job, workers_files=True)
        except Exception as e:  # noqa: BLE001 - the metrics stay in the workers' logs; the outcome comes first
            log.warning("could not save the run's step records: %s", e)
    provider = run.deps.provider
    if isinstance(provider, ScriptedEvents) and run.job is not None:
        try:
            for what in provider.missed_events(run.run_id, last_step=run.deps.board.max_step()):
                log.warning("%s", what)
                run.ctx.history.event(run.run_id, RunEvent.SCRIPTED_MISSED, what, {})
        except Exception as e:  # noqa: BLE001 - a record for people; the outcome comes first
            log.warning("could not record the scenario's missed events: %s", e)


def result_line(summary: RunSummary) -> str:
    """The run's outcome in one line that ends with what it trained: its final loss and tokens."""
    loss = summary.get("final_loss")
    return (f"run {summary.get('run_id')} {summary.get('status')}: {summary.get('steps_done', 0)} of "
            f"{summary.get('total_steps', 0)} steps in {summary.get('wall_s', 0)} s, "
            f"{usd(float(summary.get('usd_total', 0.0)))} USD; final loss {'-' if loss is None else f'{loss:.4f}'}, "
            f"{summary.get('tokens', 0):,} tokens")


def _write_outcome(run: _Run, status: RunStatus, reason: str, removed: list[str]) -> None:
    """The teardown event, final status, Prefect event and artifacts (never hiding the run's outcome)."""
    ctx, history, run_id = run.ctx, run.ctx.history, run.run_id
    log = get_run_logger()
    try:
        history.event(run_id, RunEvent.TEARDOWN, f"removed {len(removed)} VMs still running" if removed
                      else "no VM left to remove", {"removed": removed})
        summary = ctx.summary(status, run.t0)
        history.run_status(run_id, status, reason, summary)
        emit(f"run.{status}", run_id, {"reason": reason})
        shown = history.show(run_id)
        publish_timeline(run_id, shown["events"], shown["decisions"])
        publish_cost(run_id, ctx.cost_table())
        log.info("run %s %s: %s", run_id, status, json.dumps(summary, default=str)[:2000])
        log.info("%s", result_line(summary))
    except Exception as e:  # reporting must not hide the run's own outcome
        log.warning("could not write the run's final status: %s", e)
