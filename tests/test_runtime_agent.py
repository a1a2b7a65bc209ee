"""`sailor worker` agent across two 'VMs' and on cancel; `sailor train` rejects bad plans up front."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from sailor_cli.main import main as sailor_main

PLAN = {"format": "sailor-plan", "version": 1, "model": "gpt-tiny", "global_batch_size": 8,
        "stages": [{"layers": [0, 2], "replicas": [{"gpu_type": "cpu", "gpus_per_node": 2, "zone": "local", "tp": 1}]},
                   {"layers": [3, 5], "replicas": [{"gpu_type": "cpu", "gpus_per_node": 2, "zone": "local", "tp": 1}]}],
        "pipelines": [{"microbatch_size": 2, "num_microbatches": 4}]}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(tmp_path, vm: str, assignment: dict) -> subprocess.Popen:
    path = tmp_path / f"{vm}.json"
    path.write_text(json.dumps(assignment))
    code = "import sys, typer; from sailor_cli.worker import worker; typer.run(worker)"
    return subprocess.Popen([sys.executable, "-c", code, "--assignment", str(path), "--vm-id", vm,
                             "--events-out", str(tmp_path / f"{vm}.events"), "--run-dir", str(tmp_path / f"run-{vm}"),
                             "--heartbeat", "0.5", "--grace", "20"])


def _events(tmp_path, vm: str) -> list[dict]:
    p = tmp_path / f"{vm}.events"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def test_two_agents_run_one_job_and_report(tmp_path):
    settings = {"model": "gpt-tiny", "steps": 4, "timeout_s": 30, "metrics_out": str(tmp_path / "m.jsonl")}
    rdv = {"host": "127.0.0.1", "port": _free_port()}
    procs = [_agent(tmp_path, vm, {"plan_version": 0, "plan": PLAN, "settings": settings, "ranks": ranks,
                                   "rendezvous": rdv}) for vm, ranks in (("a", [0]), ("b", [1]))]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    for vm in ("a", "b"):
        ev = _events(tmp_path, vm)
        kinds = [e["event"] for e in ev]
        assert kinds[0] == "assigned" and kinds[-1] == "exited" and ev[-1]["status"] == "done"
        assert "heartbeat" in kinds
        steps = [e["step"] for e in ev if e["event"] == "metrics"]
        assert steps == [1, 2, 3, 4]
        assert all(e["iteration_time_s"] > 0 and e["memory_bytes"] > 0 for e in ev if e["event"] == "metrics")
        assert [e["status"] for e in ev if e["event"] == "status"] == ["done"]
    losses = [e["loss"] for e in _events(tmp_path, "b") if e["event"] == "metrics"]
    assert losses[-1] < losses[0]  # the last stage (VM b) computes the loss


def test_cancel_checkpoints_and_exits_cleanly(tmp_path):
    one = dict(PLAN, stages=[{"layers": [0, 5], "replicas": PLAN["stages"][0]["replicas"]}])
    ck = tmp_path / "ck"
    settings = {"model": "gpt-tiny", "steps": 10_000, "timeout_s": 30, "checkpoint_dir": str(ck)}
    p = _agent(tmp_path, "a", {"plan_version": 0, "plan": one, "settings": settings, "ranks": [0],
                               "rendezvous": {"host": "127.0.0.1", "port": _free_port()}})
    deadline = time.monotonic() + 120
    while sum(e["event"] == "metrics" for e in _events(tmp_path, "a")) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 0
    ev = _events(tmp_path, "a")
    assert ev[-1]["event"] == "exited" and ev[-1]["status"] in ("cancelled", "stopped")
    steps = [d for d in os.listdir(ck) if d.startswith("step_")]
    assert steps and os.path.exists(ck / steps[-1] / "meta.json")  # the just-in-time checkpoint


def test_train_rejects_unrunnable_plan_before_starting(tmp_path, capsys):
    bad = json.loads(json.dumps(PLAN))
    bad["stages"][1]["replicas"][0]["gpu_type"] = "Z100"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    t0 = time.monotonic()
    assert sailor_main(["train", str(path), "--model", "gpt-tiny", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "unknown GPU type 'Z100'" in err and time.monotonic() - t0 < 5
