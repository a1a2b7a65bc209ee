"""The local provider: the provider contract, scenario files, scripted events and real lost workers.

The agent here is a small Python process that beats a heartbeat file with a step counter, so these
tests check the provider's process handling in a second each; the flow tests run the real runtime.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from infra.local import LocalProvider, _group_alive
from infra.provider import EventKind, VmRequest, WorkerAssignment
from infra.scenario import ScenarioError, load_scenario, parse_scenario
from sailor_core.domain import Market
from sailor_core.errors import ProviderError
from tests.provider_contract import ProviderContract

HEARTBEAT_AGENT = textwrap.dedent("""
    import json, os, signal, sys, time
    hb = os.environ["SAILOR_HEARTBEAT_FILE"]
    mode = sys.argv[1]
    step = 0
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0 if mode == "obedient" else 3))
    signal.signal(signal.SIGUSR1, lambda *a: open(hb + ".notice", "w").close())
    while True:
        if mode != "silent":
            with open(hb + ".tmp", "w") as f:
                json.dump({"step": step, "time": time.time()}, f)
            os.replace(hb + ".tmp", hb)
        step += 1
        if mode == "finish" and step > 3:
            sys.exit(0)
        time.sleep(0.05)
""")


def agent(mode: str = "obedient"):
    def command(vm, assignment, slot: Path) -> list[str]:
        return [sys.executable, "-c", HEARTBEAT_AGENT, mode]
    return command


def req(run_id: str, name: str = "w0", market: Market = Market.ON_DEMAND) -> VmRequest:
    return VmRequest(run_id=run_id, name=name, zone="local", gpu_type="cpu", gpus=1, market=market)


def assignment(run_id: str) -> WorkerAssignment:
    return WorkerAssignment(run_id=run_id, plan_version=1, plan_json="{}", rendezvous_endpoint="127.0.0.1:1",
                            ranks=(0,), world_size=1)


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


class TestLocalProviderContract(ProviderContract):
    @pytest.fixture
    def provider(self, tmp_path):
        return LocalProvider(tmp_path / "local", agent_command=agent(), stop_grace_s=2)


def test_scenario_file_parses(tmp_path):
    sc = load_scenario(Path(__file__).resolve().parent.parent / "scenarios" / "demo.yaml")
    kinds = {e.kind for e in sc.events}
    assert {"preemption", "price_change"} <= kinds
    assert {o.market for o in sc.offerings} == {Market.SPOT, Market.ON_DEMAND}


def test_bad_scenarios_list_every_problem(tmp_path):
    with pytest.raises(ScenarioError) as e:
        parse_scenario({
            "offerings": [{"market": "spot", "count": -1, "usd_per_gpu_hour": 1}],
            "events": [{"kind": "meteor"}, {"kind": "price_change", "at_step": 3},
                       {"kind": "preemption", "at_step": 1, "at_s": 2, "market": "spot"}],
        })
    msg = str(e.value)
    assert "offerings[0].count" in msg and "events[0].kind" in msg
    assert "events[1]: a price_change needs" in msg and "events[2]: give exactly one trigger" in msg
    bad = tmp_path / "bad.yaml"
    bad.write_text("offerings: [")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(bad)


def test_scripted_preemption_notices_then_kills_and_is_detected_as_lost(tmp_path):
    sc = parse_scenario({
        "offerings": [{"market": "spot", "count": 2, "usd_per_gpu_hour": 0.1}],
        "events": [{"kind": "preemption", "at_step": 5, "market": "spot", "grace_s": 0.3}],
    })
    p = LocalProvider(tmp_path, scenario=sc, agent_command=agent("stubborn"), stop_grace_s=1)
    run = "r1"
    try:
        vms = p.provision([req(run, "w0", Market.SPOT), req(run, "w1", Market.SPOT)])
        for vm in vms:
            p.bootstrap(vm, assignment(run))
        pre = wait_for(lambda: [e for e in p.events(run) if e.kind == EventKind.PREEMPTION])
        assert pre[0].vm_id == vms[1].vm_id and pre[0].detail["run_step"] >= 5
        wait_for(lambda: (p.slot_dir(vms[1].vm_id) / "heartbeat.json.notice").exists())  # the notice arrived
        lost = wait_for(lambda: [e for e in p.events(run) if e.kind == EventKind.LOST])
        assert lost[0].vm_id == vms[1].vm_id and "preempted" in lost[0].detail["reason"]
        # The slot is gone: capacity shrank, the survivor still runs.
        assert sum(o.gpus for o in p.offerings()) == 0
        wait_for(lambda: p.events(run) is not None and p.list_vms(run)[1].state == "preempted")
        states = {v.vm_id: v.state for v in p.list_vms(run)}
        assert states == {vms[0].vm_id: "running", vms[1].vm_id: "preempted"}
        assert p.cleanup(run) == [vms[0].vm_id]
    finally:
        p.cleanup(run)


def test_a_real_dead_worker_is_reported_lost(tmp_path):
    p = LocalProvider(tmp_path, agent_command=agent())
    try:
        vm = p.provision([req("r")])[0]
        p.bootstrap(vm, assignment("r"))
        wait_for(lambda: p.heartbeat(vm.vm_id))
        pid = int(__import__("json").loads((tmp_path / "vms" / f"{vm.vm_id}.json").read_text())["pid"])
        os.killpg(pid, signal.SIGKILL)
        lost = wait_for(lambda: [e for e in p.events("r") if e.kind == EventKind.LOST])
        assert lost[0].vm_id == vm.vm_id and "exited" in lost[0].detail["reason"]
        assert len([e for e in p.events("r") if e.kind == EventKind.LOST]) == 1  # reported once
    finally:
        p.cleanup("r")


def test_a_silent_worker_is_reported_lost_after_the_heartbeat_timeout(tmp_path):
    p = LocalProvider(tmp_path, agent_command=agent("silent"), startup_grace_s=0.3, heartbeat_timeout_s=0.3)
    try:
        vm = p.provision([req("r")])[0]
        p.bootstrap(vm, assignment("r"))
        lost = wait_for(lambda: [e for e in p.events("r") if e.kind == EventKind.LOST])
        assert "heartbeat" in lost[0].detail["reason"]
    finally:
        p.cleanup("r")


def test_a_finished_worker_is_not_lost(tmp_path):
    p = LocalProvider(tmp_path, agent_command=agent("finish"))
    try:
        vm = p.provision([req("r")])[0]
        p.bootstrap(vm, assignment("r"))
        wait_for(lambda: p.agent_exit_code(vm.vm_id) == 0)
        assert [e for e in p.events("r") if e.kind == EventKind.LOST] == []
    finally:
        p.cleanup("r")


def test_timed_price_and_capacity_changes_follow_the_clock(tmp_path):
    now = [1000.0]
    sc = parse_scenario({
        "offerings": [{"market": "spot", "count": 3, "usd_per_gpu_hour": 0.1},
                      {"market": "on-demand", "count": 2, "usd_per_gpu_hour": 0.3}],
        "events": [{"kind": "price_change", "at_s": 10, "market": "spot", "usd_per_gpu_hour": 0.5},
                   {"kind": "capacity_change", "at_s": 20, "market": "on-demand", "count": 5}],
    })
    p = LocalProvider(tmp_path, scenario=sc, clock=lambda: now[0])
    p.provision([req("r", market=Market.SPOT)])
    assert p.events("r") == []
    now[0] += 11
    evs = p.events("r")
    assert [e.kind for e in evs] == [EventKind.PRICE_CHANGE]
    assert evs[0].detail["old_usd_per_gpu_hour"] == 0.1 and evs[0].detail["new_usd_per_gpu_hour"] == 0.5
    prices = {o.market: o.usd_per_gpu_hour for o in p.offerings()}
    assert prices == {Market.SPOT: 0.5, Market.ON_DEMAND: 0.3}
    now[0] += 10
    assert [e.kind for e in p.events("r", since=evs[0].at)] == [EventKind.CAPACITY_CHANGE]
    counts = {o.market: o.gpus for o in p.offerings()}
    assert counts == {Market.SPOT: 2, Market.ON_DEMAND: 5}
    p.cleanup("r")


def test_a_run_past_several_step_triggers_gets_them_one_step_at_a_time(tmp_path):
    # A run that trains faster than the flow looks must not see the changes of steps 5 and 12 as one.
    sc = parse_scenario({
        "offerings": [{"market": "spot", "count": 2, "usd_per_gpu_hour": 0.1},
                      {"market": "on-demand", "count": 2, "usd_per_gpu_hour": 0.3}],
        "events": [{"kind": "price_change", "at_step": 5, "market": "spot", "usd_per_gpu_hour": 0.2},
                   {"kind": "price_change", "at_step": 5, "market": "on-demand", "usd_per_gpu_hour": 0.4},
                   {"kind": "price_change", "at_step": 12, "market": "spot", "usd_per_gpu_hour": 40.0},
                   {"kind": "price_change", "at_step": 99, "market": "spot", "usd_per_gpu_hour": 1.0}],
    })
    p = LocalProvider(tmp_path, scenario=sc)
    [vm] = p.provision([req("r", market=Market.SPOT)])
    (p.slot_dir(vm.vm_id) / "heartbeat.json").write_text('{"step": 30}')  # already past steps 5 and 12
    first = p.events("r")
    assert [(e.detail["at_step"], e.detail["new_usd_per_gpu_hour"]) for e in first] == [(5, 0.2), (5, 0.4)]
    second = p.events("r", since=first[-1].at)
    assert [(e.detail["at_step"], e.detail["new_usd_per_gpu_hour"], e.detail["run_step"]) for e in second] == [
        (12, 40.0, 30)]
    assert p.events("r", since=second[-1].at) == []  # step 99 is not reached
    p.cleanup("r")


def test_cleanup_from_another_process_view_stops_the_agents(tmp_path):
    p = LocalProvider(tmp_path, agent_command=agent("stubborn"), stop_grace_s=0.5)
    vm = p.provision([req("r")])[0]
    p.bootstrap(vm, assignment("r"))
    wait_for(lambda: p.heartbeat(vm.vm_id))
    pid = int(__import__("json").loads((tmp_path / "vms" / f"{vm.vm_id}.json").read_text())["pid"])
    other = LocalProvider(tmp_path, stop_grace_s=0.5)  # e.g. `sailor infra cleanup` after a crash
    assert other.cleanup("r") == [vm.vm_id]
    wait_for(lambda: not _group_alive(pid))
    p.agent_exit_code(vm.vm_id)  # reap
    assert other.cleanup("r") == []


def test_bad_requests_say_what_is_offered(tmp_path):
    p = LocalProvider(tmp_path)
    with pytest.raises(ProviderError, match=r"A100-40 in zone local on on-demand is not offered here \(cpu in local"):
        p.provision([VmRequest(run_id="r", name="w", zone="local", gpu_type="A100-40", gpus=1)])


def test_the_flows_cancellation_hook_cleans_up_from_disk(tmp_path):
    """The flow's on_cancellation/on_crashed hook finds the run's VMs from the provider's files alone."""
    import types
    import uuid

    from flows.sailor import _cleanup_hook, run_id_for

    flow_run = types.SimpleNamespace(id=uuid.uuid4(), parameters={"run_name": "hooked", "steps": 5,
                                                                   "workdir": str(tmp_path)})
    run_id = run_id_for("hooked", str(flow_run.id))
    p = LocalProvider(tmp_path / "runs" / run_id / "local", agent_command=agent("stubborn"), stop_grace_s=0.5)
    vm = p.provision([req(run_id)])[0]
    p.bootstrap(vm, assignment(run_id))
    wait_for(lambda: p.heartbeat(vm.vm_id))
    pid = int(__import__("json").loads((p.root / "vms" / f"{vm.vm_id}.json").read_text())["pid"])
    _cleanup_hook(None, flow_run, None)
    wait_for(lambda: not _group_alive(pid))
    p.agent_exit_code(vm.vm_id)  # reap
    assert [v.state for v in p.list_vms(run_id)] == ["terminated"]
