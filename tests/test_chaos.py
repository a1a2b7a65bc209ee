"""Chaos: faults injected into real runs on this machine, and what must survive each.

Each test injects one fault into a real `sailor` command (subprocess, the local provider or the
local launcher) and then checks: no process it started is left, no temporary folder is left, no
step is lost beyond the last valid checkpoint, the exit status and the run's status are true, and
every error is one line. Each prints `CHAOS <fault>: <what survived>` (run with -s to see them).
Bounded: every wait has a deadline; the whole module takes a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sailor_cli.lifeline import descendants
from sailor_core.runtime import checkpoint as ckpt
from tests.flow_fixtures import steps_trained
from tests.test_exit_codes import GPT_TINY_2_STAGES, _env, _ours_left, finish, start
from tests.waits import wait_for

pytest_plugins = ["tests.flow_fixtures"]
NUM_LAYERS = 6  # gpt-tiny's blocks: what checkpoints of GPT_TINY_2_STAGES record


@pytest.fixture
def demo_store(profiled_once, tmp_path):
    """The demo's store (`SAILOR_STORE` of `_env`) already holds gpt-tiny's cpu profile and the local
    link, as after a first demo: the demo measures nothing and the test's time goes to its fault."""
    shutil.copytree(profiled_once, tmp_path / "store")


def report(fault: str, survived: str) -> None:
    print(f"\nCHAOS {fault}: {survived}")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
    except OSError:  # ended meanwhile
        return ""


def _alive(pids: dict[int, int]) -> list[int]:
    from sailor_cli.lifeline import _same

    return [p for p, s in pids.items() if _same(p, s)]


def _steps(metrics: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in metrics.read_text().splitlines() if ln.strip()] if metrics.exists() else []


def _one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert "Traceback" not in err, err[-2000:]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


def _plan(tmp: Path) -> Path:
    p = tmp / "plan.json"
    p.write_text(json.dumps(GPT_TINY_2_STAGES))
    return p


def test_sigkill_of_a_worker(tmp_path):
    """A worker killed mid-run: the job shrinks to the survivor and finishes every step."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    p = start(tmp_path, "train", str(_plan(tmp_path)), "--steps", "30", "--checkpoint-dir", str(ck),
              "--checkpoint-every", "5", "--metrics-out", str(metrics))
    try:
        wait_for(lambda: len(_steps(metrics)) >= 7 or p.poll() is not None, 180, "seven steps")
        kids = descendants(p.pid)
        workers = [q for q in kids if "worker_proc" in Path(f"/proc/{q}/cmdline").read_text(errors="replace")]
        assert len(workers) == 2, kids
        os.kill(workers[1], signal.SIGKILL)
        killed_after = max(_steps(metrics))
        rc, out, err = finish(p, 300)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 0, (rc, out[-1500:], err[-1500:])
    assert "lost workers" in out and "done: " in out
    assert ckpt.latest_valid_step(ckpt.open_storage(str(ck)), NUM_LAYERS) == 30
    assert set(_steps(metrics)) == set(range(1, 31))
    wait_for(lambda: not _alive(kids), 20, "every process of the job to end")  # the guardian ends last
    assert _ours_left(tmp_path) == []
    report("SIGKILL of a worker", f"killed after step {killed_after}; the survivor finished 30/30 steps from the "
                                  f"last checkpoint; no process or temp folder left")


def test_corrupt_newest_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    plan = str(_plan(tmp_path))
    first = subprocess.run([sys.executable, "-m", "sailor_cli.main", "train", plan, "--steps", "20",
                            "--checkpoint-dir", str(ck), "--checkpoint-every", "10"], capture_output=True, text=True,
                           env=_env(tmp_path), timeout=300)
    assert first.returncode == 0, first.stderr[-1500:]
    newest = sorted((ck / "step_00000020").glob("layer_*"))[-1]
    newest.write_bytes(b"\0" * 64 + newest.read_bytes()[64:])
    metrics = tmp_path / "m.jsonl"
    p = subprocess.run([sys.executable, "-m", "sailor_cli.main", "train", plan, "--steps", "25",
                        "--checkpoint-dir", str(ck), "--resume", "--metrics-out", str(metrics)], capture_output=True,
                       text=True, env=_env(tmp_path), timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
    assert "checkpoint step 20 skipped" in p.stderr and "resuming from checkpoint step 10" in p.stdout
    assert _steps(metrics)[0] == 11 and _steps(metrics)[-1] == 25  # only the steps after the valid one repeat
    assert (ck / "quarantine" / "step_00000020" / newest.name).read_bytes()[:64] == b"\0" * 64  # kept as it was
    assert ckpt.latest_valid_step(ckpt.open_storage(str(ck)), NUM_LAYERS) == 25
    assert _ours_left(tmp_path) == []
    report("corrupt newest checkpoint", "resumed from step 10 (steps 11-20 repeated), step 20 quarantined "
                                        "byte-for-byte, finished at 25")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_disk_for_the_checkpoint_folder(tmp_path):
    """A 16 MiB tmpfs holds one 11 MiB checkpoint, not two: the second write fails with ENOSPC."""
    ck = tmp_path / "ck"
    ck.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(ck)], check=True)
    try:
        plan = str(_plan(tmp_path))
        first = tmp_path / "first.jsonl"
        p = subprocess.run([sys.executable, "-m", "sailor_cli.main", "train", plan, "--steps", "20",
                            "--checkpoint-dir", str(ck), "--checkpoint-every", "5", "--metrics-out", str(first)],
                           capture_output=True, text=True, env=_env(tmp_path), timeout=300)
        assert p.returncode == 1, (p.returncode, p.stdout[-1000:], p.stderr[-1500:])
        line = _one_line_error(p.stderr)
        assert "No space left" in line or "ENOSPC" in line or "space" in line, line
        storage = ckpt.open_storage(str(ck))
        assert ckpt.latest_valid_step(storage, NUM_LAYERS) == 5
        # step 10's write failed: no step after it committed, so the steps lost are one interval, not more
        assert _steps(first)[-1] == 10, _steps(first)
        assert not [f for f in ck.rglob("*") if ".tmp-" in f.name]  # no half-written files left
        # more room: --resume continues from the last valid step; the partial one is moved aside
        subprocess.run(["mount", "-o", "remount,size=96m", str(ck)], check=True)
        metrics = tmp_path / "m.jsonl"
        p = subprocess.run([sys.executable, "-m", "sailor_cli.main", "train", plan, "--steps", "12",
                            "--checkpoint-dir", str(ck), "--resume", "--metrics-out", str(metrics)],
                           capture_output=True, text=True, env=_env(tmp_path), timeout=300)
        assert p.returncode == 0, p.stderr[-1500:]
        assert _steps(metrics)[0] == 6 and ckpt.latest_valid_step(storage, NUM_LAYERS) == 12
    finally:
        subprocess.run(["umount", "-l", str(ck)], check=False)
    assert _ours_left(tmp_path) == []
    report("full disk (16 MiB tmpfs) for checkpoints", f"exit 1 with one line ({line[:90]}...); step 5 valid, no "
                                                         f"partial files; --resume went on from step 5")


GPT_TINY_2_REPLICAS = {**GPT_TINY_2_STAGES,
                       "stages": [{"layers": [0, 5], "replicas": GPT_TINY_2_STAGES["stages"][0]["replicas"] * 2}],
                       "pipelines": [{"microbatch_size": 4, "num_microbatches": 1}] * 2}


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_disk_with_two_replicas_ends_the_job(tmp_path):
    """One stage over two replicas: only replica 0 writes, so its ENOSPC is its own fault; its peer, in
    the step's all-reduce, must be woken (it once waited forever) and the command end with exit 1."""
    ck = tmp_path / "ck"
    ck.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(ck)], check=True)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(GPT_TINY_2_REPLICAS))
    try:
        p = start(tmp_path, "train", str(plan), "--steps", "30", "--checkpoint-dir", str(ck / "run"),
                  "--checkpoint-every", "5")
        kids: dict[int, int] = {}
        wait_for(lambda: bool(kids.update(descendants(p.pid)) or p.poll() is not None), 200, "the job's processes")
        rc, out, err = finish(p, 240)  # the peer's collective timeout is 60 s: no hang may outlast it much
    finally:
        if p.poll() is None:  # a hang: end the command (its guardian then ends the workers)
            p.terminate()
        subprocess.run(["umount", "-l", str(ck)], check=False)
    assert rc == 1, (rc, out[-1000:], err[-1500:])
    line = _one_line_error(err)
    assert "No space left" in line and "worker 0" in line, line
    wait_for(lambda: not _alive(kids), 30, "every process of the job to end")
    assert _ours_left(tmp_path) == []
    report("full disk (3 MiB tmpfs), 2 replicas", f"exit 1 with one line ({line[:90]}...); nothing left")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_workers_start(tmp_path, sig):
    """Ctrl-C (or SIGTERM) just after `started`: the workers are still importing torch and die of the
    forwarded SIGTERM before they can checkpoint. That is the user's stop, not a lost worker: the
    command once exited 1 ("worker 0 exited with code -15")."""
    p = start(tmp_path, "train", str(_plan(tmp_path)), "--steps", "2000")
    out_lines: list[str] = []
    try:
        assert p.stdout is not None
        for line in p.stdout:  # "run train-... (sailor runs show ...)", then "started 2 workers ..."
            out_lines.append(line)
            if not line.startswith("run "):
                break
        assert line.startswith("started"), out_lines
        kids = descendants(p.pid)
        p.send_signal(sig)
        rc, out, err = finish(p, 90)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 128 + sig, (rc, out[-800:], err[-1500:])
    assert "Traceback" not in err and "exited with code" not in err, err[-1500:]
    wait_for(lambda: not _alive(kids), 30, "every process of the job to end")
    assert _ours_left(tmp_path) == []
    report(f"{signal.Signals(sig).name} while workers start", f"exit {rc}; nothing left")


def _listening(pids: set[int]) -> list[str]:
    """Local addresses on which these processes listen (TCP), from `ss`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [ln.split()[3] for ln in out.splitlines() if any(f"pid={q}," in ln for q in pids)]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss")
def test_no_socket_of_a_training_job_listens_on_every_interface(tmp_path):
    """The controller, each rank-0 rendezvous store and gloo's pairs: loopback only under `sailor train`
    (the rendezvous store once listened on *:PORT, unauthenticated)."""
    metrics = tmp_path / "m.jsonl"
    p = start(tmp_path, "train", str(_plan(tmp_path)), "--steps", "2000", "--metrics-out", str(metrics))
    try:
        wait_for(lambda: len(_steps(metrics)) >= 2 or p.poll() is not None, 120, "two steps")
        pids = {p.pid, *descendants(p.pid)}
        addrs = _listening(pids)
    finally:
        p.terminate()
        finish(p, 90)
    assert addrs, "no listening socket found: the check would pass vacuously"
    wide = [a for a in addrs if not a.startswith("127.")]
    assert wide == [], addrs
    report("listening sockets of a training job", f"{len(addrs)} sockets, all on loopback")


def test_sigkill_of_the_demo_flow_process(tmp_path, demo_store):
    """`sailor demo` killed with SIGKILL: its ephemeral Prefect server and workers die with it, and the
    run is shown crashed once its lease expires."""
    work = tmp_path / "wd"
    env = {**_env(tmp_path), "SAILOR_LEASE_S": "6"}
    p = subprocess.Popen([sys.executable, "-m", "sailor_cli.main", "demo", "--steps", "2000", "--workers", "2",
                          "--workdir", str(work), "--isolation", "process"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env, cwd=Path(__file__).resolve().parent.parent)
    try:
        wait_for(lambda: steps_trained(work) or p.poll() is not None, 300, "the demo to train")
        assert p.poll() is None
        kids: dict[int, int] = {}

        def server_among_kids() -> bool:  # the ephemeral server is one of the demo's processes
            kids.update(descendants(p.pid))
            return any("uvicorn" in _cmdline(q) for q in kids)

        wait_for(server_among_kids, 60, "the demo's Prefect server among its processes")
        p.kill()
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    wait_for(lambda: not _alive(kids), 30, "the server and workers to die with the demo")

    def demo_runs() -> list[dict]:
        runs = subprocess.run([sys.executable, "-m", "sailor_cli.main", "runs", "list", "--json"],
                              capture_output=True, text=True, env=env, timeout=120)
        return [r for r in json.loads(runs.stdout) if r["name"] == "demo"]

    # the run is shown crashed once its 6 s lease has expired unrenewed
    demo = wait_for(lambda: (d := demo_runs()) and d[-1]["status"] == "crashed" and d, 90,
                    "the killed demo's run to be shown crashed")
    report("SIGKILL of the flow (sailor demo)", f"{len(kids)} descendant processes (server, agents, workers) ended "
                                                f"by the guardian; run {demo[-1]['run_id']} shown crashed")


def test_s3_server_stopped_during_checkpoint_writes_and_restarted(tmp_path):
    """Checkpoints go to S3 (rclone serve s3 over a folder); the server is stopped mid-run and started
    again on the same port 3 s later. The job either rides it out or fails in one line; either way
    --resume continues from the last valid checkpoint in the bucket."""
    from profiles_store.local_servers import LocalS3Server

    root = tmp_path / "s3"
    first = LocalS3Server(root=root)
    first.start()
    second = LocalS3Server(root=root)
    second.port = first.port
    try:
        first.create_bucket("chaos-ck")
        uri = first.uri("chaos-ck", "run")
        metrics = tmp_path / "m.jsonl"
        p = start(tmp_path, "train", str(_plan(tmp_path)), "--steps", "40", "--checkpoint-dir", uri,
                  "--checkpoint-every", "2", "--metrics-out", str(metrics), "--timeout", "20")
        try:
            wait_for(lambda: len(_steps(metrics)) >= 5 or p.poll() is not None, 180, "five steps")
            first.stop()
            outage_at = max(_steps(metrics))
            # the store comes back after 3 s, or once a checkpoint fell due while it was down
            down_until = time.monotonic() + 3.0
            while time.monotonic() < down_until and p.poll() is None and max(_steps(metrics)) < outage_at + 2:
                time.sleep(0.1)
            second.start()
            rc, out, err = finish(p, 300)
        finally:
            if p.poll() is None:
                p.kill()
        assert rc in (0, 1), (rc, err[-1500:])
        if rc == 1:
            line = _one_line_error(err)
        storage = ckpt.open_storage(uri)
        valid = ckpt.latest_valid_step(storage, NUM_LAYERS)
        assert valid is not None
        resumed = tmp_path / "m2.jsonl"
        p2 = subprocess.run([sys.executable, "-m", "sailor_cli.main", "train", str(_plan(tmp_path)), "--steps", "44",
                             "--checkpoint-dir", uri, "--resume", "--metrics-out", str(resumed)], capture_output=True,
                            text=True, env=_env(tmp_path), timeout=300)
        assert p2.returncode == 0, p2.stderr[-1500:]
        assert _steps(resumed)[0] == valid + 1 and _steps(resumed)[-1] == 44  # nothing lost past the checkpoint
    finally:
        second.stop()
        if first.proc is not None:
            first.stop()
    assert _ours_left(tmp_path) == []
    outcome = "rode out the outage" if rc == 0 else f"failed in one line ({line[:80]}...)"
    report("S3 server stopped during checkpoint writes, restarted 3 s later",
           f"outage at step {outage_at}: the job {outcome}; --resume went on from valid step {valid} to 44")


def test_price_feed_returning_garbage(tmp_path):
    """The AWS API (prices, offerings) answers garbage: one line and exit 1, and a dry run shows the
    price as unknown rather than $0."""
    import http.server
    import threading

    class Garbage(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            body = b"\x00\xffnot a price<<{{" * 8
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    env = {**_env(tmp_path), "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "1", "SAILOR_AWS_REGIONS": "us-east-1",
           "SAILOR_AWS_ENDPOINT_URL": f"http://127.0.0.1:{srv.server_address[1]}"}
    try:
        off = subprocess.run([sys.executable, "-m", "sailor_cli.main", "infra", "offerings", "--provider", "aws"],
                             capture_output=True, text=True, env=env, timeout=120)
        dry = subprocess.run([sys.executable, "-m", "sailor_cli.main", "infra", "provision", "--provider", "aws",
                              "--run", "chaos", "--zone", "us-east-1a", "--gpu-type", "A10G-24", "--dry-run"],
                             capture_output=True, text=True, env=env, timeout=120)
    finally:
        srv.shutdown()
        srv.server_close()
    assert off.returncode == 1, (off.returncode, off.stderr[-1500:])
    line = _one_line_error(off.stderr)
    assert "unreadable" in line
    assert dry.returncode == 0, dry.stderr[-1500:]
    assert "unknown price" in dry.stdout and "hourly cost: unknown" in dry.stdout
    report("price feed returning garbage", f"offerings: exit 1, one line ({line[:70]}...); provision --dry-run "
                                           f"shows the price as unknown, not $0")


def _demo(tmp: Path, work: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    (tmp / "plain.yaml").write_text("offerings:\n  - {market: on-demand, count: 4, usd_per_gpu_hour: 0.3}\n")
    return subprocess.Popen([sys.executable, "-m", "sailor_cli.main", "demo", "--scenario", str(tmp / "plain.yaml"),
                             "--workers", "2", "--workdir", str(work), "--isolation", "process", "--json", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or _env(tmp),
                            cwd=Path(__file__).resolve().parent.parent)


def _training(work: Path) -> bool:
    return steps_trained(work) > 0


def _agents_started(work: Path) -> list[dict]:
    """The records of the run's VMs whose agent has started its workers, read live from the agent's own
    log in the VM's folder. The run's state is no live signal: step records reach it every 10 s
    (steps.METRICS_FLUSH_S) and worker logs when an agent ends, so on a quiet machine a short run has
    finished before either shows."""
    recs = [json.loads(f.read_text()) for f in work.glob("runs/*/local/vms/*.json")]
    return [r for r in recs if r.get("pid") and r.get("slot") and any(
        '"event": "started"' in log.read_text(errors="replace") for log in Path(r["slot"]).glob("agent-v*.log"))]


def test_sigkill_of_an_agent(tmp_path, demo_store):
    """The agent of one VM (`sailor worker`, the process the local provider started) dies with SIGKILL:
    the flow sees the VM's worker lost, re-plans, and the demo completes every step, leaving nothing."""
    work = tmp_path / "wd"
    p = _demo(tmp_path, work, "--steps", "200")  # ~10 s of training: the kill lands while it trains
    try:
        wait_for(lambda: _agents_started(work) or p.poll() is not None, 300, "an agent to start its workers")
        assert p.poll() is None, finish(p)
        agent = _agents_started(work)[0]
        os.kill(int(agent["pid"]), signal.SIGKILL)
        kids = descendants(p.pid)
        rc, out, err = finish(p, 400)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 0, (rc, out[-1500:], err[-1500:])
    run = json.loads(out[out.index("{\n"):])
    assert run["status"] == "completed" and run["steps_done"] == 200 and run["processes_left"] == []
    assert any(e["kind"] == "lost" for e in run["events"]), [e["kind"] for e in run["events"]]
    wait_for(lambda: not _alive(kids), 30, "every process of the demo to end")
    report("SIGKILL of an agent", f"VM {agent['vm_id']} lost; the run re-planned and completed 200/200 steps; "
                                  f"no process left")


def test_sigterm_of_the_demo(tmp_path, demo_store):
    """SIGTERM (as a Prefect cancellation or `kill` sends) stops the demo after its cleanup: exit 143, the
    run recorded cancelled, the ephemeral server and every worker gone."""
    work = tmp_path / "wd"
    p = _demo(tmp_path, work, "--steps", "3000")
    try:
        wait_for(lambda: _training(work) or p.poll() is not None, 300, "the demo to train")
        assert p.poll() is None, finish(p)
        kids = descendants(p.pid)
        p.send_signal(signal.SIGTERM)
        rc, out, err = finish(p, 180)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 143, (rc, out[-800:], err[-1500:])
    assert "interrupted by SIGTERM" in err
    wait_for(lambda: not _alive(kids), 30, "the server and workers to end")
    runs = subprocess.run([sys.executable, "-m", "sailor_cli.main", "runs", "list", "--json"], capture_output=True,
                          text=True, env=_env(tmp_path), timeout=120)
    demo = [r for r in json.loads(runs.stdout) if r["name"] == "demo"]
    assert demo and demo[-1]["status"] == "cancelled", demo
    report("SIGTERM of sailor demo", f"exit 143 after cleanup; run {demo[-1]['run_id']} cancelled; "
                                     f"{len(kids)} processes ended")
