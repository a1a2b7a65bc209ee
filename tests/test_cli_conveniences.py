"""`sailor convert` (Hugging Face weights in and out without training) and `sailor simulate --model-config`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_convert_round_trips_a_transformers_model_to_the_same_logits(tmp_path: Path, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    from sailor_cli.main import main
    from tests.test_hf_transformers import build, logits

    original = build("llama-llama3")
    src = tmp_path / "src"
    original.save_pretrained(src)
    ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(3))
    want = logits(original, ids)

    # weights -> checkpoint (kept) -> weights; the config defaults to SRC's config.json
    assert main(["convert", str(src), str(tmp_path / "out"), "--keep-checkpoint", str(tmp_path / "ckpt")]) == 0
    assert "imported 4 layers" in capsys.readouterr().out
    assert (tmp_path / "ckpt" / "step_00000000" / "meta.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert (logits(reloaded, ids) - want).abs().max().item() < 1e-5
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"

    # a checkpoint folder exported on its own (as after `sailor train --checkpoint-dir`): needs its config
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "again")]) == 2
    assert "--model-config" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "again"),
                 "--model-config", str(src / "config.json")]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").float().eval()
    assert (logits(again, ids) - want).abs().max().item() < 1e-5

    # a temporary checkpoint leaves nothing behind; a kept one is never written over
    assert main(["convert", str(src / "model.safetensors"), str(tmp_path / "third")]) == 0
    assert (tmp_path / "third" / "model.safetensors").is_file()
    assert main(["convert", str(src), str(tmp_path / "x"), "--keep-checkpoint", str(tmp_path / "ckpt")]) == 2
    assert "already holds checkpoint steps" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2


def test_simulate_takes_the_model_config_a_plan_was_made_for(tmp_path: Path, capsys) -> None:
    from sailor_cli.main import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 96,
        "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}))
    store = str(tmp_path / "store")
    assert main(["profile", "model", "--model-config", str(cfg), "--device", "cpu", "--mbs", "1",
                 "--store", store]) == 0
    (tmp_path / "pool.yaml").write_text("zones:\n  local:\n    gpus:\n      cpu: {count: 1, usd_per_gpu_hour: 1.0}\n")
    plan = str(tmp_path / "plan.json")
    assert main(["plan", "--pool", str(tmp_path / "pool.yaml"), "--model-config", str(cfg),
                 "--global-batch-size", "2", "--store", store, "--out", plan, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["simulate", plan, "--model-config", str(cfg), "--store", store, "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["iteration_time_s"] == pytest.approx(planned["estimate"]["iteration_time_s"])
    # a published plan names no model: the config does
    pub = json.loads(Path(plan).read_text())
    pub.pop("model")
    Path(plan).write_text(json.dumps(pub))
    assert main(["simulate", plan, "--model-config", str(cfg), "--store", store, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time_s"] == pytest.approx(sim["iteration_time_s"])
    # another sequence length is another model, which the plan was not made for
    assert main(["simulate", plan, "--model-config", str(cfg), "--seq-len", "16", "--store", store]) == 2


def test_train_writes_tensorboard_events_as_it_trains(tmp_path: Path, capsys) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sailor_cli.main import main
    from sailor_core.domain import ParallelPlan, PipelineBatch, Replica, Stage
    from sailor_core.models.config import get_config
    from sailor_core.plan_format import save_plan_file

    n = get_config("gpt-tiny").num_layers
    rep = Replica(gpu_type="cpu", zone="local", tp=1, gpus_per_node=1)
    plan = ParallelPlan(model="gpt-tiny", global_batch_size=2, precision="fp32",
                        stages=(Stage(first_layer=0, last_layer=n // 2 - 1, replicas=(rep,)),
                                Stage(first_layer=n // 2, last_layer=n - 1, replicas=(rep,))),
                        pipelines=(PipelineBatch(microbatch_size=1, num_microbatches=2),))
    save_plan_file(plan, str(tmp_path / "plan.json"))
    tb = tmp_path / "tb"
    assert main(["train", str(tmp_path / "plan.json"), "--steps", "3", "--tensorboard", str(tb),
                 "--metrics-out", str(tmp_path / "m.jsonl"), "--lr-schedule", "linear", "--warmup-steps", "1"]) == 0
    assert "TensorBoard: 3 steps written" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/tokens_per_s", "train/step_time_s",
            "stage/0/step_time_s", "stage/1/step_time_s"} <= tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert [e.value for e in acc.Scalars("train/learning_rate")] == pytest.approx([r["lr"] for r in rows], rel=1e-6)
    assert [e.step for e in acc.Scalars("stage/1/step_time_s")] == [1, 2, 3]
    # a file where the folder should be is refused before anything starts
    (tmp_path / "file").write_text("x")
    assert main(["train", str(tmp_path / "plan.json"), "--steps", "1", "--tensorboard", str(tmp_path / "file")]) == 2
