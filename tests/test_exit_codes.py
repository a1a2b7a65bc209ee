"""Every command's exit status tells the truth: 0 success, 2 user error (one line), 1 failure, 128+signal
when interrupted (after cleanup). One test per command group, through the real entry point in a
subprocess (`python -m sailor_cli.main`), so what a shell sees is what is checked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.paths import REPO
from tests.waits import wait_for

GPT_TINY_2_STAGES = {
    "format": "sailor-plan", "version": 1, "model": "gpt-tiny", "global_batch_size": 8, "precision": "fp32",
    "schedule": "1f1b",
    "stages": [{"layers": [0, 2], "replicas": [{"gpu_type": "cpu", "gpus_per_node": 1, "market": "on-demand",
                                                "region": "local", "tp": 1, "zone": "local"}]},
               {"layers": [3, 5], "replicas": [{"gpu_type": "cpu", "gpus_per_node": 1, "market": "on-demand",
                                                "region": "local", "tp": 1, "zone": "local"}]}],
    "pipelines": [{"microbatch_size": 2, "num_microbatches": 4}],
}


def _env(tmp: Path) -> dict[str, str]:
    # a private TMPDIR shows whether the command left a temporary folder behind
    (tmp / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp / "tmp"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "SAILOR_STORE": str(tmp / "store"), "PREFECT_HOME": str(tmp / "prefect")}


def sailor(tmp: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sailor_cli.main", *argv], capture_output=True, text=True,
                          cwd=REPO, env=_env(tmp), timeout=timeout)


def start(tmp: Path, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "sailor_cli.main", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(tmp))


def one_line_error(p: subprocess.CompletedProcess[str] | tuple[int, str, str]) -> str:
    err = p.stderr if isinstance(p, subprocess.CompletedProcess) else p[2]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "to fix" in lines[0], err
    return lines[0]


def finish(p: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return p.returncode, out, err


def _ours_left(tmp: Path) -> list[str]:
    # torch keeps its compile cache (torchinductor_*) in TMPDIR; that one is not ours
    return [x.name for x in (tmp / "tmp").iterdir() if x.name.startswith("sailor")]


# -- demo -----------------------------------------------------------------------------------------
def test_demo_with_invalid_parameters_is_a_user_error(tmp_path):
    p = sailor(tmp_path, "demo", "--workers", "0", "--steps", "5", "--workdir", str(tmp_path / "wd"))
    assert p.returncode == 2, (p.returncode, p.stdout[-800:], p.stderr[-800:])
    assert "workers" in one_line_error(p)


def test_demo_whose_flow_fails_exits_1_and_reports_its_own_run(tmp_path):
    """The flow fails (the scenario offers nothing): exit 1 and this run's status, not another's."""
    (tmp_path / "none.yaml").write_text("offerings:\n  - {market: spot, count: 0, usd_per_gpu_hour: 0.1}\n")
    p = sailor(tmp_path, "demo", "--steps", "5", "--scenario", str(tmp_path / "none.yaml"),
               "--workdir", str(tmp_path / "wd"), "--json", timeout=240)
    assert p.returncode == 1, (p.returncode, p.stdout[-1500:], p.stderr[-1500:])
    doc = json.loads(p.stdout[p.stdout.index("{\n"):])
    assert doc["status"] == "failed" and "offers no GPUs" in doc["status_reason"]


# -- plan -----------------------------------------------------------------------------------------
def test_plan_interrupted_by_sigint_exits_130_and_writes_no_plan(tmp_path):
    """The pool file is a FIFO nobody writes, so the command is reliably busy when SIGINT lands."""
    fifo = tmp_path / "pool.json"
    os.mkfifo(fifo)
    out = tmp_path / "plan.json"
    p = start(tmp_path, "plan", "--pool", str(fifo), "--model", "OPT-350", "--global-batch-size", "8",
              "--out", str(out))
    try:
        wait_for(lambda: Path(f"/proc/{p.pid}/wchan").read_text().strip() in ("wait_for_partner", "fifo_open")
                 or p.poll() is not None, 60, "plan to open its pool file")
        assert p.poll() is None
        p.send_signal(signal.SIGINT)
        rc, _, err = finish(p, 60)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 130, (rc, err)
    assert "interrupted by SIGINT" in err and "Traceback" not in err
    assert not out.exists()


def test_plan_user_error_and_infeasible(tmp_path):
    (tmp_path / "pool.yaml").write_text("zones: [unclosed\n")
    p = sailor(tmp_path, "plan", "--pool", str(tmp_path / "pool.yaml"), "--model", "OPT-350",
               "--global-batch-size", "8")
    assert p.returncode == 2, p.stderr
    assert "pool" in one_line_error(p)


def test_plan_over_gpu_types_without_profiles_is_input_to_fix_with_the_whole_command(tmp_path):
    # A pool of H100-80 only (no profile of OPT-350 on it) exited 1 as if infeasible, and the fix left out
    # --gpu-type and --device; a mixed pool is planned over the types that have profiles, naming the others.
    h100 = "      H100-80: {count: 8, gpus_per_vm: 8, usd_per_gpu_hour: 4.0}\n"
    (tmp_path / "h100.yaml").write_text("zones:\n  us-east-1a:\n    region: us-east-1\n    gpus:\n" + h100)
    p = sailor(tmp_path, "plan", "--pool", str(tmp_path / "h100.yaml"), "--model", "OPT-350",
               "--global-batch-size", "64")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "sailor profile model --model OPT-350 --gpu-type H100-80 --device cuda" in " ".join(p.stdout.split())
    (tmp_path / "mixed.yaml").write_text("zones:\n  us-east-1a:\n    region: us-east-1\n    gpus:\n" + h100
                                         + "      A100-40: {count: 8, usd_per_gpu_hour: 2.0}\n")
    p = sailor(tmp_path, "plan", "--pool", str(tmp_path / "mixed.yaml"), "--model", "OPT-350",
               "--global-batch-size", "64", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert {r["gpu_type"] for st in doc["plan"]["stages"] for r in st["replicas"]} == {"A100-40"}
    assert "H100-80 has no profile for OPT-350" in json.dumps(doc)


# -- profile --------------------------------------------------------------------------------------
def test_profile_interrupted_by_sigint_exits_130_and_stores_nothing(tmp_path):
    store = tmp_path / "pstore"
    # every block and large microbatches: the measurement outlasts the wait below on a quiet machine too
    p = start(tmp_path, "profile", "model", "--model", "gpt-tiny", "--mbs", "1,2,4,8,16,32,64", "--all-blocks",
              "--store", str(store))
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: p.stderr.read(64), "")), daemon=True)
    reader.start()
    try:
        # the progress bar goes to stderr once measuring started: interrupt it there
        wait_for(lambda: "mbs=" in "".join(chunks) or p.poll() is not None, 180, "the measurement to start")
        assert p.poll() is None, "".join(chunks)[-1500:]
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=60)
        reader.join(timeout=30)
        err = "".join(chunks)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 130, (rc, err[-1500:])
    assert "interrupted by SIGINT" in err and "Traceback" not in err
    listed = sailor(tmp_path, "profiles", "list", "--store", str(store), "--json")
    assert listed.returncode == 0
    assert not [r for r in json.loads(listed.stdout) if r["model"] == "gpt-tiny"]


# -- train ----------------------------------------------------------------------------------------
def test_train_stopped_by_sigterm_exits_143_after_checkpointing(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(GPT_TINY_2_STAGES))
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    p = start(tmp_path, "train", str(plan), "--steps", "500", "--checkpoint-dir", str(ck),
              "--metrics-out", str(metrics))
    try:
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 3 or p.poll() is not None, 120,
                 "three training steps")
        assert p.poll() is None, finish(p)
        p.send_signal(signal.SIGTERM)
        rc, out, err = finish(p, 90)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 143, (rc, out[-800:], err[-800:])
    assert "stopped by SIGTERM" in err and "--resume" in err and "Traceback" not in err
    from sailor_core.runtime import checkpoint as ckpt

    last = max(json.loads(ln)["step"] for ln in metrics.read_text().splitlines() if ln.strip())
    assert ckpt.latest_valid_step(ckpt.open_storage(str(ck)), 6) == last  # no step lost
    assert _ours_left(tmp_path) == []  # no sailor-train-* folder left behind


def test_train_leaves_no_temporary_folder(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(GPT_TINY_2_STAGES))
    p = sailor(tmp_path, "train", str(plan), "--steps", "2")
    assert p.returncode == 0, p.stderr[-1500:]
    assert "done: 2 steps" in p.stdout
    assert _ours_left(tmp_path) == []


@pytest.mark.parametrize("content", ["[1,2,3]", "null", "DIR"])
@pytest.mark.parametrize("command", ["simulate", "train"])
def test_plan_file_that_is_no_plan_object_is_one_line(tmp_path, command, content):
    path = tmp_path / "plan.json"
    if content == "DIR":
        path.mkdir()
    else:
        path.write_text(content)
    argv = [command, str(path)] + (["--steps", "2"] if command == "train" else [])
    p = sailor(tmp_path, *argv)
    assert p.returncode == 2, (p.returncode, p.stderr[-1500:])
    assert str(path) in one_line_error(p)


def test_train_refuses_a_model_other_than_the_plans(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(GPT_TINY_2_STAGES))
    p = sailor(tmp_path, "train", str(plan), "--model", "gpt-small", "--steps", "2")
    assert p.returncode == 2, p.stderr[-1500:]
    line = one_line_error(p)
    assert "gpt-tiny" in line and "gpt-small" in line
    assert "started" not in p.stdout


@pytest.mark.parametrize("flag", [("--lr", "-1"), ("--timeout", "0")])
def test_train_refuses_bad_settings_before_workers_start(tmp_path, flag):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(GPT_TINY_2_STAGES))
    p = sailor(tmp_path, "train", str(plan), "--steps", "2", *flag)
    assert p.returncode == 2, p.stderr[-1500:]
    assert flag[0] in one_line_error(p)
    assert "started" not in p.stdout


# -- runs -----------------------------------------------------------------------------------------
def test_runs_show_unknown_id_is_a_user_error(tmp_path):
    p = sailor(tmp_path, "runs", "show", "nope-123")
    assert p.returncode == 2
    one_line_error(p)


def test_plan_refuses_an_absurd_global_batch_without_confirmation(tmp_path):
    (tmp_path / "pool.json").write_text(json.dumps({"zones": {"us-central1-a": {"gpus": {"A100-40": {
        "count": 8, "gpus_per_node": 4, "usd_per_gpu_hour": 3.67}}}}}))
    for batch in ("1000000000000", str(10**26)):
        p = sailor(tmp_path, "plan", "--pool", str(tmp_path / "pool.json"), "--model", "OPT-350",
                   "--global-batch-size", batch, "--json")
        assert p.returncode == 2, (p.returncode, p.stderr[-800:])
        assert "--large-batch" in one_line_error(p)


def test_plan_for_a_model_without_profiles_names_the_store_not_the_published_data(tmp_path):
    (tmp_path / "pool.json").write_text(json.dumps({"zones": {"us-central1-a": {"gpus": {"A100-40": {
        "count": 8, "gpus_per_node": 4, "usd_per_gpu_hour": 3.67}}}}}))
    p = sailor(tmp_path, "plan", "--pool", str(tmp_path / "pool.json"), "--model", "gpt-small",
               "--global-batch-size", "8")
    assert p.returncode == 2
    line = one_line_error(p)
    assert "published data was not found" not in line and "store" in line


# -- infra ----------------------------------------------------------------------------------------
def _unreachable_cloud(tmp: Path) -> dict[str, str]:
    # port 9 (discard) on loopback: nothing listens, so every API call is refused at once
    return {**_env(tmp), "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_EC2_METADATA_DISABLED": "true", "SAILOR_AWS_ENDPOINT_URL": "http://127.0.0.1:9",
            "SAILOR_AWS_REGIONS": "us-east-1", "SAILOR_GCP_PROJECT": "p", "SAILOR_GCE_ENDPOINT": "http://127.0.0.1:9",
            "SAILOR_GCP_REGIONS": "us-central1", "AWS_MAX_ATTEMPTS": "1"}


@pytest.mark.parametrize("argv", [
    ["infra", "offerings", "--provider", "aws"],
    ["infra", "cleanup", "--provider", "aws", "--dry-run"],
    ["infra", "cleanup", "--provider", "gcp", "--dry-run"],
    ["infra", "offerings", "--provider", "gcp"],
])
def test_infra_with_the_cloud_unreachable_is_one_line_and_a_failure(tmp_path, argv):
    p = subprocess.run([sys.executable, "-m", "sailor_cli.main", *argv], capture_output=True, text=True, cwd=REPO,
                       env=_unreachable_cloud(tmp_path), timeout=120)
    assert p.returncode == 1, (p.returncode, p.stdout[-500:], p.stderr[-1500:])
    assert "cannot reach the cloud" in one_line_error(p)


def test_provision_dry_run_never_shows_an_unknown_price_as_zero(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "sailor_cli.main",
            "infra",
            "provision",
            "--provider",
            "aws",
            "--run",
            "r1",
            "--zone",
            "us-east-1a",
            "--gpu-type",
            "A10G-24",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_unreachable_cloud(tmp_path),
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-1500:]
    assert "$0.0000/h" not in p.stdout.split("hourly cost")[0].splitlines()[-1]
    assert "unknown price" in p.stdout and "hourly cost: unknown" in p.stdout


def test_flow_parameters_refuse_an_absurd_batch_or_one_past_the_token_budget():
    from flows.params import InvalidParameters, validate_params

    with pytest.raises(InvalidParameters, match="large_batch"):
        validate_params({"steps": 5, "global_batch_size": 10**12})
    with pytest.raises(InvalidParameters, match="token budget"):
        validate_params({"token_budget": 100, "global_batch_size": 1000})
    assert validate_params({"steps": 5, "global_batch_size": 10**6, "large_batch": True}).large_batch
