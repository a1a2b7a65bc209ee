"""Every trained step recorded once, and scripted events at the step they name.

A deployment run's curves had a hole (plan v1's records 1-20, plan v2 from 51, checkpoints at 30, 40
and 50): the flow saved a plan version's records only while it watched that version, and the steps
the old version trained during the replan were never saved. In `make run` the preemption scripted at
step 20 came at step 59 and the price change at step 80 never happened: the provider looked at the
step only when the flow polled, and the flow was busy re-planning.
"""

from __future__ import annotations

import threading
import time

import pytest

from infra.local import LocalProvider
from infra.provider import VmRequest
from infra.scenario import parse_scenario
from sailor_core.domain import Market
from sailor_core.runtime import protocol
from sailor_core.runtime.protocol import ControlClient, ControlServer
from tasks.runstate import RunState, flush_metrics, read_metrics, steps_once

pytest_plugins = ["tests.flow_fixtures"]


def rows(version: int, steps: range) -> list[dict]:
    return [{"step": s, "loss": 10.0 - s / 100, "plan_version": version} for s in steps]


def test_a_version_that_resumed_replaces_what_the_older_one_trained_past_its_checkpoint():
    # v1 trained to 59 and was lost; v2 resumed from the checkpoint at 50: steps 51-59 were trained
    # twice, and v2's are the ones the model continued from.
    got = steps_once(rows(1, range(1, 60)) + rows(2, range(51, 121)))
    assert [r["step"] for r in got] == list(range(1, 121))
    assert {r["plan_version"] for r in got if r["step"] > 50} == {2}


def test_a_report_that_arrived_twice_counts_once_and_versions_in_place_keep_their_steps():
    got = steps_once(rows(1, range(1, 21)) + rows(1, range(15, 21)) + rows(2, range(21, 41)))
    assert [r["step"] for r in got] == list(range(1, 41))


def test_a_version_that_trained_nothing_leaves_the_older_records():
    got = steps_once(rows(1, range(1, 121)))
    assert len(got) == 120


def test_read_metrics_gives_each_step_once(tmp_path):
    state = RunState(uri=str(tmp_path), flow_uri=str(tmp_path), vm_uri=str(tmp_path))
    flush_metrics(state, 1, rows(1, range(1, 60)))
    flush_metrics(state, 2, rows(2, range(51, 121)))
    assert [r["step"] for r in read_metrics(state)] == list(range(1, 121))


def test_rank_zero_holds_at_a_scripted_step_until_released(tmp_path, monkeypatch):
    from sailor_core.runtime.worker_control import WorkerControl

    monkeypatch.setenv("SAILOR_METRICS_DIR", str(tmp_path))
    server = ControlServer()
    try:
        ctl = WorkerControl(ControlClient(server.endpoint, server.secret), "vm/0")
        ctl.training, ctl.holds = 3, frozenset({20})
        done: list[float] = []
        t = threading.Thread(target=lambda: (ctl.on_metrics({"step": 20, "plan_version": 3}),
                                             done.append(time.monotonic())))
        t0 = time.monotonic()
        t.start()
        deadline = time.monotonic() + 10
        while server.get(protocol.held_key(3)) is None:
            assert time.monotonic() < deadline, "rank 0 never said it holds"
            time.sleep(0.01)
        assert server.get(protocol.held_key(3)) == "20" and not done  # held: the step does not end
        server.set(protocol.release_key(3, 20), "released")
        t.join(timeout=10)
        assert done and done[0] - t0 < protocol.HOLD_MAX_S
        # the step's record is in the worker's own file and at the controller
        assert (tmp_path / "metrics-v3.jsonl").read_text().count('"step": 20') == 1
        assert len(server.read_list(protocol.metrics_key(3))) == 1
        ctl.on_metrics({"step": 21, "plan_version": 3})  # not a hold step: no wait
    finally:
        server.close()


def _provider(tmp_path, events):
    sc = parse_scenario({"offerings": [{"market": "spot", "count": 2, "usd_per_gpu_hour": 0.1},
                                       {"market": "on-demand", "count": 2, "usd_per_gpu_hour": 0.3}],
                         "events": events})
    return LocalProvider(tmp_path, scenario=sc)


def test_the_provider_names_the_steps_still_scripted_and_the_events_that_could_not_happen(tmp_path):
    p = _provider(tmp_path, [{"kind": "preemption", "at_step": 5, "zone": "local", "market": "on-demand"},
                             {"kind": "price_change", "at_step": 12, "market": "spot", "usd_per_gpu_hour": 0.2},
                             {"kind": "price_change", "at_step": 400, "market": "spot", "usd_per_gpu_hour": 0.3}])
    assert p.scripted_steps("r") == [5, 12, 400]
    [vm] = p.provision([VmRequest(run_id="r", name="w0", zone="local", gpu_type="cpu", gpus=1, market=Market.SPOT)])
    (p.slot_dir(vm.vm_id) / "heartbeat.json").write_text('{"step": 5}')
    assert p.events("r") == []  # the preemption matched no running VM (the run has only a spot one)
    assert p.scripted_steps("r") == [12, 400]
    (p.slot_dir(vm.vm_id) / "heartbeat.json").write_text('{"step": 12}')
    assert [e.detail["at_step"] for e in p.events("r")] == [12]
    missed = p.missed_events("r", last_step=120)
    assert len(missed) == 2
    assert "preemption (on-demand local) scripted at step 5 did not happen: no running VM" in missed[0]
    assert "price change (spot) scripted at step 400 did not happen: the run ended at step 120" in missed[1]
    p.cleanup("r")


@pytest.mark.usefixtures("prefect_harness")
def test_the_demo_records_every_step_once_and_each_scripted_event_at_its_step(profiled_store, tmp_path, capsys):
    """`make run`'s job (scenarios/demo.yaml: a preemption at step 20, a price change at step 80), with plain
    process VMs: the history read back lists steps 1-120 once and each event at the step the file names."""
    import json

    from sailor_cli.main import main

    assert main(["demo", "--isolation", "process", "--store", profiled_store, "--workdir", str(tmp_path / "wd"),
                 "--json"]) == 0
    out = capsys.readouterr().out
    run = json.loads(out[out.index("{\n"):])
    state = run["cluster"]["state_uri"]
    steps = [r["step"] for r in read_metrics(RunState(uri=state, flow_uri=state, vm_uri=state))]
    assert steps == list(range(1, 121)), sorted(set(range(1, 121)) - set(steps))
    for kind, at in (("preemption", 20), ("price_change", 80)):
        happened = [e for e in run["events"] if e["kind"] == kind and e.get("scripted")]
        assert happened and happened[0]["run_step"] == at, (kind, happened)
    assert not [e for e in run["events"] if e["kind"] == "scripted_missed"]
