"""Every path the CLI writes is a regular file or a new path; nothing else is replaced (issue 44, items 8, 20).

`sailor plan --out /dev/full` exited 0 and left /dev/full a regular file: the plan was written to a
temporary file and renamed over the target, whatever it was. As root any path was at risk. Here the
targets are made in the test's own folder (a character device like /dev/full where the test runs as
root, a FIFO, a folder, links to them): each is refused with one line before any work, and is still
what it was. Parallel writers of one plan file each write their own temporary file (it was one fixed
`<path>.tmp`, so one writer renamed the other's half-written file or found it gone). A dangling
symbolic link as `--checkpoint-dir` passed the early check and failed only in the workers.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sailor_core.domain import Market, ParallelPlan, PipelineBatch, Replica, Stage
from sailor_core.errors import SailorError
from sailor_core.files import check_output_file, write_atomic
from sailor_core.plan_format import load_plan_file, save_plan_file
from tests.paths import PUBLISHED_DATA, REPO

POOL = REPO / "tests" / "hostile" / "pool" / "ok-small.yaml"


def _sailor(tmp: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmp), "SAILOR_STORE": str(tmp / "store"), "PREFECT_HOME": str(tmp / "p")}
    return subprocess.run([sys.executable, "-m", "sailor_cli.main", *argv], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)


def _one_line(p: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "to fix" in lines[0], (p.returncode, p.stderr[-1500:])
    return lines[0]


def _targets(tmp: Path) -> dict[str, Path]:
    """Things at a path that are not regular files: made here, never the machine's own."""
    out: dict[str, Path] = {}
    if os.geteuid() == 0:  # a character device like /dev/full (1, 7)
        out["device"] = tmp / "full"
        os.mknod(out["device"], stat.S_IFCHR | 0o666, os.makedev(1, 7))
        out["link to a device"] = tmp / "link-to-device"
        out["link to a device"].symlink_to(out["device"])
    out["fifo"] = tmp / "fifo"
    os.mkfifo(out["fifo"])
    out["folder"] = tmp / "folder"
    out["folder"].mkdir()
    out["link to a folder"] = tmp / "link-to-folder"
    out["link to a folder"].symlink_to(out["folder"])
    out["dangling link"] = tmp / "dangling"
    out["dangling link"].symlink_to(tmp / "nowhere")
    return out


def _kind(p: Path) -> int:
    return stat.S_IFMT(os.lstat(p).st_mode)


def test_plan_out_refuses_a_device_a_fifo_a_folder_and_links_and_leaves_them_as_they_were(tmp_path):
    (tmp_path / "t").mkdir()
    targets = _targets(tmp_path / "t")
    before = {name: _kind(p) for name, p in targets.items()}
    for name, path in targets.items():
        p = _sailor(tmp_path, "plan", "--pool", str(POOL), "--model", "OPT-350", "--global-batch-size", "64",
                    "--store", str(PUBLISHED_DATA), "--out", str(path))
        line = _one_line(p)
        assert "--out" in line and "searched" not in p.stdout, (name, line)
        assert _kind(path) == before[name], f"{name} was replaced"
    assert not list((tmp_path / "t").glob("*.tmp")) and not list((tmp_path / "t").glob(".*.tmp"))


def test_plan_out_writes_a_new_file_and_replaces_a_regular_one(tmp_path):
    out = tmp_path / "plan.json"
    for _ in range(2):  # new, then replaced
        p = _sailor(tmp_path, "plan", "--pool", str(POOL), "--model", "OPT-350", "--global-batch-size", "64",
                    "--store", str(PUBLISHED_DATA), "--out", str(out))
        assert p.returncode == 0, p.stderr[-1500:]
        assert load_plan_file(out).model == "OPT-350"
    assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith(("plan", ".plan"))) == ["plan.json"]


@pytest.mark.parametrize("flag", ["--save-trace", "--timeline-png"])
def test_replay_outputs_refuse_what_is_not_a_regular_file(tmp_path, flag):
    target = tmp_path / "folder"
    target.mkdir()
    p = _sailor(tmp_path, "replay", "--trace", str(REPO / "tests/hostile/trace/ok-two-points.json"), "--model",
                "OPT-350", "--global-batch-size", "64", "--steps", "20", "--store", str(PUBLISHED_DATA), flag,
                str(target))
    assert flag in _one_line(p)
    assert target.is_dir()


def test_frontier_png_refuses_a_fifo(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    p = _sailor(tmp_path, "plan", "--pool", str(POOL), "--model", "OPT-350", "--global-batch-size", "64",
                "--store", str(PUBLISHED_DATA), "--frontier-png", str(fifo))
    assert "--frontier-png" in _one_line(p)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def _plan(gbs: int) -> ParallelPlan:
    rep = Replica(gpu_type="A100-40", zone="us-central1-a", tp=1, gpus_per_node=4, market=Market.ON_DEMAND)
    return ParallelPlan(model="OPT-350", global_batch_size=gbs, stages=(Stage(first_layer=0, last_layer=25,
                        replicas=(rep,)),), pipelines=(PipelineBatch(microbatch_size=1, num_microbatches=gbs),))


def test_parallel_writers_of_one_plan_file_never_share_a_temporary_file(tmp_path):
    path = tmp_path / "plan.json"
    errors: list[BaseException] = []

    def writer(gbs: int) -> None:
        try:
            for _ in range(60):
                save_plan_file(_plan(gbs), path)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(8 * (i + 1),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert json.loads(path.read_text())["global_batch_size"] in (8, 16, 24, 32)  # one writer's whole file
    assert [x.name for x in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left


def test_write_atomic_refuses_each_kind_and_keeps_the_mode_a_new_file_gets(tmp_path):
    for name, path in _targets(tmp_path).items():
        with pytest.raises(SailorError, match="--x"):
            write_atomic("--x", path, b"data")
        assert not path.is_file() or path.is_symlink(), name
    new = tmp_path / "new.json"
    write_atomic("--x", new, b"{}")
    assert new.read_bytes() == b"{}" and stat.S_IMODE(new.stat().st_mode) == 0o666 & ~_umask()
    with pytest.raises(SailorError, match="does not exist"):
        check_output_file("--x", tmp_path / "no" / "such" / "file.json")


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_a_dangling_link_as_checkpoint_dir_is_refused_before_training(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({
        "format": "sailor-plan", "version": 1, "model": "gpt-tiny", "global_batch_size": 2,
        "stages": [{"layers": [0, 5], "replicas": [{"gpu_type": "cpu", "zone": "local"}]}],
        "pipelines": [{"microbatch_size": 1, "num_microbatches": 2}]}))
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "gone" / "ckpt")
    p = _sailor(tmp_path, "train", str(plan), "--steps", "1", "--checkpoint-dir", str(link))
    assert "--checkpoint-dir" in _one_line(p) and "started" not in p.stdout


def test_profiles_export_never_writes_through_a_link_in_its_folder(tmp_path):
    out, target = tmp_path / "csv", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("keep me")
    (out / "gpu_types.csv").symlink_to(target)  # planted where the export writes one of its tables
    p = _sailor(tmp_path, "profiles", "export", "--out", str(out))
    assert "gpu_types.csv" in _one_line(p)
    assert target.read_text() == "keep me" and (out / "gpu_types.csv").is_symlink()


def test_runs_show_plot_refuses_a_fifo(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    p = _sailor(tmp_path, "runs", "show", "any-run", "--plot", str(fifo))
    assert "--plot" in _one_line(p)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_data_prepare_never_writes_through_a_link_in_its_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from sailor_core.runtime.prepare import prepare_dataset
    from sailor_core.runtime.token_shards import shard_name

    docs = [f"word{i % 7} other{i % 5} text" for i in range(200)]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.txt").write_text("\n".join(docs))
    out, target = tmp_path / "out", tmp_path / "precious.bin"
    out.mkdir()
    target.write_bytes(b"keep me")
    (out / shard_name(0)).symlink_to(target)
    with pytest.raises(SailorError, match="symbolic link"):
        prepare_dataset([str(tmp_path / "in.txt")], str(tmp_path / "tokenizer.json"), str(out), shard_tokens=50)
    assert target.read_bytes() == b"keep me"
