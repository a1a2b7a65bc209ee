"""An export goes to a new folder or replaces the earlier export as a unit (issue 44, items 14 and 19).

`--export` into a folder holding an earlier sharded export overwrote `model.safetensors` and
`config.json` but left the older `model.safetensors.index.json` and its shards, which `sailor convert`
(and transformers) then follow: the old weights, without a word. `sailor train --export` with a model
that has no Hugging Face layout (gpt-tiny) was refused only after the whole run had trained.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sailor_core.errors import SailorError
from sailor_core.models.hf_config import config_from_hf
from tests.paths import REPO
from tests.store_fixtures import BUCKET, s3_server  # noqa: F401 - the session's S3 server fixture
from tests.test_hf_models import LLAMA, hf_llama_weights


def _checkpoint(tmp: Path, seed: int) -> str:
    """A checkpoint (step 0) of LLAMA's tiny model with weights of `seed`."""
    from safetensors.torch import save_file

    from sailor_core.runtime.weights import import_weights

    src = tmp / f"in-{seed}"
    src.mkdir()
    save_file(hf_llama_weights(LLAMA, seed=seed), str(src / "model.safetensors"))
    import_weights(config_from_hf(LLAMA), str(src), str(tmp / f"ckpt-{seed}"))
    return str(tmp / f"ckpt-{seed}")


def _same(a: dict, b: dict) -> bool:
    import torch

    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_single_file_export_over_a_sharded_one_leaves_no_stale_index_or_shard(tmp_path):
    from sailor_core.models.safetensors_io import read_safetensors
    from sailor_core.runtime.weights import export_weights

    cfg = config_from_hf(LLAMA)
    out = tmp_path / "out"
    export_weights(cfg, _checkpoint(tmp_path, 1), str(out), max_shard_bytes=100_000)  # sharded, with an index
    assert (out / "model.safetensors.index.json").exists()
    export_weights(cfg, _checkpoint(tmp_path, 2), str(out))  # one file
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert _same(read_safetensors(str(out)), hf_llama_weights(LLAMA, seed=2))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("out", ".out"))) == ["out"]


def test_a_sharded_export_over_a_single_file_one_replaces_it(tmp_path):
    from sailor_core.models.safetensors_io import read_safetensors
    from sailor_core.runtime.weights import export_weights

    cfg = config_from_hf(LLAMA)
    out = tmp_path / "out"
    export_weights(cfg, _checkpoint(tmp_path, 1), str(out))
    export_weights(cfg, _checkpoint(tmp_path, 2), str(out), max_shard_bytes=100_000)
    assert "model.safetensors" not in {p.name for p in out.iterdir()}
    assert _same(read_safetensors(str(out)), hf_llama_weights(LLAMA, seed=2))


def test_a_folder_holding_other_files_is_refused_and_left_as_it_was(tmp_path):
    from sailor_core.runtime.weights import export_weights

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SailorError, match="notes.txt.*to fix"):
        export_weights(config_from_hf(LLAMA), _checkpoint(tmp_path, 1), str(out))
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_an_export_that_fails_half_way_leaves_the_earlier_export_whole(tmp_path):
    from sailor_core.models.safetensors_io import read_safetensors, write_safetensors_sharded
    from sailor_core.runtime.weights import export_weights

    cfg = config_from_hf(LLAMA)
    out = tmp_path / "out"
    export_weights(cfg, _checkpoint(tmp_path, 1), str(out))

    def parts():  # noqa: ANN202
        yield {"model.embed_tokens.weight": hf_llama_weights(LLAMA, seed=3)["model.embed_tokens.weight"]}
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_safetensors_sharded(parts(), 2, cfg, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert _same(read_safetensors(str(out)), hf_llama_weights(LLAMA, seed=1))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []


@pytest.mark.s3
def test_an_export_to_object_storage_removes_the_earlier_exports_index_and_shards(s3_server, tmp_path):  # noqa: F811
    from sailor_core.models.safetensors_io import read_safetensors
    from sailor_core.runtime.weights import export_weights

    cfg = config_from_hf(LLAMA)
    uri = s3_server.uri(BUCKET, "exports/whole")
    export_weights(cfg, _checkpoint(tmp_path, 1), uri, max_shard_bytes=100_000)
    export_weights(cfg, _checkpoint(tmp_path, 2), uri)
    from pyarrow import fs as pafs

    names = sorted(i.base_name for i in s3_server.filesystem().get_file_info(pafs.FileSelector(
        f"{BUCKET}/exports/whole")))
    assert names == ["config.json", "model.safetensors"]
    assert _same(read_safetensors(uri), hf_llama_weights(LLAMA, seed=2))


def test_train_export_of_a_model_without_a_hugging_face_layout_is_refused_before_training(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({
        "format": "sailor-plan", "version": 1, "model": "gpt-tiny", "global_batch_size": 2,
        "stages": [{"layers": [0, 5], "replicas": [{"gpu_type": "cpu", "zone": "local"}]}],
        "pipelines": [{"microbatch_size": 1, "num_microbatches": 2}]}))
    env = {**os.environ, "TMPDIR": str(tmp_path), "SAILOR_STORE": str(tmp_path / "store")}
    p = subprocess.run([sys.executable, "-m", "sailor_cli.main", "train", str(plan), "--steps", "2",
                        "--checkpoint-dir", str(tmp_path / "ck"), "--export", str(tmp_path / "hf")],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Hugging Face layout" in lines[0], p.stderr[-1500:]
    assert "started" not in p.stdout and not (tmp_path / "ck").exists()
