"""Thin Prefect tasks over infra, profiles_store and sailor_core: one task per outside call.

Contract: every task that touches the outside (provider API, store, worker processes) is here,
with retries where a retry is safe (reads, idempotent writes, terminate). Provisioning is retried
only on the provider's own transient errors; a `CapacityError` is not retried (the planner must
choose again). No task caches (inputs are live objects). The long `monitor` task polls the
provider and the workers' metrics until the job completes or something needs a decision, emitting
a Prefect event and a history row for everything it sees.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from infra.provider import AgentExitCodes, EventKind, Provider, ProviderEvent, Reporter, Vm, VmRequest
from sailor_core.domain import Capacity, Market
from sailor_core.errors import CapacityError, ProviderError
from sailor_core.planner.request import PlanRequest, PlanResult
from sailor_core.profiles import ProfileBook
from sailor_core.units import sig
from tasks import interrupt
from tasks.control import HeartbeatBoard, checkpoint_steps
from tasks.decisions import (
    CalibrationCheck,
    FirstStep,
    all_exited_cleanly,
    awaits_cause,
    check_calibration,
    exit_verdict,
    failed_vms,
    first_step_kind,
    needs_decision,
    stop_reason,
)
from tasks.history import Measurement, RunEvent, RunHistory
from tasks.jobs import ColdStart, Job, Progress, Switch, assign_job, assignments, read_progress
from tasks.outage import PrefectWatch
from tasks.planning import run_planner
from tasks.reporting import ProgressBar, emit, publish_curves
from tasks.runstate import flush_metrics, merge_workers_metrics, read_metrics


def _no_retry_on_capacity(task, task_run, state) -> bool:
    try:
        state.result()
    except CapacityError:
        return False
    except Exception:  # noqa: BLE001 - a retry condition only classifies: Prefect raises the error after the last try
        return True
    return True


@task(name="offerings", retries=3, retry_delay_seconds=[1, 2, 5], cache_policy=NO_CACHE)
def fetch_offerings(provider: Provider, *, regions: Sequence[str] | None, gpu_types: Sequence[str] | None,
                    markets: Sequence[str] | None) -> list[Capacity]:
    wanted = None if markets is None else [Market.parse(m) for m in markets]
    return provider.offerings(regions=regions, gpu_types=gpu_types, markets=wanted)


@task(name="provision", retries=2, retry_delay_seconds=2, retry_condition_fn=_no_retry_on_capacity,
      cache_policy=NO_CACHE)
def provision(provider: Provider, requests: Sequence[VmRequest], dry_run: bool = False) -> list[Vm]:
    if not requests:
        return []
    return provider.provision(requests, dry_run=dry_run)


@task(name="start-agents", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def start_agents(provider: Provider, job: Job, vm_ids: Sequence[str] | None = None) -> None:
    """Bootstrap the agent on these VMs of the job (all by default): it installs the run's wheel and
    runs one worker per device, which meet the run's controller and wait there for their assignment
    (`hand_out`), so VMs can start early while the previous plan still trains."""
    for vm, a in assignments(job):
        if vm_ids is None or vm.vm_id in vm_ids:
            provider.bootstrap(vm, a)


@task(name="hand-out", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def hand_out(job: Job) -> float:
    """Give every worker its rank and the plan; resume from the newest complete checkpoint if any."""
    resume_step = checkpoint_steps(job.state.checkpoints("flow"), job.num_layers)
    job.start_step = resume_step or 0
    # After a replan the workers may hold a newer state in memory than any checkpoint (a lost replica's
    # layers live on in the others): they resume, from memory where they can, even with no checkpoint yet.
    assign_job(job, resume=resume_step is not None or job.version > 1)
    return time.time()


def launch(provider: Provider, job: Job) -> float:
    """Start every agent of the job and hand out the plan; returns the launch time."""
    start_agents(provider, job)
    return hand_out(job)


@task(name="save-metrics", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def save_metrics(job: Job, *, workers_files: bool = False) -> None:
    """Every plan version's per-step records into the run's state in object storage, then the curves."""
    flush_versions(job, workers_files=workers_files)
    publish_training_curves(job)


def flush_versions(job: Job, *, workers_files: bool = False) -> None:
    """The per-step records of every plan version the controller got (an older version's last steps
    arrive after the flow moved on to the next) whose count changed; with `workers_files`, merged with
    rank 0's own files (`workers_metrics`: what the agents uploaded, the source when a report to the
    controller was lost) and written in any case: at the end of a run, after its VMs stopped."""
    ctl = job.controller
    if ctl is None:
        return
    if workers_files:
        merge_workers_metrics(job.state, {v: ctl.metrics(v) for v in ctl.metric_versions()})
        return
    for v in ctl.metric_versions():
        rows = ctl.metrics(v)
        if ctl.flushed.get(v) != len(rows):
            flush_metrics(job.state, v, rows)
            ctl.flushed[v] = len(rows)


def publish_training_curves(job: Job) -> None:
    """The loss and throughput artifact from every plan version's saved records; a picture, never fatal."""
    try:
        publish_curves(job.run_id, read_metrics(job.state))
    except Exception as e:  # noqa: BLE001 - e.g. the state's storage unreachable: the run goes on
        get_run_logger().warning("could not read the run's metrics for its curves: %s", e)


@task(name="terminate", retries=3, retry_delay_seconds=[1, 2, 5], cache_policy=NO_CACHE)
def terminate(provider: Provider, vm_ids: Sequence[str]) -> None:
    if vm_ids:
        provider.terminate(list(vm_ids))


@task(name="teardown", retries=3, retry_delay_seconds=[1, 2, 5], cache_policy=NO_CACHE)
def teardown(provider: Provider, run_id: str) -> list[str]:
    """Remove everything tagged with the run; return what was still there."""
    removed = provider.cleanup(run_id)
    left = [v.vm_id for v in provider.list_vms(run_id) if v.state in ("running", "preempting")]
    if left:
        raise RuntimeError(f"VMs still running after cleanup of run {run_id}: {left}")
    return removed


RECORD_RETRY_S = (0.5, 1.0, 2.0)  # waits before the retries of a history write


def record(fn: Callable[..., None], *args: object, **kwargs: object) -> None:
    """One write to the run history (store), retried 3 times after an error. A plain call, not a Prefect
    task: a run writes dozens of rows, and as task runs each was three state events in `prefect
    deployment run --watch` and the UI's graph, burying the steps and decisions."""
    for wait in (*RECORD_RETRY_S, None):
        try:
            fn(*args, **kwargs)
            return
        except Exception:  # noqa: BLE001 - retried; the last error is raised as it is
            if wait is None:
                raise
            time.sleep(wait)


@task(name="plan", cache_policy=NO_CACHE)
def make_plan(request: PlanRequest, book: ProfileBook) -> PlanResult:
    """The planner over the current pool; NoPlanError (with the nearest miss) when nothing fits."""
    return run_planner(request, book)


def record_reconfigured(job: Job, switch: Switch, history: RunHistory, step: int) -> None:
    """The `reconfigured` event of a plan version's first step: how long the switch took, how many
    worker processes went on running (same PIDs as before it), and how the ranks got their state."""
    assert job.first_step_at is not None
    secs = job.first_step_at - switch.trigger_at
    job.reconfiguration_s = secs
    ctl = job.controller
    now = ctl.worker_pids([v.vm_id for v in job.vms]) if ctl is not None else {}
    kept = sum(1 for vm, pids in switch.pids_before.items() for w, pid in pids.items()
               if pid is not None and now.get(vm, {}).get(w) == pid)
    loaded = ctl.loaded_from(job.version) if ctl is not None else {}
    trig = ", ".join(switch.trigger)
    reason = (f"plan v{job.version} trained its first step {secs:.1f}s after the {trig} event; {kept} worker "
              f"process(es) kept running; {loaded_words(loaded)}")
    payload = {"plan_version": job.version, "reconfiguration_s": secs, "step": step, "workers": len(job.vms),
               "kept_processes": kept, "loaded_from": loaded, "new_vms": switch.new_vms}
    history.event(job.run_id, RunEvent.RECONFIGURED, reason, payload)
    history.measurement(job.run_id, Measurement.RECONFIGURATION, payload, reason)
    emit("reconfigured", job.run_id, {"reason": reason, **payload})
    get_run_logger().info("reconfigured: %s", reason)


def loaded_words(loaded: dict[str, int]) -> str:
    """How a new plan's ranks got their state, in words (`Controller.loaded_from`'s counts), e.g. "2 ranks
    kept their state in memory, 1 rank loaded its state from the checkpoint"."""
    said = {"memory": "kept {its} state in memory", "checkpoint": "loaded {its} state from the checkpoint",
            "none": "started from fresh weights"}
    parts = [f"{n} rank{'s' if n != 1 else ''} " + said.get(how, how).format(its="its" if n == 1 else "their")
             for how, n in sorted(loaded.items(), key=lambda kv: ("memory", "checkpoint", "none").index(kv[0])
                                  if kv[0] in said else 3) if n]
    return ", ".join(parts) if parts else "no rank said how it resumed"


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """A plan version's measured against estimated iteration time (the `iteration_time` measurement)."""

    plan_version: int
    measured_s: float
    estimated_s: float
    ratio: float  # measured / estimated
    steps: int  # steps timed

    def to_json(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class MonitorOutcome:
    """Why monitoring returned: the job completed, or events (and/or a calibration) need a decision."""

    completed: bool
    events: list[ProviderEvent] = field(default_factory=list)
    progress: Progress | None = None
    calibration: Calibration | None = None
    reason: str = ""


METRICS_FLUSH_S = 10.0  # how often the per-step records reach the run's state while it trains
LOG_EVERY_S = 30.0  # the longest the flow's log goes without a progress line while steps go by


def log_every(total_steps: int) -> int:
    """Steps between two progress lines in the flow's log (what `prefect deployment run --watch` shows):
    twenty lines over a run."""
    return max(1, round(total_steps / 20))


def event_row(e: ProviderEvent) -> dict[str, object]:
    return {"vm_id": e.vm_id, "zone": e.zone, "gpu_type": e.gpu_type,
            "market": e.market.value if e.market else None, **{k: v for k, v in e.detail.items()}}


def event_reason(e: ProviderEvent) -> str:
    d = e.detail
    if e.kind == EventKind.PRICE_CHANGE:
        return (f"{e.gpu_type} {e.market.value if e.market else ''} in {e.zone}: "
                f"{d.get('old_usd_per_gpu_hour')} -> {d.get('new_usd_per_gpu_hour')} USD/GPU-hour")
    if e.kind == EventKind.CAPACITY_CHANGE:
        return (f"{e.gpu_type} {e.market.value if e.market else ''} in {e.zone}: "
                f"{d.get('old_count')} -> {d.get('new_count')}")
    if e.kind == EventKind.PREEMPTION:
        return f"VM {e.vm_id} ({e.market.value if e.market else ''}) will be taken back (grace {d.get('grace_s')}s)"
    return f"VM {e.vm_id}: {d.get('reason', '')}"


def _retry_on_outside_errors(task, task_run, state) -> bool:
    """Monitoring resumes after a provider or I/O hiccup; a diagnosis (stall, deadline) is final."""
    try:
        state.result()
    except (ProviderError, OSError):
        return True
    except Exception:  # noqa: BLE001 - a retry condition only classifies: Prefect raises the error after the last try
        return False
    return False


@dataclass
class _Watch:
    """One monitor call's view of a job: what it has seen, logged and flushed, and when it last moved."""

    job: Job
    history: RunHistory
    bar: ProgressBar
    board: HeartbeatBoard
    seen: set[tuple[str, str, str]]
    seen_step: int = -1
    last_log: float = 0.0
    last_progress_at: float = field(default_factory=time.time)
    last_flush: float = field(default_factory=time.time)
    prefect: PrefectWatch | None = None  # the Prefect server's health: no artifact while it does not answer

    @property
    def prefect_up(self) -> bool:
        return self.prefect is None or self.prefect.state() == "up"

    def progress(self) -> Progress:
        """The job's progress now; heartbeats to the board, the bar, the log and the metrics kept current."""
        job, ctl = self.job, self.job.controller
        prog = read_progress(job)
        beats = ctl.heartbeats([v.vm_id for v in job.vms]) if ctl is not None else {}
        for v in job.vms:
            self.board.beat(v.vm_id, at=beats.get(v.vm_id), step=prog.step)
        if prog.step != self.seen_step:
            self.last_progress_at = time.time()
            if self.prefect_up:
                self.bar.update(prog.step)
            if time.time() - self.last_flush > METRICS_FLUSH_S and ctl is not None and self.prefect_up:
                flush_versions(job)
                publish_training_curves(job)  # the curves artifact, while it trains
                self.last_flush = time.time()
            every = log_every(job.total_steps)
            if (prog.step // every > max(self.seen_step, 0) // every or time.time() - self.last_log > LOG_EVERY_S
                    or prog.step >= job.total_steps):
                it = f", {sig(prog.recent_iteration_s)} s/step" if prog.recent_iteration_s else ", warming up"
                loss = f", loss {prog.loss:.4f}" if prog.loss is not None else ""
                get_run_logger().info("step %d of %d (plan v%d)%s%s", prog.step, job.total_steps, job.version, loss, it)
                self.last_log = time.time()
            self.seen_step = prog.step
        if prog.steps_this_version and job.first_step_at is None:
            self.first_step(prog)
        return prog

    def first_step(self, prog: Progress) -> None:
        """The plan version trained its first step: measure the switch or the cold start it ends."""
        job = self.job
        job.first_step_at = time.time()
        kind = first_step_kind(job.started_by)
        if kind is FirstStep.RECONFIGURED and isinstance(job.started_by, Switch):
            record_reconfigured(job, job.started_by, self.history, prog.step)
        elif kind is FirstStep.COLD_START and isinstance(job.started_by, ColdStart):
            secs = job.first_step_at - job.started_by.provisioned_at
            job.cold_start_s = secs
            reason = f"plan v{job.version} trained its first step {secs:.1f}s after its VMs were provisioned"
            self.history.measurement(job.run_id, Measurement.COLD_START,
                                     {"plan_version": job.version, "cold_start_s": secs}, reason)
            get_run_logger().info("cold start: %s", reason)
            start = job.started_by
            if start.requested_at is not None and start.provider:
                took = job.first_step_at - start.requested_at
                self.history.measurement(
                    job.run_id, Measurement.VM_START,
                    {"provider": start.provider, "vm_start_s": took, "vms": len(job.vms), "plan_version": job.version},
                    f"{len(job.vms)} new {start.provider} VM(s): {took:.1f}s from the request to the first step")

    def report(self, e: ProviderEvent) -> None:
        """An event into the history, the Prefect event stream and the log."""
        self.history.event(self.job.run_id, e.kind, event_reason(e), event_row(e), at=e.at)
        emit(e.kind.value, self.job.run_id, {"reason": event_reason(e), **event_row(e)})
        get_run_logger().info("event %s: %s", e.kind.value, event_reason(e))

    def events_to_answer(self, provider: Provider,
                         requested: Callable[[], list[ProviderEvent]] | None = None) -> list[ProviderEvent]:
        """Every new provider event (and event `requested` from outside) reported; those the plan must
        answer, and the workers whose generation failed (lost workers to the orchestration), returned."""
        job = self.job
        plan_vms = {v.vm_id for v in job.vms}
        out = []
        for e in [*provider.events(job.run_id), *(requested() if requested is not None else [])]:
            key = (e.kind.value, e.at.isoformat(), e.vm_id)
            if key not in self.seen:
                self.seen.add(key)
                self.report(e)
                if needs_decision(e.kind.value, e.vm_id, plan_vms):
                    out.append(e)
        if job.controller is not None:
            statuses = job.controller.statuses(sorted(plan_vms), job.version)
            for vm_id in failed_vms(statuses):
                key = ("lost", f"v{job.version}", vm_id)
                if key not in self.seen:
                    self.seen.add(key)
                    e = ProviderEvent(kind=EventKind.LOST, at=utcnow(), vm_id=vm_id, reported_by=Reporter.WORKERS,
                                      detail={"reason": f"worker reported {statuses[vm_id][:300]}"})
                    self.report(e)
                    out.append(e)
        return out

    def calibration(self, prog: Progress, check: CalibrationCheck) -> MonitorOutcome | None:
        """Record the measured against estimated iteration time; an outcome when it departs."""
        job = self.job
        assert prog.recent_iteration_s is not None
        reading = Calibration(plan_version=job.version, measured_s=prog.recent_iteration_s,
                              estimated_s=job.estimate_s, ratio=check.ratio, steps=len(prog.iteration_times))
        payload = reading.to_json()
        self.history.measurement(job.run_id, Measurement.ITERATION_TIME, payload)
        if not check.departs:
            job.calibrated = True
            return None
        reason = check.reason(prog.recent_iteration_s, job.estimate_s)
        self.history.event(job.run_id, RunEvent.ITERATION_TIME, reason, payload)
        emit("iteration_time", job.run_id, {"reason": reason, **payload})
        get_run_logger().info("calibration: %s", reason)
        return MonitorOutcome(completed=False, progress=prog, calibration=reading, reason=reason)

    def agents_done(self, provider: Provider) -> MonitorOutcome | None:
        """Agents that all exited cleanly: completed, or an error when steps are missing."""
        job = self.job
        if not isinstance(provider, AgentExitCodes) or not job.vms:
            return None
        codes = [provider.agent_exit_code(v.vm_id) for v in job.vms]
        if not all_exited_cleanly(codes):  # running or failed: heartbeats and statuses speak for those
            return None
        prog = read_progress(job)
        if exit_verdict(codes, prog.step, job.total_steps) == "completed":
            return MonitorOutcome(completed=True, progress=prog)
        raise RuntimeError(
            f"every worker of plan v{job.version} exited cleanly at step {prog.step} of {job.total_steps}; "
            f"to fix: check the worker logs under {job.state.logs('public')}"
        )


@task(name="monitor", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=2,
      retry_condition_fn=_retry_on_outside_errors)
def monitor(provider: Provider, job: Job, history: RunHistory, bar: ProgressBar, board: HeartbeatBoard, *,
            seen: set[tuple[str, str, str]], requested: Callable[[], list[ProviderEvent]] | None = None,
            poll_s: float, deadline_at: float | None, tolerance: float, calibrate_after: int,
            calibrated: bool, stall_timeout_s: float, prefect: PrefectWatch | None = None) -> MonitorOutcome:
    """Watch the job until it completes or something needs a decision; report everything seen (the
    provider's events, and those `requested` from outside it: another run's request to re-plan). While
    the Prefect server does not answer (`prefect`, tasks/outage.py) it only waits for it, the job training
    on."""
    watch = _Watch(job=job, history=history, bar=bar, board=board, seen=seen, prefect=prefect)
    shape = f"plan v{job.version}: {job.plan.num_stages} stage(s) x {job.plan.data_parallel} replica(s)"
    held: list[ProviderEvent] = []  # workers' failures kept while the provider may still name their cause
    held_since: float | None = None
    while True:
        if prefect is not None and prefect.state() != "up":
            ride_out(prefect, watch, poll_s)
        prog = watch.progress()
        # Every event is reported, also one that came while the flow looked elsewhere and the job then
        # finished: the run's history has it either way.
        actionable = held + watch.events_to_answer(provider, requested)
        if prog.step >= job.total_steps:
            return MonitorOutcome(completed=True, progress=prog)
        now = time.monotonic()
        if awaits_cause(actionable, held_since, now):
            held, held_since = actionable, held_since if held_since is not None else now
            interrupt.check()
            time.sleep(poll_s)
            continue
        if actionable:
            return MonitorOutcome(completed=False, events=actionable, progress=watch.progress())
        # Online calibration: measured against estimated iteration time, once per plan version.
        check = None if calibrated else check_calibration(prog.recent_iteration_s, job.estimate_s,
                                                            len(prog.iteration_times), after=calibrate_after,
                                                            tolerance=tolerance)
        if check is not None:
            out = watch.calibration(prog, check)
            if out is not None:
                return out
            calibrated = True
        done = watch.agents_done(provider)
        if done is not None:
            return done
        why = stop_reason(now=time.time(), last_progress_at=watch.last_progress_at, stall_timeout_s=stall_timeout_s,
                          deadline_at=deadline_at, step=prog.step, total_steps=job.total_steps, plan_shape=shape,
                          logs=job.state.logs("public"))
        if why is not None:
            raise RuntimeError(why)
        interrupt.check()  # the user's stop, if an exception for it was swallowed on the way
        time.sleep(poll_s)


def ride_out(prefect: PrefectWatch, watch: _Watch, poll_s: float) -> None:
    """While the Prefect server does not answer: the job trains on (its records keep arriving at the
    controller, the provider sees its heartbeats through tasks/pump.py), and nothing here calls Prefect;
    returns once the server answers again, or hands the run to `prefect.on_lost` once it is lost."""
    log = get_run_logger()
    log.warning("the Prefect server (%s) stopped answering; training goes on, and stops with its checkpoint if "
                "the server is not back within %.0f s", prefect.health_url.removesuffix("/health"), prefect.outage_s)
    while prefect.state() == "down":
        watch.progress()  # heartbeats and steps, for the log and the stall check (no Prefect call while down)
        interrupt.check()
        time.sleep(poll_s)
    if prefect.state() == "lost" and prefect.on_lost is not None:
        prefect.on_lost(prefect.why())
    log.info("the Prefect server answers again after an outage; the run goes on")


def utcnow() -> datetime:
    return datetime.now(UTC)
