"""A plan change without restarts: the same worker processes go on to the next generation, the ranks
that keep their shard keep their state in memory, and the losses stay those of one process; also
when the generation was aborted because a member was lost."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from sailor_core.plan_format import plan_to_dict
from sailor_core.runtime.protocol import (
    SECRET_ENV,
    ControlServer,
    abort_key,
    assign_generation,
    loaded_key,
    metrics_key,
    status_key,
    stop_key,
)
from tests.test_runtime import SINGLE, plan, rep, train

STEPS = 8
SWITCH_AT = 3


def _agent(tmp_path, server: ControlServer, vm: str, devices: int) -> subprocess.Popen:
    env = dict(os.environ, **{SECRET_ENV: server.secret})
    code = "import sys, typer; from sailor_cli.worker import worker; typer.run(worker)"
    return subprocess.Popen([sys.executable, "-c", code, "--control", server.endpoint, "--vm-id", vm,
                             "--devices", str(devices), "--events-out", str(tmp_path / f"{vm}.events"),
                             "--run-dir", str(tmp_path / f"vm-{vm}"), "--heartbeat", "0.5", "--grace", "20"], env=env)


def _wait(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _pids(tmp_path, vm: str) -> dict[str, int]:
    lines = (tmp_path / f"{vm}.events").read_text().splitlines()
    return json.loads(lines[0])["workers"]


def _losses(server: ControlServer, versions: int) -> list[float]:
    rows = {}
    for v in range(versions):
        for x in server.read_list(metrics_key(v)):
            r = json.loads(x)
            rows[r["step"]] = r["loss"]  # a step the next generation ran again: its run wins
    return [rows[k] for k in sorted(rows)]


def test_a_plan_change_keeps_the_processes_and_the_losses(tmp_path):
    before = plan([((0, 2), [rep()]), ((3, 5), [rep()])])  # a/0 runs stage 0, b/0 stage 1; a/1 sits out
    after = plan([((0, 2), [rep(2)]), ((3, 5), [rep()])])  # stage 0 now tp=2 over both devices of a
    ck = tmp_path / "ck"
    base = {"model": "gpt-tiny", "steps": STEPS, "timeout_s": 30, "checkpoint_uri": str(ck), "checkpoint_interval": 100}
    server = ControlServer()
    procs = []
    try:
        assign_generation(server, 0, plan=plan_to_dict(before), settings={**base, "plan_version": 0}, resume=False,
                          vms=[("a", 2, (0,)), ("b", 1, (1,))])
        procs = [_agent(tmp_path, server, "a", 2), _agent(tmp_path, server, "b", 1)]
        _wait(lambda: len(server.read_list(metrics_key(0))) >= SWITCH_AT, 240)
        pids = {vm: _pids(tmp_path, vm) for vm in ("a", "b")}
        server.set(stop_key(0), "plan change")
        _wait(lambda: all(server.get(status_key(0, w)) for w in ("a/0", "b/0")), 120)
        assert [server.get(status_key(0, w)) for w in ("a/0", "b/0")] == ["switched", "switched"]
        stopped_at = max(json.loads(x)["step"] for x in server.read_list(metrics_key(0)))
        assert any(d == f"step_{stopped_at:08d}" for d in os.listdir(ck))  # the switch checkpointed
        assign_generation(server, 1, plan=plan_to_dict(after), settings={**base, "plan_version": 1}, resume=True,
                          vms=[("a", 2, (0, 1)), ("b", 1, (2,))])
        assert [p.wait(timeout=240) for p in procs] == [0, 0]
        # the same processes trained both plans
        assert {vm: _pids(tmp_path, vm) for vm in ("a", "b")} == pids
        for vm in ("a", "b"):
            ev = [json.loads(x) for x in (tmp_path / f"{vm}.events").read_text().splitlines()]
            assert [e for e in ev if e["event"] == "started"] == ev[:1]
        # stage 1 kept its shard (same layers, same TP): from memory; stage 0 changed TP: from the checkpoint
        assert server.get(loaded_key(1, "b/0")) == "memory"
        assert server.get(loaded_key(1, "a/0")) == server.get(loaded_key(1, "a/1")) == "checkpoint"
        got = _losses(server, 2)
        ref = train(SINGLE, tmp_path, "single")
        assert len(got) == STEPS
        assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-3, (got, ref)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        server.close()


def test_an_aborted_generation_leaves_the_survivors_state_in_memory(tmp_path):
    before = plan([((0, 2), [rep()]), ((3, 5), [rep()])])  # a/0 runs stage 0, b/0 stage 1
    after = plan([((0, 5), [rep()])])  # b is lost: a/0 runs every layer
    ck = tmp_path / "ck"
    base = {"model": "gpt-tiny", "steps": STEPS, "timeout_s": 30, "checkpoint_uri": str(ck), "checkpoint_interval": 1}
    server = ControlServer()
    procs = []
    try:
        assign_generation(server, 0, plan=plan_to_dict(before), settings={**base, "plan_version": 0}, resume=False,
                          vms=[("a", 1, (0,)), ("b", 1, (1,))])
        procs = [_agent(tmp_path, server, "a", 1), _agent(tmp_path, server, "b", 1)]
        _wait(lambda: len(server.read_list(metrics_key(0))) >= SWITCH_AT, 240)
        pids = _pids(tmp_path, "a")
        server.set(abort_key(0), "b lost")  # what the flow does when a member's VM is taken back
        _wait(lambda: all(server.get(status_key(0, w)) for w in ("a/0", "b/0")), 120)
        assert all(server.get(status_key(0, w)).startswith("failed: PeerLost") for w in ("a/0", "b/0"))
        reached = max(json.loads(x)["step"] for x in server.read_list(metrics_key(0)))  # a/0 is rank 0
        # b's VM is released: its worker, waiting for an assignment, ends at once on SIGTERM
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(timeout=60) == 0
        # ended by the SIGTERM, not killed after the agent's 20 s grace (a kill would list it as failed)
        b_events = map(json.loads, (tmp_path / "b.events").read_text().splitlines())
        b_exit = [e for e in b_events if e["event"] == "exited"]
        assert b_exit and b_exit[-1]["status"] == "cancelled" and b_exit[-1]["failed"] == [], b_exit
        assign_generation(server, 1, plan=plan_to_dict(after), settings={**base, "plan_version": 1}, resume=True,
                          vms=[("a", 1, (0,))])
        assert procs[0].wait(timeout=240) == 0
        assert _pids(tmp_path, "a") == pids
        assert server.get(loaded_key(1, "a/0")) == "checkpoint"  # stage 1's layers came from the checkpoint
        log = (tmp_path / "vm-a" / "worker-0.log").read_text()
        step, kept, loaded = map(int, re.search(r"at step (\d+): (\d+) layer\(s\) kept from memory, (\d+) loaded",
                                                log).groups())
        # a/0 kept stage 0's layers 0..2 when the checkpoint it resumed at is the step its trainer reached
        assert (kept, loaded) == ((3, 3) if step == reached else (0, 6)), (step, reached, kept, loaded)
        got = _losses(server, 2)
        ref = train(SINGLE, tmp_path, "single")
        assert len(got) == STEPS
        assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-3, (got, ref)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        server.close()
