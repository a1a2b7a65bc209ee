"""Training settings: LR schedule, gradient clipping, activation recomputation (runtime and simulator)."""

from __future__ import annotations

import json
import math

import pytest

from sailor_core.domain import ParallelPlan, PipelineBatch, Replica, Stage
from sailor_core.errors import SailorError
from sailor_core.runtime.lr_schedule import check_schedule, learning_rate
from sailor_core.simulator import SimModel, simulate
from tests.test_simulator import make_book, plan_of, rep


def test_warmup_then_cosine_or_linear_decay():
    kw = dict(base_lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [learning_rate(s, schedule="cosine", **kw) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert learning_rate(4, schedule="cosine", **kw) == pytest.approx(1.0)
    assert learning_rate(9, schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert learning_rate(14, schedule="cosine", **kw) == pytest.approx(0.1)
    assert learning_rate(99, schedule="linear", **kw) == pytest.approx(0.1)
    assert learning_rate(9, schedule="linear", **kw) == pytest.approx(0.55)
    assert learning_rate(9, schedule="constant", **kw) == 1.0
    with pytest.raises(SailorError, match="one of constant, cosine, linear"):
        check_schedule("step", 0, 0.0)
    with pytest.raises(SailorError, match="one of constant, cosine, linear"):
        learning_rate(0, base_lr=1.0, schedule="cosnie")


def test_recompute_trades_activation_memory_for_a_second_forward_by_hand():
    sm = SimModel(make_book())
    plain = sm.stage_compute("G1", 2, 1, 1, 3)
    again = sm.stage_compute("G1", 2, 1, 1, 3, recompute=True)
    # layers 1, 2 are blocks (the head, layer 3, is not recomputed): backward adds their forward
    assert again.forward_s == plain.forward_s
    assert again.backward_s == pytest.approx(plain.backward_s + 2 * (0.01 + 0.01))
    m = sm.stage_memory("G1", 1, 1, 2, mbs=2, in_flight=3)
    r = sm.stage_memory("G1", 1, 1, 2, mbs=2, in_flight=3, recompute=True)
    # blocks keep their input (64 elements, fp32) per microbatch in flight, plus one block's full
    # activations for the microbatch being recomputed
    assert m.activations_bytes == (400 + 400) * 2 * 3
    assert r.activations_bytes == (64 * 4 + 64 * 4) * 2 * 3 + 400 * 2
    assert r.total_bytes < m.total_bytes


def test_simulate_shows_recompute_per_stage():
    from dataclasses import replace

    from sailor_cli.simulate import _with_recompute

    book = make_book(mem_bytes=10**7)
    # GPipe keeps all 4 microbatches of stage 0's two blocks: recomputation saves more than it adds
    plan = plan_of([(0, 2, [rep()]), (3, 3, [rep()])], [(2, 4)], schedule="gpipe")
    on = _with_recompute(plan, "0")
    assert [st.recompute for st in on.stages] == [True, False]
    base, rc = simulate(plan, book), simulate(on, book)
    assert rc.per_stage[0].memory.activations_bytes < base.per_stage[0].memory.activations_bytes
    assert rc.per_stage[0].backward_s > base.per_stage[0].backward_s
    assert rc.per_stage[1] == base.per_stage[1] and rc.iteration_time_s > base.iteration_time_s
    with pytest.raises(SailorError, match="stages 0..1"):
        _with_recompute(plan, "5")
    # the plan file keeps the flag
    from sailor_core.plan_format import plan_from_dict, plan_to_dict

    assert plan_from_dict(plan_to_dict(on)) == on and "recompute" not in json.dumps(plan_to_dict(plan))
    assert replace(on.stages[0], recompute=False) == plan.stages[0]


def _llama():
    from sailor_core.models.hf_config import config_from_hf

    return config_from_hf({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                           "vocab_size": 256, "max_position_embeddings": 32, "rms_norm_eps": 1e-5},
                          name="tiny-llama-settings")


def _run(cfg, plan, tmp_path, name, **kw):
    from sailor_core.runtime.engine import TrainSettings
    from sailor_core.runtime.launcher import run_local

    out = tmp_path / f"{name}.jsonl"
    settings = TrainSettings(model=cfg.name, model_config=cfg.to_dict(), steps=6, metrics_out=str(out), timeout_s=60,
                             lr=3e-3, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1, max_grad_norm=0.5, **kw)
    run_local(plan, cfg, settings, run_dir=str(tmp_path / f"run-{name}"))
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_schedule_clipping_and_recompute_under_pp_tp_match_one_process(tmp_path):
    cfg = _llama()

    def plan(stages, recompute=(False, False)):
        return ParallelPlan(model=cfg.name, global_batch_size=4,
                            stages=tuple(Stage(first_layer=a, last_layer=b, recompute=r,
                                               replicas=(Replica(gpu_type="cpu", zone="local", tp=t, gpus_per_node=2),))
                                         for (a, b, t), r in zip(stages, recompute, strict=False)),
                            pipelines=(PipelineBatch(microbatch_size=2, num_microbatches=2),))

    one = _run(cfg, plan([(0, 5, 1)]), tmp_path, "one")
    split = _run(cfg, plan([(0, 2, 2), (3, 5, 2)], recompute=(True, True)), tmp_path, "split")
    assert [r["step"] for r in split] == list(range(1, 7))
    # the schedule ran (warmup, then cosine) and clipping engaged (norms above 0.5)
    assert [r["lr"] for r in one][:3] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert one[-1]["lr"] < one[2]["lr"]
    assert all(r["grad_norm"] > 0.5 for r in one)
    for a, b in zip(split, one, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * b["grad_norm"]
    assert one[-1]["loss"] < one[0]["loss"]


def test_sailor_simulate_recompute_on_a_published_plan(capsys):
    from sailor_cli.main import main
    from tests.paths import MEASURED_RUNS

    plans = sorted(MEASURED_RUNS.glob("**/plan_config_N4_D1.json"))
    assert plans, f"the shipped published plan N4_D1 is missing under {MEASURED_RUNS}"
    args = ["simulate", str(plans[0]), "--format", "eth-easl", "--model", "OPT-350"]
    out = {}
    for rc in ("none", "all"):
        assert main([*args, "--recompute", rc, "--json"]) == 0
        out[rc] = json.loads(capsys.readouterr().out)
    assert out["none"]["recompute_stages"] == [] and out["all"]["recompute_stages"] == list(range(len(
        {r["stage"] for r in out["all"]["per_stage"]})))
    for a, b in zip(out["none"]["per_stage"], out["all"]["per_stage"], strict=True):
        assert b["memory"]["activations_bytes"] < a["memory"]["activations_bytes"]
        assert b["backward_s"] > a["backward_s"] and b["forward_s"] == a["forward_s"]
    assert out["all"]["iteration_time_s"] > out["none"]["iteration_time_s"]
    assert main([*args, "--recompute", "0"]) == 0
    assert "0 (recompute)" in capsys.readouterr().out
    assert main([*args, "--recompute", "9"]) == 2
    assert "to fix" in capsys.readouterr().err


def test_vocab_parallel_head_on_replicas_of_different_tp_matches_one_process(tmp_path):
    """The last stage's replicas split the vocabulary differently (tp 1 and tp 2): their loss and
    gradients meet in the full layout and match one process."""
    cfg = _llama()

    def rep(t):
        return Replica(gpu_type="cpu", zone="local", tp=t, gpus_per_node=2)

    one = _run(cfg, ParallelPlan(model=cfg.name, global_batch_size=4,
                                 stages=(Stage(first_layer=0, last_layer=5, replicas=(rep(1),)),),
                                 pipelines=(PipelineBatch(microbatch_size=2, num_microbatches=2),)), tmp_path, "one")
    mixed = _run(cfg, ParallelPlan(model=cfg.name, global_batch_size=4,
                                   stages=(Stage(first_layer=0, last_layer=2, replicas=(rep(1), rep(1))),
                                           Stage(first_layer=3, last_layer=5, replicas=(rep(1), rep(2)))),
                                   pipelines=(PipelineBatch(microbatch_size=1, num_microbatches=2),
                                              PipelineBatch(microbatch_size=2, num_microbatches=1))), tmp_path, "mixed")
    for a, b in zip(mixed, one, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
