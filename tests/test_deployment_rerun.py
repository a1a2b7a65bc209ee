"""The scheduled cost-aware rerun, as a user runs it: a real `prefect server start`, a process work pool and
worker, `prefect deploy` of this repository's prefect.yaml, and `prefect deployment run sailor/train`.

What the schedule promises (prefect.yaml, docs/orchestration.md): a rerun (the schedule's parameters,
`resume` and `resume_or_start`) while the job trains hands the live run one re-plan request and ends
within seconds; a rerun after the job completed its steps rents nothing and says so; a rerun after a
cancelled job resumes it from its checkpoint. Before, the deployment's concurrency limit queued the
rerun behind the live job (`AwaitingConcurrencySlot`), and once the job had ended the rerun rented 4 VMs
to train "step 600/120".
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest_plugins = ["tests.flow_fixtures"]

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Deployment:
    """A Prefect server, a process worker and the deployments of prefect.yaml, all in `tmp`."""

    def __init__(self, tmp: Path) -> None:
        port = _free_port()
        self.api = f"http://127.0.0.1:{port}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_API_URL": self.api,
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "2",
                    "PREFECT_UI_API_URL": self.api, "PREFECT_SERVER_API_PORT": str(port), "OMP_NUM_THREADS": "1",
                    "SAILOR_LEASE_S": "20"}
        self.logs = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self._spawn("server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                    {**self.env, "PREFECT_API_URL": ""})
        self._healthy()
        self.prefect("work-pool", "create", "sailor-local", "--type", "process")
        self._spawn("worker", [str(BIN / "prefect"), "worker", "start", "--pool", "sailor-local"], self.env)
        self.prefect("--no-prompt", "deploy", "--all")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - the child's for its lifetime
        self.procs.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        log.close()

    def _healthy(self, timeout_s: float = 180) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            assert self.procs[0].poll() is None, (self.logs / "server.log").read_text()[-2000:]
            try:
                urllib.request.urlopen(f"{self.api}/health", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise AssertionError("the Prefect server did not become healthy")

    def prefect(self, *args: str) -> str:
        r = subprocess.run([str(BIN / "prefect"), *args], env={**self.env, "PATH": f"{BIN}:{os.environ['PATH']}"},
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"prefect {' '.join(args)}: {r.stdout[-1500:]} {r.stderr[-1500:]}"
        return r.stdout

    def run(self, **params: object) -> str:
        """`prefect deployment run sailor/train --param k=v ...`; returns the flow run's id."""
        args = ["deployment", "run", "sailor/train"]
        for k, v in params.items():
            args += ["--param", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
        out = self.prefect(*args)
        return next(line.split()[-1] for line in out.splitlines() if "UUID" in line)

    def flow_run(self, flow_run_id: str) -> dict:
        with urllib.request.urlopen(f"{self.api}/flow_runs/{flow_run_id}", timeout=10) as r:
            return dict(json.loads(r.read()))

    def state(self, flow_run_id: str) -> str:
        return str(self.flow_run(flow_run_id)["state"]["type"])

    def seconds(self, flow_run_id: str) -> float:
        """From the flow run's creation (what the schedule does) to its end, by the server's clock."""
        from datetime import datetime

        fr = self.flow_run(flow_run_id)
        return (datetime.fromisoformat(fr["end_time"]) - datetime.fromisoformat(fr["created"])).total_seconds()

    def wait_state(self, flow_run_id: str, states: set[str], timeout_s: float) -> str:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                if (s := self.state(flow_run_id)) in states:
                    return s
            except (TimeoutError, urllib.error.URLError) as e:  # a busy server's answer took over 10 s (load 25
                if not isinstance(getattr(e, "reason", e), TimeoutError):  # on 2 cores): ask again; not a dead one
                    raise
            time.sleep(0.5)
        log = (self.logs / "worker.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"flow run {flow_run_id} not in {states} within {timeout_s:.0f}s (it is "
                             f"{self.state(flow_run_id)}); worker log: {log}")

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _history(store: str):
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    return RunHistory(open_store(store))


def _run_of(store: str, flow_run_id: str) -> dict:
    from flows.sailor import run_id_for

    return _history(store).show(run_id_for("train", flow_run_id))


def _wait_training(store: str, flow_run_id: str, timeout_s: float = 300) -> str:
    """The job's run id once its history says it started training. (Its step records under the run's folder
    were no live signal: the agents copy them there every 30 s, and the wait trained half a minute on.)"""
    from flows.sailor import run_id_for

    run_id = run_id_for("train", flow_run_id)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if _history(store).store.read_history("events", run_id=run_id, kind="training_started"):
            return run_id
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} never started training")


def _vms(work: Path, run_id: str) -> list[Path]:
    return list((work / "runs" / run_id / "local" / "vms").glob("*.json"))


@pytest.mark.timeout(1500)  # three jobs on a real server, each wait bounded below; 600 s ran out at load 10-40
@pytest.mark.usefixtures("prefect_harness")
def test_the_scheduled_rerun_replans_a_live_job_rents_nothing_after_it_and_resumes_a_cancelled_one(
        profiled_store, tmp_path):
    work = tmp_path / "work"
    quiet = tmp_path / "quiet.yaml"
    quiet.write_text("offerings:\n  - {market: on-demand, count: 2, usd_per_gpu_hour: 0.30}\n")
    scripted = tmp_path / "scripted.yaml"  # the job's: a preemption and a price change, as the demo's
    scripted.write_text("offerings:\n  - {market: spot, count: 2, usd_per_gpu_hour: 0.10}\n"
                        "  - {market: on-demand, count: 2, usd_per_gpu_hour: 0.30}\nevents:\n"
                        "  - {at_step: 20, kind: preemption, market: spot, grace_s: 2}\n"
                        "  - {at_step: 80, kind: price_change, market: on-demand, usd_per_gpu_hour: 0.60}\n")
    common = {"store_uri": profiled_store, "workdir": str(work), "isolation": "process", "workers": 2,
              "scenario": str(quiet), "checkpoint_interval": 10}
    rerun = {**common, "resume": True, "resume_or_start": True}  # the schedule's parameters (prefect.yaml)
    dep = Deployment(tmp_path)
    jobs: list[str] = []  # flow runs of the jobs, cancelled if the test ends before they do
    try:
        # 1. A rerun while the job trains: one re-plan request on the live run, and it ends within 30 s. The live
        # job is a long one: a 300-step job on a quiet machine ended before the rerun's flow process had started,
        # and the rerun then rightly found nothing left to train.
        long_fr = dep.run(**common, steps=5000)
        jobs.append(long_fr)
        long_id = _wait_training(profiled_store, long_fr)
        again = dep.run(**rerun)
        assert dep.wait_state(again, TERMINAL, 90) == "COMPLETED"
        took = dep.seconds(again)  # the worker's pickup and the flow process's start included
        # 30 s on a machine with a core free; most of it is starting Prefect's flow process (the flow's own
        # deferral took 1.3 s), which takes longer the busier the machine: the bound grows with the load
        bound = 30.0 * max(1.0, os.getloadavg()[1] / (os.cpu_count() or 1) / 2)
        print(f"the rerun of a live job ended {took:.1f}s after it was created (bound {bound:.0f}s, load average "
              f"{os.getloadavg()[1]:.1f} on {os.cpu_count()} cores)")
        assert took < bound, f"the rerun took {took:.1f}s"
        mine = _run_of(profiled_store, again)
        kinds = [e["kind"] for e in mine["events"]]
        assert kinds.count("deferred") == 1 and _vms(work, mine["run_id"]) == [], (mine["run_id"], mine["events"])
        requests = [e for e in _history(profiled_store).show(long_id)["events"] if e["kind"] == "replan_request"]
        assert [e["requested_by"] for e in requests] == [mine["run_id"]]
        # 2. A cancelled job: the rerun resumes it from its checkpoint.
        ckpts = work / "runs" / long_id / "state" / "checkpoints"
        end = time.monotonic() + 300
        while not list(ckpts.glob("step_*/meta.json")):
            assert time.monotonic() < end, "the long job never checkpointed"
            time.sleep(0.5)
        dep.prefect("flow-run", "cancel", long_fr)
        assert dep.wait_state(long_fr, TERMINAL, 300) == "CANCELLED"
        step = max(int(p.parent.name.split("_")[1]) for p in ckpts.glob("step_*/meta.json"))
        resumed = dep.run(**rerun, steps=step + 10)
        assert dep.wait_state(resumed, TERMINAL, 600) == "COMPLETED"
        r = _run_of(profiled_store, resumed)
        started = [e for e in r["events"] if e["kind"] == "training_started"]
        assert started and started[0]["resume_step"] == step and r["steps_done"] == step + 10
        # 3. A job with a preemption and a price change: every step once, each event at its step; once it
        # completed, a rerun rents nothing and says so.
        job_fr = dep.run(**{**common, "scenario": str(scripted)}, steps=120)
        jobs.append(job_fr)
        job_id = _wait_training(profiled_store, job_fr)
        assert dep.wait_state(job_fr, TERMINAL, 600) == "COMPLETED"
        from tests.flow_fixtures import assert_steps_once_and_events_at_their_step

        assert_steps_once_and_events_at_their_step(_history(profiled_store).show(job_id), total=120,
                                                   scripted={"preemption": 20, "price_change": 80})
        done = dep.run(**rerun)
        assert dep.wait_state(done, TERMINAL, 120) == "COMPLETED"
        after = _run_of(profiled_store, done)
        assert _vms(work, after["run_id"]) == [] and "provisioned" not in [e["kind"] for e in after["events"]]
        said = [e["reason"] for e in after["events"] if e["kind"] == "nothing_to_do"]
        assert said and "completed 120 steps" in said[0] and "rented nothing" in said[0], after["events"]
        from infra.local import LocalProvider

        for root in (work / "runs").glob("*/local"):  # no VM of any run is left running
            assert [v.vm_id for v in LocalProvider(root).list_vms() if v.state in ("running", "preempting")] == []
    finally:
        for fr in jobs:  # a job the test did not see to its end is cancelled, as a user would
            if dep.state(fr) not in TERMINAL:
                dep.prefect("flow-run", "cancel", fr)
                dep.wait_state(fr, TERMINAL, 300)
        dep.close()
