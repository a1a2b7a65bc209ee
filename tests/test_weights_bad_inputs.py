"""Bad weights, indexes, configs and data given to `sailor train --init-weights`: each is one line,
exit 2, naming the file or tensor and the fix, before any worker starts; and an index decides which
weight files are read.
"""

from __future__ import annotations

import json

import pytest

from sailor_core.errors import SailorError
from tests.test_hf_models import LLAMA, hf_llama_weights

MODEL = {**LLAMA, "_name_or_path": "test/bad-inputs-llama"}


def plan_file(tmp_path) -> str:
    from sailor_core.domain import ParallelPlan, PipelineBatch, Replica, Stage
    from sailor_core.models.hf_config import config_from_hf
    from sailor_core.plan_format import save_plan_file

    cfg = config_from_hf(MODEL)
    rep = Replica(gpu_type="cpu", zone="local", tp=1, gpus_per_node=1)
    plan = ParallelPlan(model=cfg.name, global_batch_size=2, precision="fp32",
                        stages=(Stage(first_layer=0, last_layer=cfg.num_layers - 1, replicas=(rep,)),),
                        pipelines=(PipelineBatch(microbatch_size=1, num_microbatches=2),))
    save_plan_file(plan, str(tmp_path / "plan.json"))
    return str(tmp_path / "plan.json")


def refused(tmp_path, capsys, weights: str, config: dict | None = None, data: str | None = None) -> str:
    """Run `sailor train` and check it refused before any worker: exit 2 and one line; returns the line."""
    from sailor_cli.main import main

    (tmp_path / "config.json").write_text(json.dumps(config or MODEL))
    logs = tmp_path / "logs"
    args = ["train", plan_file(tmp_path), "--model-config", str(tmp_path / "config.json"), "--init-weights",
            weights, "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "1", "--log-dir", str(logs)]
    capsys.readouterr()
    rc = main([*args, "--data", data] if data else args)
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert "started" not in out and not logs.exists()  # no worker started
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "to fix:" in lines[0], err
    return lines[0]


def save(tensors: dict, path) -> str:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return str(path)


def test_a_file_that_is_not_safetensors(tmp_path, capsys):
    bad = tmp_path / "w" / "model.safetensors"
    bad.parent.mkdir()
    bad.write_bytes(b"<html>not the weights you are looking for</html>" * 20)
    line = refused(tmp_path, capsys, str(bad))
    assert f"weights file '{bad}' is not a readable safetensors file" in line and "header too large" in line


def test_a_truncated_file(tmp_path, capsys):
    path = save(hf_llama_weights(MODEL), tmp_path / "w" / "model.safetensors")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    line = refused(tmp_path, capsys, str(tmp_path / "w"))
    assert f"'{path}' is not a readable safetensors file" in line and "incomplete metadata" in line


def test_kv_heads_that_disagree_with_the_config_name_the_tensor(tmp_path, capsys):
    weights = save(hf_llama_weights({**MODEL, "num_key_value_heads": 1}), tmp_path / "model.safetensors")
    line = refused(tmp_path, capsys, weights)
    assert "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [16, 64]" in line
    assert "gives [32, 64] (num_key_value_heads 2 x head_dim 16 rows)" in line


def test_a_tokenizer_larger_than_the_model(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from sailor_core.runtime.prepare import prepare_dataset

    words = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(MODEL["vocab_size"] + 50)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "d.txt").write_text(" ".join(f"w{i % 300}" for i in range(500)))
    prepare_dataset([str(tmp_path / "d.txt")], str(tmp_path / "tokenizer.json"), str(tmp_path / "data"))
    weights = save(hf_llama_weights(MODEL), tmp_path / "model.safetensors")
    line = refused(tmp_path, capsys, weights, data=str(tmp_path / "data"))
    assert f"vocabulary of {len(words)} but the model has {MODEL['vocab_size']}" in line


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
                                  {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}])
def test_an_unsupported_rope_in_the_new_form(tmp_path, capsys, rope):
    weights = save(hf_llama_weights(MODEL), tmp_path / "model.safetensors")
    config = {k: v for k, v in MODEL.items() if k != "rope_theta"} | {"rope_parameters": rope}
    line = refused(tmp_path, capsys, weights, config=config)
    assert f"rope_parameters rope_type '{rope['rope_type']}' is not supported" in line


def test_an_unknown_family(tmp_path, capsys):
    weights = save(hf_llama_weights(MODEL), tmp_path / "model.safetensors")
    assert "model_type 'gemma3' is not supported" in refused(tmp_path, capsys, weights,
                                                             config={**MODEL, "model_type": "gemma3"})


def sharded(tmp_path, tensors: dict) -> tuple:
    """transformers' sharded layout of `tensors` in two files, plus a stray model.safetensors beside it."""
    names = sorted(tensors)
    half = {n: "model-00001-of-00002.safetensors" if i < len(names) // 2 else "model-00002-of-00002.safetensors"
            for i, n in enumerate(names)}
    folder = tmp_path / "sharded"
    for file in set(half.values()):
        save({n: tensors[n] for n in names if half[n] == file}, folder / file)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": half}))
    return folder, index, half


def test_the_index_decides_which_files_are_read(tmp_path, capsys):
    import torch

    from sailor_core.models.hf_config import config_from_hf
    from sailor_core.models.safetensors_io import hf_to_layers, read_safetensors
    from sailor_core.runtime.weights import checkpoint_layers, import_weights

    cfg = config_from_hf(MODEL)
    t = hf_llama_weights(MODEL, seed=2)
    folder, index, half = sharded(tmp_path, t)
    # a leftover single-file copy of other weights: the index does not list it, so it is not read
    save(hf_llama_weights(MODEL, seed=9), folder / "model.safetensors")
    for uri in (folder, index):
        back = read_safetensors(str(uri))
        assert sorted(back) == sorted(t) and all(torch.equal(back[k], t[k]) for k in t)
    import_weights(cfg, str(index), str(tmp_path / "ckpt"))
    layers, _ = checkpoint_layers(cfg, str(tmp_path / "ckpt"))
    want = hf_to_layers(cfg, t)
    assert all(torch.equal(layers[i][n], want[i][n]) for i in want for n in want[i])

    # without the index the stray copy is read too, and a tensor in two files is refused
    index.rename(folder / "index.json.bak")
    with pytest.raises(SailorError, match="tensor .* is in both .*model.safetensors.index.json"):
        read_safetensors(str(folder))


def test_bad_indexes(tmp_path, capsys):
    t = hf_llama_weights(MODEL)
    folder, index, half = sharded(tmp_path, t)
    (folder / "model-00002-of-00002.safetensors").unlink()
    assert "lists 'model-00002-of-00002.safetensors', which is not beside it" in refused(tmp_path, capsys, str(folder))

    folder, index, half = sharded(tmp_path / "b", t)
    name = next(n for n, f in half.items() if f.startswith("model-00001"))
    index.write_text(json.dumps({"weight_map": {**half, name: "model-00002-of-00002.safetensors"}}))
    line = refused(tmp_path, capsys, str(index))
    assert f"puts tensor '{name}' in 'model-00002-of-00002.safetensors' but it is in 'model-00001" in line

    index.write_text("{not json")
    assert "is not valid JSON" in refused(tmp_path, capsys, str(index))
    index.write_text(json.dumps({"metadata": {}}))
    assert "has no weight_map" in refused(tmp_path, capsys, str(index))


def test_eos_auto_warns_when_the_tokenizer_has_no_end_of_document_token(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from sailor_cli.main import main

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "d.jsonl").write_text('{"text": "a b"}\n{"text": "b a"}\n')
    prepare = ["data", "prepare", str(tmp_path / "d.jsonl"), "--tokenizer", str(tmp_path / "tokenizer.json")]
    assert main([*prepare, "--out", str(tmp_path / "auto")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: the tokenizer has none of </s>,") and "--eos" in err
    assert main([*prepare, "--out", str(tmp_path / "none"), "--eos", "none"]) == 0
    assert capsys.readouterr().err == ""  # joining them so on purpose: no warning
