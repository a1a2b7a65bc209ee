"""A run is owned by its process: a lease in the run history that the flow renews.

History level (fake clock): an expired lease shows the run as `crashed`; renewals keep it
`running`; `live_run` finds the live run of a name. Flow level: a scheduled-style run (resume)
while another run of the same name trains starts no second job, and the live run records the
re-plan request and its decision; a flow killed with SIGKILL is shown `crashed` once its lease
expires, and the next run writes that down and removes the VMs it left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tasks.history import LeaseKeeper, RunHistory
from tests.flow_fixtures import steps_trained
from tests.waits import wait_for

pytest_plugins = ["tests.flow_fixtures"]
REPO = Path(__file__).resolve().parent.parent


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def test_an_expired_lease_shows_the_run_crashed(tmp_path):
    from profiles_store.store import open_store

    clock = Clock()
    h = RunHistory(open_store(str(tmp_path / "store")), clock=clock)
    h.run_status("a-1", "running", "started", {"name": "a"})
    h.renew_lease("a-1", 60)
    h.run_status("b-1", "running", "started", {"name": "b"})  # an old run without a lease stays as written
    clock.now += timedelta(seconds=30)
    assert [r["status"] for r in h.list_runs()] == ["running", "running"]
    assert h.live_run("a")["run_id"] == "a-1"
    h.renew_lease("a-1", 60)
    clock.now += timedelta(seconds=59)
    assert h.list_runs()[0]["status"] == "running"
    clock.now += timedelta(seconds=2)
    a = h.list_runs()[0]
    assert a["status"] == "crashed" and a["crash_detected"] and "lease" in a["status_reason"]
    assert h.show("a-1")["status"] == "crashed" and "lease" in h.show("a-1")["status_reason"]
    assert h.live_run("a") is None
    h.mark_crashed("a-1", a["status_reason"])
    assert "crash_detected" not in h.list_runs()[0] and h.list_runs()[0]["status"] == "crashed"
    assert h.list_runs()[0]["name"] == "a"  # renewals do not overwrite what the run is


def test_a_lease_whose_owner_process_is_gone_shows_crashed_at_once(tmp_path):
    """A SIGKILLed flow on this host: no need to wait out its lease (it showed `running` for a minute)."""
    from profiles_store.store import open_store

    clock = Clock()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    from tasks.history import _start_ticks, this_process

    owner = {**this_process(), "pid": child.pid, "start": _start_ticks(child.pid)}
    h = RunHistory(open_store(str(tmp_path / "store")), clock=clock, owner=lambda: owner)
    h.run_status("a-1", "running", "started", {"name": "a"})
    h.renew_lease("a-1", 60)
    assert h.list_runs()[0]["status"] == "running"
    child.kill()
    child.wait()
    a = h.list_runs()[0]  # the lease has 60 s left on the fake clock
    assert a["status"] == "crashed" and a["crash_detected"] and f"pid {child.pid}" in a["status_reason"], a
    assert h.live_run("a") is None
    # another host's run: only its lease can tell
    far = RunHistory(open_store(str(tmp_path / "store2")), clock=clock, owner=lambda: {**owner, "host": "elsewhere"})
    far.run_status("b-1", "running", "started", {"name": "b"})
    far.renew_lease("b-1", 60)
    assert far.list_runs()[0]["status"] == "running"


class _CountedPolls(RunHistory):
    """A run history that counts how often the keeper looked for re-plan requests."""

    polls = 0

    def replan_requests(self, run_id):  # noqa: ANN001, ANN201
        got = super().replan_requests(run_id)
        self.polls += 1
        return got


def test_the_keeper_passes_on_a_replan_request_once(tmp_path):
    from profiles_store.store import open_store

    h = _CountedPolls(open_store(str(tmp_path / "store")))
    h.run_status("a-1", "running", "started", {"name": "a"})
    k = LeaseKeeper(h, "a-1", ttl_s=3).start()
    try:
        assert k.take_request() is None
        h.request_replan("a-1", "a-2", "prices moved")
        req = wait_for(k.take_request, 10, "the keeper to pass on the request")
        assert req["requested_by"] == "a-2" and req["reason"] == "prices moved"
        seen = h.polls
        wait_for(lambda: h.polls >= seen + 2, 10, "the keeper to look for requests twice more")
        assert k.take_request() is None
    finally:
        k.stop()
    assert k.errors == 0


def _start_flow(store: str, work: Path, name: str, steps: int, lease_s: float) -> subprocess.Popen[bytes]:
    from prefect.settings import PREFECT_API_URL

    code = ("from flows.sailor import sailor; "
            f"sailor(run_name={name!r}, steps={steps}, workers=2, max_gpus=2, objective='max-throughput', "
            f"checkpoint_interval=10, store_uri={store!r}, workdir={str(work)!r}, isolation='process')")
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "OMP_NUM_THREADS": "1",
           "SAILOR_LEASE_S": str(lease_s)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _wait_training(h: RunHistory, work: Path, name: str, proc: subprocess.Popen[bytes]) -> str:
    end = time.monotonic() + 240
    while time.monotonic() < end and proc.poll() is None:
        runs = [x for x in h.list_runs() if x["name"] == name]
        if runs:
            run_id = runs[-1]["run_id"]
            if steps_trained(work, run_id):
                return str(run_id)
        time.sleep(0.5)
    raise AssertionError(f"the run {name} never trained (exit {proc.poll()})")


def _vms_of(work: Path, run_id: str) -> list[dict]:
    return [json.loads(f.read_text()) for f in (work / "runs" / run_id / "local" / "vms").glob("*.json")]


@pytest.mark.usefixtures("prefect_harness")
def test_a_scheduled_rerun_while_the_run_trains_asks_it_to_replan_and_rents_nothing(profiled_store, tmp_path):
    from flows.sailor import sailor
    from profiles_store.store import open_store

    work = tmp_path / "work"
    h = RunHistory(open_store(profiled_store))
    live = _start_flow(profiled_store, work, "nightly", 5000, 30)
    try:
        live_id = _wait_training(h, work, "nightly", live)
        state = sailor(run_name="nightly", steps=40, workers=2, max_gpus=2, objective="max-throughput",
                       store_uri=profiled_store, workdir=str(work), isolation="process", resume=True,
                       resume_or_start=True, return_state=True)
        assert state.is_completed(), state.message
        summary = state.result()
        assert summary["deferred_to"] == live_id
        sched_id = summary["run_id"]
        mine = h.show(sched_id)
        kinds = [e["kind"] for e in mine["events"]]
        assert "deferred" in kinds and "provisioned" not in kinds and "training_started" not in kinds
        assert _vms_of(work, sched_id) == []  # no second job
        # the live run records the request, then re-plans and records its decision
        end = time.monotonic() + 120
        decided: list[dict] = []
        while time.monotonic() < end and not decided:
            run = h.show(live_id)
            req = [e for e in run["events"] if e["kind"] == "replan_request"]
            decided = [d for d in run["decisions"] if req and d["time"] > req[0]["time"]]
            time.sleep(1)
        assert req and req[0]["requested_by"] == sched_id
        assert decided, f"the live run recorded no decision after the request: {run['decisions']}"
        assert live.poll() is None  # the live run goes on
    finally:
        if live.poll() is None:
            live.send_signal(signal.SIGTERM)
            try:
                live.wait(timeout=120)
            except subprocess.TimeoutExpired:
                live.kill()
    print(f"scheduled run {sched_id}: deferred to {live_id}; live run decision: {decided[0]['kind']}: "
          f"{decided[0]['reason'][:160]}")


def _wait_until_crashed(h: RunHistory, run_id: str, timeout_s: float = 120) -> None:
    """Until the killed flow's lease (6 s) has expired: the history then shows its run `crashed`."""
    end = time.monotonic() + timeout_s
    while next(x for x in h.list_runs() if x["run_id"] == run_id)["status"] != "crashed":
        assert time.monotonic() < end, f"run {run_id} not shown crashed {timeout_s} s after its flow was killed"
        time.sleep(0.5)


@pytest.mark.usefixtures("prefect_harness")
def test_a_killed_flow_is_crashed_and_the_next_run_cleans_up_after_it(profiled_store, tmp_path):
    from flows.sailor import sailor
    from infra.local import _group_alive
    from profiles_store.store import open_store

    work = tmp_path / "work"
    h = RunHistory(open_store(profiled_store))
    proc = _start_flow(profiled_store, work, "killed", 5000, 6)
    try:
        run_id = _wait_training(h, work, "killed", proc)
        os.killpg(proc.pid, signal.SIGKILL)  # the flow process only: its workers run in groups of their own
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    _wait_until_crashed(h, run_id)
    r = next(x for x in h.list_runs() if x["run_id"] == run_id)
    assert r["status"] == "crashed", r
    state = sailor(
        run_name="next",
        dry_run=True,
        steps=10,
        objective="max-throughput",
        workers=2,
        store_uri=profiled_store,
        workdir=str(work),
        isolation="process",
        return_state=True,
    )
    assert state.is_completed(), state.message
    r = h.show(run_id)
    assert r["status"] == "crashed" and "crash_detected" not in r
    assert any(e["kind"] == "teardown" and "crashed" in e["reason"] for e in r["events"])
    end = time.monotonic() + 30
    while time.monotonic() < end and any(v.get("pid") and _group_alive(int(v["pid"])) for v in _vms_of(work, run_id)):
        time.sleep(0.5)
    assert not [v["vm_id"] for v in _vms_of(work, run_id) if v.get("pid") and _group_alive(int(v["pid"]))]


@pytest.mark.usefixtures("prefect_harness")
def test_infra_cleanup_removes_what_a_crashed_run_left(profiled_store, tmp_path):
    from infra.local import _group_alive
    from profiles_store.store import open_store

    work = tmp_path / "work"
    h = RunHistory(open_store(profiled_store))
    proc = _start_flow(profiled_store, work, "orphan", 5000, 6)
    try:
        run_id = _wait_training(h, work, "orphan", proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    _wait_until_crashed(h, run_id)
    out = subprocess.run([sys.executable, "-m", "sailor_cli.main", "infra", "cleanup", "--provider", "local",
                          "--workdir", str(work), "--store", profiled_store], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-1500:]
    assert f"run {run_id} crashed" in out.stdout
    r = h.show(run_id)
    assert r["status"] == "crashed" and "crash_detected" not in r
    end = time.monotonic() + 30
    while time.monotonic() < end and any(v.get("pid") and _group_alive(int(v["pid"])) for v in _vms_of(work, run_id)):
        time.sleep(0.5)
    assert not [v["vm_id"] for v in _vms_of(work, run_id) if v.get("pid") and _group_alive(int(v["pid"]))]
