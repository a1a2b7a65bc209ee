"""The `sailor` flow under prefect_test_harness, on the local provider and the real runtime.

Each test trains gpt-tiny for a few dozen steps on 1-2 local worker slots (a few seconds of
training; most of the time is starting torch workers), with a scenario scripting what the test is
about, then checks the run history, the decisions and their reasons, and that no worker process
or VM outlived the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.params import InvalidParameters
from infra.local import LocalProvider, _group_alive
from tasks.history import Measurement
from tests.flow_fixtures import assert_steps_once_and_events_at_their_step, steps_trained

# The session fixtures (one test server, one profiled store) are shared by every module that loads them.
pytest_plugins = ["tests.flow_fixtures"]

pytestmark = pytest.mark.usefixtures("prefect_harness")


def scenario(tmp_path: Path, text: str) -> str:
    p = tmp_path / "scenario.yaml"
    p.write_text(text)
    return str(p)


def run(store: str, tmp_path: Path, name: str, **kw):
    from flows.sailor import sailor

    # Plain-process VMs: these tests are about decisions; tests/test_testbed_flow.py runs isolated VMs.
    args = dict(run_name=name, model="gpt-tiny", global_batch_size=8, objective="min-cost", provider="local",
                workers=2, steps=24, checkpoint_interval=4, store_uri=store, workdir=str(tmp_path / "work"),
                isolation="process")
    args.update(kw)
    return sailor(**args, return_state=True)


def history(store: str, name: str):
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    h = RunHistory(open_store(store))
    runs = [r for r in h.list_runs() if r.get("name") == name]
    assert runs, f"no run named {name} in the history"
    return h.show(runs[-1]["run_id"])


def assert_nothing_left(tmp_path: Path, run_id: str) -> None:
    root = tmp_path / "work" / "runs" / run_id / "local"
    p = LocalProvider(root)
    assert [v.vm_id for v in p.list_vms(run_id) if v.state in ("running", "preempting")] == []
    for f in (root / "vms").glob("*.json"):
        pid = json.loads(f.read_text()).get("pid")
        assert not (pid and _group_alive(int(pid))), f"worker process group {pid} outlived the run"


WATCHED = ["sailor.preemption", "sailor.price_change", "sailor.replan", "sailor.reconfigured", "sailor.run.completed"]


def prefect_events(run_id: str) -> set[str]:
    """Names of the Prefect events about the run's resource (they reach the server asynchronously)."""
    import time
    from datetime import UTC, datetime, timedelta

    from prefect.client.orchestration import get_client
    from prefect.events.filters import (
        EventAnyResourceFilter,
        EventFilter,
        EventNameFilter,
        EventOccurredFilter,
    )

    f = EventFilter(event=EventNameFilter(name=WATCHED),
                    any_resource=EventAnyResourceFilter(id=[f"sailor.run.{run_id}"]),
                    occurred=EventOccurredFilter(since=datetime.now(UTC) - timedelta(hours=1),
                                                 until=datetime.now(UTC) + timedelta(minutes=5)))
    names: set[str] = set()
    with get_client(sync_client=True) as client:
        # The event pipeline batches writes; on a loaded 2-core machine it can lag by tens of seconds.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            names = {e.event for e in client.read_events(filter=f, limit=50).events}
            if "sailor.run.completed" in names:
                break
            time.sleep(0.5)
    return names


def kinds(run) -> list[str]:
    return [e["kind"] for e in run["events"]]


def test_happy_path_trains_to_completion_and_leaves_nothing(profiled_store, tmp_path):
    state = run(profiled_store, tmp_path, "happy", steps=16)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["steps_done"] == 16 and summary["plan_versions"] >= 1
    r = history(profiled_store, "happy")
    assert r["status"] == "completed"
    assert {"provisioned", "training_started", "completed", "teardown"} <= set(kinds(r))
    assert r["plans"][0]["plan"]["format"] == "sailor-plan"
    assert any(m["kind"] == "iteration_time" for m in r["measurements"])  # measured vs estimated
    assert_nothing_left(tmp_path, r["run_id"])
    # A second run with the same name keeps the first one's history; as the scheduled rerun does, it
    # continues from the first run's checkpoint (step 16) instead of starting over.
    state2 = run(profiled_store, tmp_path, "happy", steps=20, resume=True)
    assert state2.is_completed(), state2.message
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    h = RunHistory(open_store(profiled_store))
    same = [x for x in h.list_runs() if x["name"] == "happy"]
    assert len(same) == 2 and same[0]["run_id"] != same[1]["run_id"]
    assert same[0]["steps_done"] == 16 and same[1]["steps_done"] == 20
    started = [e for e in h.show(same[1]["run_id"])["events"] if e["kind"] == "training_started"]
    assert started[0]["resume_step"] == 16
    assert len(h.show(same[0]["run_id"])["events"]) == len(r["events"])  # the first run's history is intact


def test_preemption_then_a_price_change_worth_switching(profiled_store, tmp_path):
    sc = scenario(tmp_path, """
offerings:
  - {market: spot, count: 2, usd_per_gpu_hour: 0.10}
  - {market: on-demand, count: 2, usd_per_gpu_hour: 0.30}
events:
  - {at_step: 5, kind: preemption, market: spot, grace_s: 1}
  - {at_step: 60, kind: price_change, market: spot, usd_per_gpu_hour: 40.0}
""")
    # Steps take ~0.1 s here: no calibration replan, so each scripted event lands in its own replan.
    # The old plan trains on through the preemption's grace period (and resumes from a later
    # checkpoint), so the price change comes at step 60, after the second plan has trained; after it
    # the old plan, still whole, trains on while the on-demand VM boots. With 90 steps left the switch
    # gains about 0.1 USD against 0.003 for its 5-10 s of reconfiguration: a margin no host's speed moves.
    state = run(profiled_store, tmp_path, "preempt", scenario=sc, steps=150, calibration_tolerance=9.0)
    assert state.is_completed(), state.message
    r = history(profiled_store, "preempt")
    ks = kinds(r)
    assert r["status"] == "completed"
    assert "preemption" in ks and "price_change" in ks and ks.count("reconfigured") >= 2
    switches = [d for d in r["decisions"] if d["kind"] == "switch"]
    assert any("preemption" in d["reason"] and "lost" in d["reason"] for d in switches)
    priced = [d for d in switches if "price_change" in d["reason"]]
    assert priced and "switch pays" in priced[0]["reason"] and priced[0]["detail"]["decision"]["gain"] > 0
    # Every observation went out as a Prefect event about the run, for automations and the UI.
    names = prefect_events(r["run_id"])
    assert {"sailor.preemption", "sailor.price_change", "sailor.replan", "sailor.reconfigured"} <= names, names
    # The last plan runs on on-demand: spot became dearer than the switch cost.
    last = r["plans"][-1]["plan"]
    assert {rep["market"] for st in last["stages"] for rep in st["replicas"]} == {"on-demand"}
    assert_nothing_left(tmp_path, r["run_id"])
    assert_training_curves(profiled_store, tmp_path, r["run_id"], versions=len(r["plans"]), total=150)
    assert_steps_once_and_events_at_their_step(r, total=150, scripted={"preemption": 5, "price_change": 60})


def _store_with(profiled: Path, tmp_path: Path, kind: Measurement, payload: dict) -> str:
    """A fresh copy of the profiled store with three earlier runs' `kind` measurements of `payload` (a copy: the
    seeded figures must not reach other tests, nor other tests' figures this one)."""
    import shutil

    from profiles_store.store import open_store
    from tasks.history import RunHistory

    store = str(tmp_path / "store")
    shutil.copytree(profiled, store)
    seeded = RunHistory(open_store(store))
    for k in range(3):
        seeded.measurement(f"earlier-{k}", kind, payload)
    return store


def assert_training_curves(store: str, tmp_path: Path, run_id: str, versions: int, total: int) -> None:
    """The curves artifact (loss and tokens/s, each reconfiguration marked) was updated in place while the run
    trained, its plan versions' step ranges cover 1..`total` once (a deployment run's curves had no steps
    21-50), and `sailor runs show --plot` draws the same picture from the saved records."""
    import re

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from sailor_cli.main import main
    from tasks.reporting import artifact_key

    key = artifact_key("curves", run_id)
    with get_client(sync_client=True) as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    # one artifact, updated in place while the run trained (it was a new version per update)
    assert len(arts) == 1, [(a.key, a.created) for a in arts]
    latest = arts[0]
    assert latest.updated is not None and latest.created is not None and latest.updated > latest.created
    assert "data:image/png;base64," in latest.data and "Reconfigurations (dashed lines): step" in latest.data
    assert f"| v{versions} |" in latest.data
    ranges = [(int(a), int(b)) for a, b in re.findall(r"^\| v\d+ \| (\d+)-(\d+) \|", latest.data, re.M)]
    covered = [s for a, b in ranges for s in range(a, b + 1)]
    assert sorted(covered) == list(range(1, total + 1)), ranges
    png = tmp_path / "curves.png"
    assert main(["runs", "show", run_id, "--store", store, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_small_price_change_is_not_worth_a_switch(profiled_store, tmp_path):
    sc = scenario(tmp_path, """
offerings:
  - {market: spot, count: 1, usd_per_gpu_hour: 0.10}
  - {market: on-demand, count: 1, usd_per_gpu_hour: 0.30}
events:
  - {at_step: 4, kind: price_change, market: spot, usd_per_gpu_hour: 0.31}
  - {at_step: 10, kind: capacity_change, market: on-demand, count: 3}
""")
    state = run(profiled_store, tmp_path, "smallprice", scenario=sc, steps=40, calibration_tolerance=9.0)
    assert state.is_completed(), state.message
    r = history(profiled_store, "smallprice")
    priced = [d for d in r["decisions"] if "price_change" in d["reason"]]
    assert priced and priced[0]["kind"] == "stay" and "not worth the switch" in priced[0]["reason"]
    assert priced[0]["detail"]["decision"]["gain"] < 0
    assert "reconfigured" not in kinds(r) and len(r["plans"]) == 1
    # More on-demand capacity does not make a cheaper plan either: replanned, stayed.
    cap = [d for d in r["decisions"] if "capacity_change" in d["reason"]]
    assert "capacity_change" in kinds(r) and cap and cap[0]["kind"] == "stay"
    assert_nothing_left(tmp_path, r["run_id"])


def test_capacity_that_returns_grows_the_plan_without_restarting_the_worker_that_stays(profiled_once, tmp_path):
    sc = scenario(tmp_path, """
offerings:
  - {market: spot, count: 1, usd_per_gpu_hour: 0.10}
events:
  - {at_step: 4, kind: capacity_change, market: spot, count: 3}
""")
    # The first plan gets the one spot VM there is; when two more come back, a plan three times as wide saves
    # about 0.11 s a step over the 236 steps left (about 26 s) against a switch the store says takes 4 s
    # (three earlier runs' switches in place, seeded in a fresh copy of the profile: what other tests measured
    # must not move the margin). Without them the flow assumes 15 s, and a run long enough to pay that on
    # every host's speed trained 800 steps.
    store = _store_with(profiled_once, tmp_path, Measurement.RECONFIGURATION,
                        {"provider": "local", "reconfiguration_s": 4.0, "new_vms": 0})
    state = run(store, tmp_path, "grow", scenario=sc, steps=240, objective="max-throughput", workers=3,
                calibration_tolerance=9.0)
    assert state.is_completed(), state.message
    r = history(store, "grow")
    grown = [d for d in r["decisions"] if "capacity_change" in d["reason"] and d["kind"] == "switch"]
    assert grown, r["decisions"]
    first, last = r["plans"][0]["plan"], r["plans"][-1]["plan"]
    width = [sum(len(st["replicas"]) for st in p["stages"]) for p in (first, last)]
    assert width[1] > width[0] == 1, width
    rec = [e for e in r["events"] if e["kind"] == "reconfigured"]
    assert rec and rec[-1]["kept_processes"] == 1, rec  # the first VM's worker went on in place
    assert rec[-1]["loaded_from"].get("memory", 0) + rec[-1]["loaded_from"].get("checkpoint", 0) == width[1]
    assert_nothing_left(tmp_path, r["run_id"])


@pytest.mark.parametrize("vm_start_s,moves", [(0.0, True), (1e6, False)])
def test_after_a_preemption_new_vms_are_rented_only_when_they_win_back_their_start(profiled_once, tmp_path,
                                                                                 vm_start_s, moves):
    """One of two VMs is preempted with 115 steps left. The plan on the VM still held is about half as fast
    as one with a new VM beside it. The store says how long this provider's VMs take to start: a move pays
    when they start at once, and not when they take days (the run's own cold start, added to three such
    measurements, does not move their median). The store is a fresh copy of the profile: other runs' VM starts
    (earlier tests in this process) must not weigh in."""
    store = _store_with(profiled_once, tmp_path, Measurement.VM_START, {"provider": "local", "vm_start_s": vm_start_s})
    sc = scenario(tmp_path, """
offerings:
  - {market: spot, count: 2, usd_per_gpu_hour: 0.10}
  - {market: on-demand, count: 2, usd_per_gpu_hour: 0.30}
events:
  - {at_step: 5, kind: preemption, market: spot, grace_s: 1}
""")
    state = run(store, tmp_path, "weigh", scenario=sc, steps=120, objective="max-throughput",
                calibration_tolerance=9.0)
    assert state.is_completed(), state.message
    r = history(store, "weigh")
    after = [d for d in r["decisions"] if "preemption" in d["reason"]]
    assert after and after[0]["kind"] == "switch", r["decisions"]
    weighed = after[0]["detail"]["replacements"]
    kinds = {o["kind"]: o for o in weighed}
    assert {"held", "best"} <= set(kinds), weighed
    assert kinds["held"]["new_vms"] == 0 and kinds["best"]["new_vms"] >= 1, weighed
    assert after[0]["detail"]["startup"]["vm_start_s"] == pytest.approx(vm_start_s)
    last = r["plans"][-1]["plan"]
    workers = sum(len(st["replicas"]) for st in last["stages"])
    assert workers == (2 if moves else 1), (last, after[0]["reason"])
    # the replacement weighed best, in words (it read "weighed *held (15s start): 29.2638 s")
    chosen_held = "the best plan on the VMs still held (starts in" in after[0]["reason"].split("(chosen)")[0] \
        .rsplit(";", 1)[-1]
    assert chosen_held != moves, after[0]["reason"]
    switch = [e for e in r["events"] if e["kind"] == "provisioned"][-1]
    assert (len(switch["rented"]) >= 1) == moves, switch
    assert_nothing_left(tmp_path, r["run_id"])


def test_invalid_parameters_fail_before_anything_is_provisioned(profiled_store, tmp_path):
    state = run(profiled_store, tmp_path, "invalid", global_batch_size=0, objective="fastest", steps=None)
    assert state.is_failed()
    with pytest.raises(InvalidParameters) as e:
        state.result()
    msg = str(e.value)
    assert "global_batch_size" in msg and "objective" in msg and "steps or token_budget" in msg
    assert not (tmp_path / "work").exists()  # no run folder, no slot, no VM


def test_an_unknown_model_is_refused_at_once_with_a_fix_the_flow_takes(profiled_store, tmp_path):
    import time

    t0 = time.monotonic()
    state = run(profiled_store, tmp_path, "typo", model="gpt-tinyy")
    assert state.is_failed() and time.monotonic() - t0 < 30  # it failed minutes later, after planning
    with pytest.raises(InvalidParameters) as e:
        state.result()
    msg = str(e.value)
    assert "unknown model 'gpt-tinyy'" in msg and "gpt-tiny" in msg and "--model-config config.json" in msg
    assert "sailor profile model" in msg  # not "pass --model-config", which a flow run does not take
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    assert not [r for r in RunHistory(open_store(profiled_store)).list_runs() if r.get("name") == "typo"]
    from infra.testbed import default_home

    # nor a testbed: the local provider makes one to learn the run's address before the model is checked
    left = [f for f in default_home().glob("*/testbed.json")
            if json.loads(f.read_text()).get("run_id", "").startswith("typo-")]
    assert not left, left


def test_a_failure_after_provisioning_still_tears_down(profiled_store, tmp_path):
    from flows.sailor import Deps
    from profiles_store.store import open_store

    # The worker agent cannot start on the rented VMs (a broken image, say).
    provider = LocalProvider(tmp_path / "local", agent_command=lambda vm, a, slot: [str(tmp_path / "no-such-agent")])
    deps = Deps(provider=provider, store=open_store(profiled_store), workdir=tmp_path / "work")
    state = run(profiled_store, tmp_path, "broken", deps=deps)
    assert state.is_failed()
    r = history(profiled_store, "broken")
    assert r["status"] == "failed" and "cannot start the worker agent" in r["status_reason"]
    assert "provisioned" in kinds(r) and "teardown" in kinds(r)
    vms = provider.list_vms(r["run_id"])
    assert vms and all(v.state == "terminated" for v in vms)


def test_a_stockout_at_the_first_provisioning_plans_again_on_what_is_granted(profiled_store, tmp_path):
    from flows.sailor import Deps
    from infra.scenario import parse_scenario
    from profiles_store.store import open_store
    from sailor_core.errors import CapacityError

    class Stockout(LocalProvider):
        """Offers 3 spot VMs, but between the offer and the request two of them go (as a cloud's do)."""

        tries = 0

        def provision(self, requests, *, dry_run=False):
            if not dry_run and self.tries == 0 and len(requests) > 1:
                self.tries += 1
                st = self._state()
                st["capacity"] = {k: (1 if "spot" in k else v) for k, v in st["capacity"].items()}
                from infra.local import _write_json

                _write_json(self._state_path, st)
                raise CapacityError(f"only 1 of the {len(requests)} spot VMs requested is left")
            return super().provision(requests, dry_run=dry_run)

    sc = parse_scenario({"offerings": [{"market": "spot", "count": 3, "usd_per_gpu_hour": 0.1}]})
    provider = Stockout(tmp_path / "local", scenario=sc, isolation="process")
    deps = Deps(provider=provider, store=open_store(profiled_store), workdir=tmp_path / "work")
    state = run(profiled_store, tmp_path, "stockout", deps=deps, objective="max-throughput", workers=3, steps=12)
    assert state.is_completed(), state.message
    r = history(profiled_store, "stockout")
    assert any(e["kind"] == "capacity_change" and "stockout" in e["reason"] for e in r["events"])
    first, last = r["plans"][0]["plan"], r["plans"][-1]["plan"]
    assert sum(len(st["replicas"]) for st in first["stages"]) > 1
    assert sum(len(st["replicas"]) for st in last["stages"]) == 1 and r["steps_done"] == 12
    assert_nothing_left(tmp_path, r["run_id"])


def test_cancelling_the_flow_process_tears_everything_down(profiled_store, tmp_path):
    """What cancelling from the UI does to a process-worker run: SIGTERM to the flow's process."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from prefect.settings import PREFECT_API_URL

    from profiles_store.store import open_store
    from tasks.history import RunHistory

    work = tmp_path / "work"
    code = (
        "from flows.sailor import sailor; "
        f"sailor(run_name='cancel', steps=5000, workers=2, objective='max-throughput', store_uri={profiled_store!r}, "
        f"workdir={str(work)!r})"
    )
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=Path(__file__).resolve().parent.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        h = RunHistory(open_store(profiled_store))
        end = time.monotonic() + 180
        run_id = None
        while time.monotonic() < end and proc.poll() is None:
            runs = [x for x in h.list_runs() if x["name"] == "cancel"]
            if runs:
                run_id = runs[-1]["run_id"]
                if "training_started" in kinds(h.show(run_id)):
                    break  # the plan was handed out: the workers train
            time.sleep(0.5)
        assert run_id and proc.poll() is None, "training never started"
        pids = [json.loads(f.read_text())["pid"] for f in (work / "runs" / run_id / "local" / "vms").glob("*.json")]
        assert pids and all(p and _group_alive(int(p)) for p in pids)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    r = h.show(run_id)
    assert r["status"] == "cancelled" and "teardown" in kinds(r)
    assert_nothing_left(tmp_path, run_id)
    assert not any(_group_alive(int(p)) for p in pids)


def test_a_worker_that_really_dies_is_detected_and_replaced(profiled_store, tmp_path):
    """Not scripted: a worker process is killed (SIGKILL) mid-training, as a crashed VM would be."""
    import os
    import signal
    import threading
    import time

    work = tmp_path / "work"
    killed: list[str] = []

    def assassin() -> None:
        end = time.monotonic() + 240
        while time.monotonic() < end and not killed:
            for rec_file in work.glob("runs/*/local/vms/*.json"):
                rec = json.loads(rec_file.read_text())
                # training started on that VM: its worker says so in its log, on the VM's own disk
                logs = list(Path(rec.get("slot") or "/nonexistent").glob("sailor/vm/worker-*.log"))
                started = any("ready at step" in f.read_text(errors="replace") for f in logs)
                if started and rec.get("pid") and rec.get("seq") == 1 and _group_alive(int(rec["pid"])) \
                        and steps_trained(work) >= 3:  # a few steps in: rank 0's own step records say so
                    os.killpg(int(rec["pid"]), signal.SIGKILL)
                    killed.append(rec["vm_id"])
                    return
            time.sleep(0.2)

    t = threading.Thread(target=assassin, daemon=True)
    t.start()
    state = run(profiled_store, tmp_path, "dies", objective="max-throughput", workers=2, max_gpus=2, steps=80)
    t.join(timeout=5)
    assert killed, "the worker was never killed (training did not start?)"
    assert state.is_completed(), state.message
    r = history(profiled_store, "dies")
    lost = [e for e in r["events"] if e["kind"] == "lost"]
    # The killed VM's peer fails its collective first ("worker reported failed: ... Connection reset by peer");
    # the provider's word on the killed VM decides what is replaced: one replan for the loss, not one for the
    # survivor taken for lost and another once the plan made on the dead VM never starts.
    assert any(e["vm_id"] == killed[0] and "exited" in e["reason"] for e in lost), lost
    switched = [d for d in r["decisions"] if d["kind"] == "switch" and "lost" in d["reason"]]
    assert len(switched) == 1, r["decisions"]
    assert "reconfigured" in kinds(r) and r["steps_done"] == 80
    assert_nothing_left(tmp_path, r["run_id"])


def test_a_dry_run_plans_and_rents_nothing(profiled_store, tmp_path):
    state = run(profiled_store, tmp_path, "dry", dry_run=True, objective="max-throughput")
    assert state.is_completed(), state.message
    summary = state.result()
    assert "nothing rented" in summary["dry_run"] and "hourly cost: $0.4000/h" in summary["dry_run"]
    r = history(profiled_store, "dry")
    assert r["status"] == "completed" and len(r["plans"]) == 1 and "provisioned" not in kinds(r)
    assert list((tmp_path / "work" / "runs" / r["run_id"] / "local" / "vms").glob("*.json")) == []


@pytest.mark.parametrize("rate, market", [(0.0, "spot"), (2000.0, "on-demand")])
def test_max_goodput_weighs_spot_preemptions_against_the_on_demand_price(profiled_once, tmp_path, rate, market):
    """The flow plans for goodput with the rate it is given: none expected, spot's lower price wins (as
    under min-cost); preempted every couple of seconds, the on-demand VM trains more per dollar. The store
    is a fresh copy of the profile: the preemptions other runs recorded in a shared store are history the
    rate is read from, and can outweigh the rate given (spot won twice in full suites this way)."""
    import shutil

    profiled_store = str(tmp_path / "store")
    shutil.copytree(profiled_once, profiled_store)
    sc = scenario(tmp_path, """
offerings:
  - {market: spot, count: 1, usd_per_gpu_hour: 0.10}
  - {market: on-demand, count: 1, usd_per_gpu_hour: 0.30}
""")
    name = f"goodput-{int(rate)}"
    state = run(profiled_store, tmp_path, name, scenario=sc, dry_run=True, objective="max-goodput",
                spot_preemptions_per_vm_hour=rate, workers=1)
    assert state.is_completed(), state.message
    r = history(profiled_store, name)
    plan = r["plans"][-1]["plan"]
    assert {rep["market"] for st in plan["stages"] for rep in st["replicas"]} == {market}
