"""Resume never starts over by accident; invalid checkpoints are moved aside, never deleted or overwritten.

Checkpoint level (fast): `resume_point` quarantines every invalid checkpoint above the one it
resumes from, with the reason; retention removes a step only below a newer valid one. Command
level: `sailor train --resume` with only corrupt checkpoints fails (exit 2) naming each skipped
step and keeps their files; `--resume-or-start` starts from step 0 without writing over them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sailor_core.runtime import checkpoint as ckpt
from sailor_core.runtime.checkpoint_writer import AsyncCheckpointer
from tests.paths import REPO

pytest_plugins = ["tests.flow_fixtures"]


def _state(v: float):
    import torch

    t = torch.full((2, 2), float(v))
    return {"tp": 1, "tp_rank": 0, "shard_dims": {"w": None}, "params": {"w": t}, "exp_avg": {"w": t * 0},
            "exp_avg_sq": {"w": t * 0}}


def _save(w: AsyncCheckpointer, step: int, layers=(0, 1)) -> None:
    w.save(step, {i: _state(step) for i in layers}, "part_s0_t0.json", {"num_layers": 2, "step": step}, blocking=True)


def _corrupt(root, step: int) -> None:
    with open(root / ckpt.step_dir(step) / "layer_0001.tp0of1.pt", "r+b") as f:
        f.seek(40)
        f.write(b"garbage")


def test_resume_point_quarantines_invalid_newer_checkpoints_with_their_reason(tmp_path):
    storage = ckpt.open_storage(str(tmp_path))
    w = AsyncCheckpointer(storage, keep_last=10)
    for step in (1, 2, 3):
        _save(w, step)
    _corrupt(tmp_path, 3)
    os.remove(tmp_path / "step_00000002" / "meta.json")
    step, skipped = ckpt.resume_point(storage, 2)
    assert step == 1
    assert [s.step for s in skipped] == [3, 2]
    assert "corrupt" in skipped[0].reason and "incomplete" in skipped[1].reason
    assert ckpt.list_steps(storage) == [1]  # nothing above the resume step: a new run cannot overwrite them
    q = json.loads((tmp_path / "quarantine" / "step_00000003" / "QUARANTINED.json").read_text())
    assert q["step"] == 3 and "corrupt" in q["reason"]
    assert (tmp_path / "quarantine" / "step_00000003" / "layer_0000.tp0of1.pt").exists()
    # the same step quarantined twice keeps both copies
    _save(w, 3)
    _corrupt(tmp_path, 3)
    ckpt.resume_point(storage, 2)
    assert (tmp_path / "quarantine" / "step_00000003.1" / "QUARANTINED.json").exists()
    assert "step 3" in skipped[0].line() and "quarantine/step_00000003" in skipped[0].line()


def test_resume_point_with_nothing_valid_reports_every_step(tmp_path):
    storage = ckpt.open_storage(str(tmp_path))
    w = AsyncCheckpointer(storage, keep_last=10)
    for step in (10, 20):
        _save(w, step)
        _corrupt(tmp_path, step)
    step, skipped = ckpt.resume_point(storage, 2)
    assert step is None and [s.step for s in skipped] == [20, 10]
    msg = str(ckpt.no_resume_error(str(tmp_path), skipped))
    assert "step 20" in msg and "step 10" in msg and "--resume-or-start" in msg and "\n" not in msg
    assert "no checkpoint" in str(ckpt.no_resume_error(str(tmp_path), []))


def test_retention_keeps_the_last_valid_checkpoint_when_newer_ones_are_invalid(tmp_path):
    """Steps 3 and 4 lack layer 1 (a writer that failed): the valid steps 1 and 2 must survive pruning."""
    storage = ckpt.open_storage(str(tmp_path))
    w = AsyncCheckpointer(storage, keep_last=2)
    _save(w, 1)
    _save(w, 2)
    _save(w, 3, layers=(0,))
    _save(w, 4, layers=(0,))
    assert ckpt.latest_valid_step(storage, 2) == 2
    _save(w, 5)  # valid again: now the old ones may go, down to keep_last
    assert ckpt.list_steps(storage) == [4, 5]
    # step 3 was invalid (not incomplete): moved aside, not deleted
    assert (tmp_path / "quarantine" / "step_00000003" / "QUARANTINED.json").exists()
    assert not (tmp_path / "quarantine" / "step_00000001").exists()


def test_retention_quarantines_an_old_corrupt_checkpoint_instead_of_deleting_it(tmp_path):
    storage = ckpt.open_storage(str(tmp_path))
    w = AsyncCheckpointer(storage, keep_last=2)
    _save(w, 1)
    _corrupt(tmp_path, 1)
    _save(w, 2)
    _save(w, 3)
    assert ckpt.list_steps(storage) == [2, 3]
    assert (
        "corrupt" in json.loads((tmp_path / "quarantine" / "step_00000001" / "QUARANTINED.json").read_text())["reason"]
    )


def _train(tmp_path, *argv: str) -> subprocess.CompletedProcess[str]:
    from tests.test_exit_codes import GPT_TINY_2_STAGES

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(GPT_TINY_2_STAGES))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "sailor_cli.main", "train", str(plan), *argv], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=300)


def test_train_resume_with_only_corrupt_checkpoints_fails_and_keeps_them(tmp_path):
    ck = tmp_path / "ck"
    first = _train(tmp_path, "--steps", "20", "--checkpoint-dir", str(ck), "--checkpoint-every", "10")
    assert first.returncode == 0, first.stderr[-1500:]
    for step in (10, 20):
        f = sorted((ck / ckpt.step_dir(step)).glob("layer_*"))[0]
        f.write_bytes(f.read_bytes()[:50])
    p = _train(tmp_path, "--steps", "30", "--checkpoint-dir", str(ck), "--resume")
    assert p.returncode == 2, (p.returncode, p.stdout[-800:], p.stderr[-800:])
    assert "Traceback" not in p.stderr and "started" not in p.stdout
    err = p.stderr
    assert "checkpoint step 20 skipped" in err and "checkpoint step 10 skipped" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: --resume found no valid checkpoint") and "--resume-or-start" in last
    kept = {q.name for q in (ck / "quarantine").iterdir()}
    assert kept == {"step_00000010", "step_00000020"}
    # an explicit --resume-or-start starts at step 0 and leaves the quarantined files as they were
    sizes = {f: f.stat().st_size for f in (ck / "quarantine").rglob("*") if f.is_file()}
    p = _train(tmp_path, "--steps", "10", "--checkpoint-dir", str(ck), "--resume-or-start")
    assert p.returncode == 0, p.stderr[-1500:]
    assert "starting at step 0" in p.stdout and "done: 10 steps" in p.stdout
    assert {f: f.stat().st_size for f in (ck / "quarantine").rglob("*") if f.is_file()} == sizes
    assert ckpt.latest_valid_step(ckpt.open_storage(str(ck)), 6) == 10


@pytest.mark.usefixtures("prefect_harness")
def test_flow_resume_with_only_corrupt_checkpoints_fails_and_records_each(profiled_store, tmp_path):
    from flows.sailor import sailor
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    args = dict(run_name="rz", model="gpt-tiny", global_batch_size=8, objective="max-throughput", provider="local",
                workers=2, max_gpus=2, steps=8, checkpoint_interval=4, store_uri=profiled_store,
                workdir=str(tmp_path / "work"), isolation="process")
    first = sailor(**args, return_state=True)
    assert first.is_completed(), first.message
    steps = sorted((tmp_path / "work").glob("runs/rz-*/**/step_000000*"))
    assert steps
    for d in steps:
        f = sorted(d.glob("layer_*"))[0]
        f.write_bytes(f.read_bytes()[:50])
    second = sailor(**args, resume=True, return_state=True)
    assert second.is_failed()
    h = RunHistory(open_store(profiled_store))
    run = h.show([r for r in h.list_runs() if r["name"] == "rz"][-1]["run_id"])
    skipped = [e for e in run["events"] if e["kind"] == "checkpoint_skipped"]
    # each checkpoint the first run left is named: at its end only its newest valid one stays (tasks/retention.py)
    left = {int(d.name.split("_")[1]) for d in steps}
    assert 8 in left and {e["step"] for e in skipped} == left, run["events"]
    assert run["status"] == "failed" and "no valid checkpoint" in run["status_reason"]
    assert "provisioned" not in [e["kind"] for e in run["events"]]  # failed before renting anything
    third = sailor(**args, resume=True, resume_or_start=True, return_state=True)
    assert third.is_completed(), third.message


@pytest.mark.usefixtures("prefect_harness")
def test_flow_resume_of_a_completed_job_checks_its_checkpoint_then_rents_nothing(profiled_store, tmp_path):
    """A plain resume of a job that trained every step is decided on its checkpoint (valid, at the last step),
    not on the history alone, and ends renting nothing (the schedule's resume_or_start is decided on the history:
    tests/test_deployment_rerun.py)."""
    from flows.sailor import sailor
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    args = dict(run_name="rd", model="gpt-tiny", global_batch_size=8, objective="max-throughput", provider="local",
                workers=2, max_gpus=2, steps=8, checkpoint_interval=4, store_uri=profiled_store,
                workdir=str(tmp_path / "work"), isolation="process")
    assert sailor(**args, return_state=True).is_completed()
    second = sailor(**args, resume=True, return_state=True)
    assert second.is_completed(), second.message
    h = RunHistory(open_store(profiled_store))
    run = h.show(second.result()["run_id"])
    said = [e["reason"] for e in run["events"] if e["kind"] == "nothing_to_do"]
    assert said and "is at step 8" in said[0] and "rented nothing" in said[0], run["events"]
    assert "provisioned" not in [e["kind"] for e in run["events"]]
    assert not list((tmp_path / "work" / "runs" / run["run_id"] / "local" / "vms").glob("*.json"))
