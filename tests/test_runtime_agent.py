"""`sailor worker` agents (one worker per device, tp inside a VM) under a controller; the run secret; cancel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sailor_cli.main import main as sailor_main
from sailor_core.runtime.protocol import (
    SECRET_ENV,
    ControlClient,
    ControlServer,
    ProtocolError,
    assign_generation,
    metrics_key,
    status_key,
)

PLAN = {"format": "sailor-plan", "version": 1, "model": "gpt-tiny", "global_batch_size": 8,
        "stages": [{"layers": [0, 2], "replicas": [{"gpu_type": "cpu", "gpus_per_node": 2, "zone": "local", "tp": 1}]},
                   {"layers": [3, 5], "replicas": [{"gpu_type": "cpu", "gpus_per_node": 2, "zone": "local", "tp": 1}]}],
        "pipelines": [{"microbatch_size": 2, "num_microbatches": 4}]}


TP2_PLAN = {**PLAN, "stages": [PLAN["stages"][0],
                                {"layers": [3, 5], "replicas": [{"gpu_type": "cpu", "gpus_per_node": 2, "zone": "local",
                                                                 "tp": 2}]}]}


def _agent(tmp_path, server: ControlServer, vm: str, devices: int, secret: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, **{SECRET_ENV: secret or server.secret})
    code = "import sys, typer; from sailor_cli.worker import worker; typer.run(worker)"
    return subprocess.Popen([sys.executable, "-c", code, "--control", server.endpoint, "--vm-id", vm,
                             "--devices", str(devices), "--events-out", str(tmp_path / f"{vm}.events"),
                             "--run-dir", str(tmp_path / f"vm-{vm}"), "--log-uri", str(tmp_path / "logs"),
                             "--heartbeat", "0.5", "--grace", "20"], env=env)


def _events(tmp_path, vm: str) -> list[dict]:
    p = tmp_path / f"{vm}.events"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _wait_for(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_agents_run_one_rank_per_device_with_tp_inside_a_vm(tmp_path):
    server = ControlServer()
    try:
        settings = {"model": "gpt-tiny", "steps": 4, "timeout_s": 30, "plan_version": 0}
        # VM a: one device, stage 0; VM b: two devices, stage 1 with tp=2 inside it
        members = assign_generation(server, 0, plan=TP2_PLAN, settings=settings, resume=False,
                                    vms=[("a", 1, (0,)), ("b", 2, (1, 2))])
        assert members == ["a/0", "b/0", "b/1"]
        procs = [_agent(tmp_path, server, "a", 1), _agent(tmp_path, server, "b", 2)]
        assert [p.wait(timeout=240) for p in procs] == [0, 0]
        assert [server.get(status_key(0, w)) for w in members] == ["done"] * 3
        steps = [json.loads(x) for x in server.read_list(metrics_key(0))]
        assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[-1]["loss"] < steps[0]["loss"]
        assert steps[0]["world_size"] == 3
        for vm, n in (("a", 1), ("b", 2)):
            ev = _events(tmp_path, vm)
            assert ev[0]["event"] == "started" and len(ev[0]["workers"]) == n
            assert ev[-1]["event"] == "exited" and ev[-1]["status"] == "done"
            assert json.loads(server.get(f"hb/vm/{vm}"))["workers"]
        # the workers' logs were copied to the run's state folder
        assert (tmp_path / "logs" / "b" / "worker-1.log").read_text()
    finally:
        server.close()


def test_cancel_checkpoints_and_exits_cleanly(tmp_path):
    one = dict(PLAN, stages=[{"layers": [0, 5], "replicas": PLAN["stages"][0]["replicas"]}])
    ck = tmp_path / "ck"
    server = ControlServer()
    try:
        settings = {"model": "gpt-tiny", "steps": 10_000, "timeout_s": 30, "checkpoint_uri": str(ck)}
        assign_generation(server, 0, plan=one, settings=settings, resume=False, vms=[("a", 1, (0,))])
        p = _agent(tmp_path, server, "a", 1)
        _wait_for(lambda: len(server.read_list(metrics_key(0))) >= 2, 120)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
        ev = _events(tmp_path, "a")
        assert ev[-1]["event"] == "exited" and ev[-1]["status"] == "cancelled"
        steps = [d for d in os.listdir(ck) if d.startswith("step_")]
        assert steps and os.path.exists(ck / steps[-1] / "meta.json")  # the just-in-time checkpoint
    finally:
        server.close()


def test_the_controller_refuses_a_client_without_the_run_secret(tmp_path):
    server = ControlServer()
    try:
        server.set("g0/assign/a/0", "secret plan")
        for wrong in ("", "0" * 32):
            intruder = ControlClient(server.endpoint, wrong)
            with pytest.raises(ProtocolError, match="refused"):
                intruder.get("g0/assign/a/0")
            with pytest.raises(ProtocolError, match="refused"):
                intruder.set("g0/assign/a/0", "evil")
            with pytest.raises(ProtocolError, match="refused"):
                intruder.append("metrics/v0", "{}")
        assert server.get("g0/assign/a/0") == "secret plan" and server.read_list("metrics/v0") == []
        assert ControlClient(server.endpoint, server.secret).get("g0/assign/a/0") == "secret plan"
        # an agent started without the secret never gets work: its workers exit without training
        p = _agent(tmp_path, server, "x", 1, secret="wrong")
        assert p.wait(timeout=120) == 1
        assert server.get(status_key(0, "x/0")) is None
    finally:
        server.close()


def test_the_controller_binds_only_the_address_it_advertises():
    server = ControlServer(host="127.0.0.1")
    try:
        import socket

        s = socket.socket()
        s.settimeout(2)
        # 127.0.0.2 is loopback too, but not the bound address: nothing listens there
        with pytest.raises(OSError):
            s.connect(("127.0.0.2", server.port))
        s.close()
    finally:
        server.close()


def test_train_rejects_unrunnable_plan_before_starting(tmp_path, capsys):
    bad = json.loads(json.dumps(PLAN))
    bad["stages"][1]["replicas"][0]["gpu_type"] = "Z100"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    assert sailor_main(["train", str(path), "--model", "gpt-tiny", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "unknown GPU type 'Z100'" in err
