"""Local launcher and controller: start a plan's workers on this machine and keep the job alive.

Contract:
- `run_local(plan, cfg, settings, slots=...)` rejects a plan the runtime cannot run before any
  process starts (topology.check_runnable), hosts a control server (runtime/protocol.py, loopback, a
  fresh secret), starts one worker process per rank
  (`python -m sailor_core.runtime.worker_proc`, OMP_NUM_THREADS=1 each), and hands out generation
  0. It returns a `RunResult` when every worker reports done, or raises SailorError with the
  failing worker's reason and log tail.
- When a worker dies and `settings.checkpoint_uri` is set, the controller derives a smaller plan
  with `replan` (default `shrink_plan`: drop the pipelines that lost a worker, or re-split the
  layers over the survivors when none is left whole) and starts the next generation on the
  surviving processes, which resume from the newest valid checkpoint; only the steps since that
  checkpoint are repeated. Without a checkpoint directory a lost worker fails the job.
- A lost worker never hangs the job: survivors' collectives fail (peer gone) or time out
  (`settings.timeout_s`), and the controller fails the job if a generation makes no progress.
- SIGTERM/SIGINT to the launcher are forwarded to the workers (they checkpoint and stop); every
  worker is reaped in a `finally`. `on_event(dict)` receives started / reconfigured / finished.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from sailor_core.catalog import is_cpu_type
from sailor_core.domain import ParallelPlan, PipelineBatch, Stage, split_batch
from sailor_core.errors import TrainingFailed, ValidationError
from sailor_core.models.config import TransformerConfig
from sailor_core.plan_format import plan_to_dict
from sailor_core.runtime import checkpoint as ckpt
from sailor_core.runtime import protocol
from sailor_core.runtime.engine import TrainSettings
from sailor_core.runtime.protocol import SECRET_ENV, ControlServer
from sailor_core.runtime.topology import check_runnable, layout

ABORT_GRACE_S = 15.0  # how long survivors get to report after a generation is aborted
DEFAULT_LOCAL_SLOTS = 16  # processes this machine will host for one job, whatever its core count


@dataclass
class RunResult:
    status: str
    generations: int
    plans: list[ParallelPlan]
    events: list[dict[str, Any]] = field(default_factory=list)
    interrupted_by: int | None = None  # the signal that stopped the run (it checkpointed first)


def check_settings(settings: TrainSettings) -> None:
    """Settings no worker could train with, refused before any process starts."""
    bad = []
    if not settings.lr > 0:
        bad.append(f"--lr must be a positive learning rate, got {settings.lr}")
    if not settings.timeout_s > 0:
        bad.append(f"--timeout must be a positive number of seconds, got {settings.timeout_s}")
    if settings.steps < 1:
        bad.append(f"--steps must be at least 1, got {settings.steps}")
    if bad:
        raise ValidationError("; ".join(bad) + "; to fix: pass valid values")


def shrink_plan(plan: ParallelPlan, lost_ranks: set[int], survivors: int) -> ParallelPlan:
    """A plan for the survivors with the same global batch (see module contract)."""
    lay = layout(plan)
    lost_pipes = {lay[r].pipeline for r in lost_ranks}
    keep = [j for j in range(plan.data_parallel) if j not in lost_pipes]
    if keep:
        stages = tuple(replace(st, replicas=tuple(st.replicas[j] for j in keep)) for st in plan.stages)
        try:
            pipes = split_batch(plan.global_batch_size, [plan.pipelines[j].microbatch_size for j in keep])
            return replace(plan, stages=stages, pipelines=pipes)
        except ValidationError:
            pass
    rep = plan.stages[0].replicas[0]
    num_layers = plan.stages[-1].last_layer + 1
    n = max(1, min(survivors, num_layers))
    bounds = [round(i * num_layers / n) for i in range(n + 1)]
    one = replace(rep, tp=1)
    stages = tuple(Stage(first_layer=bounds[i], last_layer=bounds[i + 1] - 1, replicas=(one,)) for i in range(n))
    mbs = plan.pipelines[0].microbatch_size
    if plan.global_batch_size % mbs:
        mbs = 1
    return replace(plan, stages=stages,
                   pipelines=(PipelineBatch(microbatch_size=mbs, num_microbatches=plan.global_batch_size // mbs),))


class _Worker:
    def __init__(self, wid: int, proc: subprocess.Popen[bytes], log_path: str):
        self.wid, self.proc, self.log_path = wid, proc, log_path

    def tail(self, n: int = 6) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [ln.rstrip() for ln in f if ln.strip()]
        except OSError:
            return ""
        return " | ".join(lines[-n:])


def run_local(plan: ParallelPlan, cfg: TransformerConfig, settings: TrainSettings, *,
              slots: int | None = None, replan: Callable[[ParallelPlan, set[int], int], ParallelPlan] = shrink_plan,
              on_event: Callable[[dict[str, Any]], None] | None = None, run_dir: str | None = None,
              max_generations: int = 4, python: str = sys.executable) -> RunResult:
    """Runs `plan` in local worker processes, generation after generation, until done (see the module)."""


    cuda = torch.cuda.device_count()
    uses_gpus = any(not is_cpu_type(r.gpu_type) for st in plan.stages for r in st.replicas)
    # one process per GPU when the plan names GPUs; CPU "slots" otherwise
    slots = slots or (cuda if uses_gpus and cuda else int(os.environ.get("SAILOR_LOCAL_SLOTS", DEFAULT_LOCAL_SLOTS)))
    check_runnable(plan, cfg, slots=slots, cuda_devices=cuda)
    check_settings(settings)
    run_dir = run_dir or tempfile.mkdtemp(prefix="sailor-run-")
    os.makedirs(run_dir, exist_ok=True)
    events: list[dict[str, Any]] = []

    def emit(ev: dict[str, Any]) -> None:
        ev = {"time": time.time(), **ev}
        events.append(ev)
        if on_event:
            on_event(ev)

    store = ControlServer(host="127.0.0.1")
    workers: dict[int, _Worker] = {}
    signals = _SignalForwarder(workers)
    signals.install()
    try:
        _start_workers(plan.num_gpus, run_dir, _worker_env(store), python, workers)
        emit({"event": "started", "plan_version": 0, "pids": {w: x.proc.pid for w, x in workers.items()},
              "world_size": plan.num_gpus})
        plans = [plan]
        gen, current, resume = 0, plan, settings.resume
        while True:
            members = _assign(store, gen, current, settings, sorted(workers), resume, version=gen)
            outcome, lost, reason = _watch(store, gen, members, workers, settings, signals.stopping)
            if signals.stopping.is_set() and outcome not in ("done", "stopped"):
                # Stopped by the user: a worker the forwarded SIGTERM ended before it could checkpoint
                # (still starting, or between generations) is not a lost VM and the run did not fail.
                _release(store, gen + 1, workers, members)
                emit({"event": "finished", "status": "stopped", "plan_version": gen, "detail": reason})
                return RunResult("stopped", gen + 1, plans, events, signals.stopped_by[0])
            if outcome in ("done", "stopped"):
                _release(store, gen + 1, workers, members)
                emit({"event": "finished", "status": outcome, "plan_version": gen})
                return RunResult(outcome, gen + 1, plans, events, signals.stopped_by[0] if signals.stopped_by else None)
            if not lost or settings.checkpoint_uri is None or gen + 1 >= max_generations or signals.stopping.is_set():
                hint = "" if settings.checkpoint_uri else " (without --checkpoint-dir the job cannot resume)"
                raise TrainingFailed(f"training failed in plan version {gen}: {reason}{hint}")
            lost_ranks = {members.index(w) for w in lost}
            for w in lost:
                workers.pop(w, None)
            survivors = len(workers)
            current = replan(current, lost_ranks, survivors)
            check_runnable(current, cfg, slots=survivors, cuda_devices=cuda)
            gen += 1
            plans.append(current)
            resume = True
            # a checkpoint the lost worker left half-written must not be written over by the next plan
            _quarantine_invalid(settings.checkpoint_uri, cfg.num_layers, emit)
            emit({"event": "reconfigured", "plan_version": gen, "lost_workers": sorted(lost),
                  "world_size": current.num_gpus, "plan": plan_to_dict(current)})
    finally:
        _reap(workers)
        store.close()
        signals.restore()


def _worker_env(store: protocol.ControlServer) -> dict[str, str]:
    """The workers' environment: this one plus the control endpoint, the run's secret, one thread each."""

    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("SAILOR_WORKER_THREADS", "1"),
                SAILOR_CONTROL=store.endpoint, PYTHONUNBUFFERED="1", SAILOR_ADVERTISE_ADDR="127.0.0.1",
                **{SECRET_ENV: store.secret})


def _start_workers(n: int, run_dir: str, env: dict[str, str], python: str, workers: dict[int, _Worker]) -> None:
    """Starts worker processes 0..n-1 (each in its own session, logging to run_dir/worker-<id>.log) into `workers`."""
    for wid in range(n):
        log_path = os.path.join(run_dir, f"worker-{wid}.log")
        logf = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        proc = subprocess.Popen([python, "-m", "sailor_core.runtime.worker_proc", "--worker-id", str(wid)],
                                env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        logf.close()
        workers[wid] = _Worker(wid, proc, log_path)


class _SignalForwarder:
    """SIGTERM/SIGINT to the launcher, passed on as SIGTERM to every live worker (they checkpoint and stop)."""

    def __init__(self, workers: dict[int, _Worker]) -> None:
        self.workers = workers
        self.stopping = threading.Event()
        self.stopped_by: list[int] = []
        self._prev: dict[int, Any] = {}

    def forward(self, signum: int, _frame: Any) -> None:
        """The handler: notes the signal and forwards it."""
        self.stopping.set()
        self.stopped_by.append(signum)
        for w in self.workers.values():
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)

    def install(self) -> None:
        """Installs the handler on the main thread (elsewhere Python allows none; signals stay as they are)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._prev[sig] = signal.signal(sig, self.forward)

    def restore(self) -> None:
        """Puts back the handlers `install` replaced."""
        for signum, h in self._prev.items():
            signal.signal(signum, h)


def _quarantine_invalid(checkpoint_uri: str, num_layers: int, emit: Callable[[dict[str, Any]], None]) -> None:

    _, skipped = ckpt.resume_point(ckpt.open_storage(checkpoint_uri), num_layers)
    for s in skipped:
        emit({"event": "checkpoint_skipped", "step": s.step, "reason": s.reason, "moved_to": s.moved_to})


def _assign(store: Any, gen: int, plan: ParallelPlan, settings: TrainSettings, worker_ids: list[int],
            resume: bool, version: int) -> list[int]:
    """Give ranks 0..n-1 to the first n workers, and 'exit' to any left over. Returns members by rank."""
    n = plan.num_gpus
    members = worker_ids[:n]
    s = replace(settings, plan_version=version).to_dict()
    for rank, wid in enumerate(members):
        store.set(protocol.assign_key(gen, str(wid)), protocol.Assignment(
            rank=rank, world_size=n, plan=plan_to_dict(plan), settings=s, resume=resume,
            local_rank=rank).to_json())  # one machine: rank r drives GPU r
    for wid in worker_ids[n:]:
        store.set(protocol.assign_key(gen, str(wid)), protocol.Assignment(rank=protocol.EXIT).to_json())
    return members


def _release(store: Any, gen: int, workers: dict[int, _Worker], members: list[int]) -> None:
    for wid in workers:
        if wid not in members:
            continue
        with contextlib.suppress(Exception):  # a store gone with rank 0: its workers end on losing it instead
            store.set(protocol.assign_key(gen, str(wid)), protocol.Assignment(rank=protocol.EXIT).to_json())


def _watch(store: Any, gen: int, members: list[int], workers: dict[int, _Worker], settings: TrainSettings,
           stopping: threading.Event) -> tuple[str, list[int], str]:
    """Wait until every member reports, or one dies. Returns (outcome, lost worker ids, reason)."""
    statuses: dict[int, str] = {}
    lost: list[int] = []
    failed_at: float | None = None
    while True:
        for wid in members:
            if wid in statuses:
                continue
            key = protocol.status_key(gen, str(wid))
            if (status := store.get(key)) is not None:
                statuses[wid] = status
                if status.startswith("failed") and failed_at is None:
                    # a rank failed on its own (it also aborts its peers itself): the others get the
                    # same grace to report as after a lost worker, then count as stuck
                    failed_at = time.monotonic()
                    store.set(protocol.abort_key(gen), f"worker {wid} {status}")
            elif workers[wid].proc.poll() is not None and wid not in lost:
                if (status := store.get(key)) is not None:  # it reported just before exiting
                    statuses[wid] = status
                    continue
                lost.append(wid)
                failed_at = failed_at or time.monotonic()
                store.set(protocol.abort_key(gen), str(wid))  # wake survivors blocked on the lost peer
        if len(statuses) + len(lost) == len(members):
            break
        if failed_at is not None and time.monotonic() - failed_at > ABORT_GRACE_S:
            # survivors wake within milliseconds of the abort key; one that did not is stuck: count
            # it as lost too, so the next plan does not wait for it
            for wid in members:
                if wid not in statuses and wid not in lost:
                    lost.append(wid)
                    with contextlib.suppress(ProcessLookupError):
                        workers[wid].proc.kill()
            break
        time.sleep(0.02)
    if not lost and all(s in ("done", "stopped") for s in statuses.values()):
        return ("stopped" if "stopped" in statuses.values() else "done"), [], ""
    reasons = [f"worker {w} exited with code {workers[w].proc.returncode}: {workers[w].tail()}" for w in lost]
    reasons += [f"worker {w}: {s}" for w, s in statuses.items() if s not in ("done", "stopped")]
    # a worker that failed without its peer dying is a bug or a bad setting, not a lost VM
    return "failed", lost, "; ".join(reasons) or "unknown failure"


def _reap(workers: dict[int, _Worker]) -> None:
    for w in workers.values():
        if w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for w in workers.values():
        try:
            w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
            w.proc.wait()
