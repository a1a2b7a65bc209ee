"""Pieces of the flow that need no Prefect server: parameters, the switch decision, run history, jobs."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from flows.params import InvalidParameters, validate_params
from infra.provider import Vm
from sailor_core.domain import Market, ParallelPlan, PipelineBatch, Replica, Stage
from tasks.control import Controller
from tasks.decisions import PlanCost, decide_switch
from tasks.history import RunHistory, UnknownRunError, new_run_id
from tasks.jobs import Job, assign_job, assignments, place, read_progress, vm_ranks
from tasks.runstate import state_for


def test_parameters_name_every_bad_field():
    with pytest.raises(InvalidParameters) as e:
        validate_params({"global_batch_size": 0, "objective": "fastest", "markets": ["cheap"], "steps": 5,
                         "token_budget": 10})
    msg = str(e.value)
    for field in ("global_batch_size", "objective", "markets"):
        assert field in msg
    with pytest.raises(InvalidParameters, match="exactly one of steps or token_budget"):
        validate_params({})
    with pytest.raises(InvalidParameters, match="scenario"):
        validate_params({"steps": 3, "scenario": "/no/such/file.yaml"})
    p = validate_params({"token_budget": 10_000, "global_batch_size": 8, "markets": ["Spot"]})
    assert p.total_steps(128) == 10 and p.markets == ["spot"]


CUR = PlanCost(iteration_time_s=1.0, usd_per_iteration=0.010, usd_per_hour=36.0)


def test_switch_pays_only_over_enough_remaining_work():
    cheaper = PlanCost(iteration_time_s=1.0, usd_per_iteration=0.005, usd_per_hour=18.0)
    many = decide_switch(objective="min-cost", current=CUR, candidate=cheaper, remaining_steps=1000, lost_steps=5,
                         reconfiguration_s=20)
    assert many.switch and many.gain == pytest.approx(1000 * 0.010 - (20 * 18 / 3600 + 1005 * 0.005))
    few = decide_switch(objective="min-cost", current=CUR, candidate=cheaper, remaining_steps=10, lost_steps=5,
                        reconfiguration_s=20)
    assert not few.switch and "not worth" in few.reason


def test_throughput_objective_counts_seconds_and_broken_plans_are_left():
    faster = PlanCost(iteration_time_s=0.5, usd_per_iteration=0.02, usd_per_hour=144.0)
    d = decide_switch(objective="max-throughput", current=CUR, candidate=faster, remaining_steps=100, lost_steps=0,
                      reconfiguration_s=10)
    assert d.switch and d.gain_unit == "s" and d.gain == pytest.approx(100 - (10 + 50))
    slower = PlanCost(iteration_time_s=2.0, usd_per_iteration=0.001, usd_per_hour=1.0)
    forced = decide_switch(objective="max-throughput", current=None, candidate=slower, remaining_steps=100,
                           lost_steps=3, reconfiguration_s=10, current_broken="2 workers lost")
    assert forced.switch and forced.forced and "2 workers lost" in forced.reason
    same = decide_switch(objective="min-cost", current=CUR, candidate=CUR, remaining_steps=100, lost_steps=0,
                         reconfiguration_s=1, same_plan=True)
    assert not same.switch


@pytest.fixture
def store(tmp_path):
    from profiles_store.store import open_store

    return open_store(str(tmp_path / "store"))


def test_history_keeps_runs_with_the_same_name_apart(store):
    t = [datetime(2026, 1, 1, tzinfo=UTC)]

    def clock():
        t[0] += timedelta(seconds=1)
        return t[0]

    h = RunHistory(store, clock=clock)
    a, b = new_run_id("demo"), new_run_id("demo")
    assert a != b
    for run in (a, b):
        h.run_status(run, "running", payload={"name": "demo"})
        h.event(run, "preemption", "VM x taken back", {"vm_id": "x"})
    h.run_status(a, "completed", payload={"steps_done": 7})
    h.decision(b, "switch", "switch pays")
    runs = {r["run_id"]: r for r in h.list_runs()}
    assert runs[a]["status"] == "completed" and runs[b]["status"] == "running"
    assert runs[a]["name"] == runs[b]["name"] == "demo"
    shown = h.show(a)
    assert [e["kind"] for e in shown["events"]] == ["preemption"] and shown["decisions"] == []
    assert h.show(b)["decisions"][0]["reason"] == "switch pays"
    with pytest.raises(UnknownRunError, match="sailor runs list"):
        h.show("nope")
    h.measurement(a, "calibration", {"gpu_type": "cpu", "factor": 1.5})
    h.measurement(b, "calibration", {"gpu_type": "cpu", "factor": 2.0})
    assert h.calibration(["cpu"]) == {"cpu": 2.0}


def _plan(n: int) -> ParallelPlan:
    reps = tuple(Replica(gpu_type="cpu", zone="local", market=Market.SPOT) for _ in range(n))
    return ParallelPlan(
        model="gpt-tiny",
        global_batch_size=2 * n,
        stages=(Stage(first_layer=0, last_layer=5, replicas=reps),),
        pipelines=tuple(PipelineBatch(microbatch_size=2, num_microbatches=1) for _ in range(n)),
    )


def _vm(i: int, market: Market = Market.SPOT) -> Vm:
    return Vm(vm_id=f"vm{i}", run_id="r", name=f"w{i}", zone="local", gpu_type="cpu", gpus=1, market=market)


def test_reconfiguration_reuses_matching_vms_and_assigns_ranks_in_order(tmp_path):
    placed, missing = place(_plan(3), [_vm(0), _vm(1, Market.ON_DEMAND), _vm(2)])
    assert [v.vm_id for v in placed.values()] == ["vm0", "vm2"] and len(missing) == 1
    ctl = Controller()
    try:
        job = Job(run_id="r", version=2, plan=_plan(2), vms=[_vm(0), _vm(2)], run_dir=tmp_path, total_steps=10,
                  checkpoint_interval=5, state=state_for(None, "r", tmp_path), controller=ctl)
        a = assignments(job)
        assert [x.ranks for _, x in a] == [(0,), (1,)] and {x.world_size for _, x in a} == {2}
        assert json.loads(a[0][1].plan_json)["format"] == "sailor-plan" and a[0][1].total_steps == 10
        assert a[0][1].rendezvous_endpoint == ctl.endpoint and a[0][1].run_secret == ctl.secret
        assert a[0][1].checkpoint_uri.startswith(str(tmp_path)) and a[0][1].first_generation == 2
        # Progress: from what the workers reported to the controller; steps are global across versions.
        for s in range(6, 10):
            ctl.server._board.append(
                "metrics/v2", json.dumps({"step": s, "loss": 5.0 - s / 10, "iteration_time_s": 0.1})
            )
        ctl.server._board.append("metrics/v2", '{"step": 10, "lo')
        pr = read_progress(job)
        assert pr.step == 9 and pr.steps_this_version == 4 and pr.loss == pytest.approx(4.1)
        assert pr.recent_iteration_s == pytest.approx(0.1)
    finally:
        ctl.close()


def test_a_multi_device_vm_runs_a_tp_group_and_its_spare_devices_sit_out(tmp_path):
    plan = ParallelPlan(model="gpt-tiny", global_batch_size=4, stages=(
        Stage(first_layer=0, last_layer=2, replicas=(Replica(gpu_type="cpu", zone="local", tp=1),)),
        Stage(first_layer=3, last_layer=5, replicas=(Replica(gpu_type="cpu", zone="local", tp=2, gpus_per_node=2),))),
        pipelines=(PipelineBatch(microbatch_size=2, num_microbatches=2),))
    vms = [Vm(vm_id="a", run_id="r", name="a", zone="local", gpu_type="cpu", gpus=2, market=Market.SPOT),
           Vm(vm_id="b", run_id="r", name="b", zone="local", gpu_type="cpu", gpus=2, market=Market.SPOT)]
    ctl = Controller()
    try:
        job = Job(run_id="r", version=1, plan=plan, vms=vms, run_dir=tmp_path, total_steps=4, checkpoint_interval=2,
                  state=state_for(None, "r", tmp_path), controller=ctl)
        assert [(v.vm_id, r) for v, r in vm_ranks(job)] == [("a", (0,)), ("b", (1, 2))]
        members = assign_job(job, resume=False)
        assert members == ["a/0", "b/0", "b/1"]
        got = {w: json.loads(ctl.server.get(f"g1/assign/{w}")) for w in ("a/0", "a/1", "b/0", "b/1")}
        assert [got[w]["rank"] for w in ("a/0", "a/1", "b/0", "b/1")] == [0, -2, 1, 2]
        assert got["b/1"]["local_rank"] == 1 and got["b/1"]["world_size"] == 3
    finally:
        ctl.close()


def test_runs_cli_lists_and_shows_runs_as_json(store, tmp_path, capsys):
    from sailor_cli.main import main

    h = RunHistory(store)
    h.run_status("demo-1", "running", payload={"name": "demo"})
    for kind in ("preemption", "price_change", "capacity_change", "replan", "reconfigured"):
        h.event("demo-1", kind, f"a {kind}")
    h.run_status("demo-1", "completed", "60 steps done", {"steps_done": 60, "usd_total": 0.01, "wall_s": 30.0})
    uri = str(store.uri)
    assert main(["runs", "list", "--store", uri, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [(r["run_id"], r["status"], r["steps_done"]) for r in runs] == [("demo-1", "completed", 60)]
    assert main(["runs", "show", "demo-1", "--store", uri, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "completed"
    assert [e["kind"] for e in shown["events"]] == ["preemption", "price_change", "capacity_change", "replan",
                                                     "reconfigured"]
    assert all(datetime.fromisoformat(e["time"]) for e in shown["events"])
    assert main(["runs", "show", "nope", "--store", uri]) == 2  # one-line error, no traceback
    assert "sailor runs list" in capsys.readouterr().err
    assert main(["runs", "show", "demo-1", "--store", uri]) == 0  # the human view renders
    assert "reconfigured" in capsys.readouterr().out
