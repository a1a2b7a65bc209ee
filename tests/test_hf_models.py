"""Models from Hugging Face style config.json files: mapping, sizes, weights in and out, training.

Every config and weight file is made here (tiny random models); nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest

from sailor_core.errors import SailorError
from sailor_core.models.config import get_config, layer_activation_bytes, layer_params, model_spec
from sailor_core.models.hf_config import config_from_hf, hf_config_of, load_model_config
from tests.store_fixtures import BUCKET, s3_server  # noqa: F401 - the session's S3 server fixture

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "intermediate_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 320, "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": False}
NEOX = {"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 320, "max_position_embeddings": 32, "rotary_pct": 0.25,
        "use_parallel_residual": True}
OPT = {"model_type": "opt", "hidden_size": 64, "ffn_dim": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
       "vocab_size": 320, "max_position_embeddings": 32, "do_layer_norm_before": True, "word_embed_proj_dim": 64}
FAMILIES = {"llama": LLAMA, "gpt_neox": NEOX, "opt": OPT}


def test_mapping_keeps_the_architecture():
    cfg = config_from_hf(LLAMA)
    assert (cfg.variant, cfg.num_blocks, cfg.num_heads, cfg.kv_heads, cfg.ffn_hidden_size) == ("llama", 4, 4, 2, 160)
    assert cfg.sequence_length == 32 and not cfg.tied_head and cfg.qkv_size == (4 + 2 * 2) * 16
    neox = config_from_hf(NEOX)
    assert neox.rotary and neox.rotary_dims == 4 and neox.parallel_residual and not neox.tied_head
    opt = config_from_hf(OPT)
    assert opt.tied_head and opt.position_offset == 2 and opt.mlp == "relu"
    # the name is stable (content digest) and the inverse mapping gives the same config back
    assert config_from_hf(dict(LLAMA)).name == cfg.name
    for d in FAMILIES.values():
        c = config_from_hf(d)
        assert config_from_hf(hf_config_of(c), name=c.name) == c


def test_unsupported_configs_say_what_and_how_to_fix():
    with pytest.raises(SailorError, match="model_type 'bert'.*to fix"):
        config_from_hf({**LLAMA, "model_type": "bert"})
    with pytest.raises(SailorError, match="rope_scaling.*to fix"):
        config_from_hf({**LLAMA, "rope_scaling": {"type": "yarn", "factor": 2.0}})
    with pytest.raises(SailorError, match="do_layer_norm_before"):
        config_from_hf({**OPT, "do_layer_norm_before": False})
    with pytest.raises(SailorError, match="word_embed_proj_dim"):
        config_from_hf({**OPT, "word_embed_proj_dim": 32})
    with pytest.raises(SailorError, match="hidden_size is missing"):
        config_from_hf({k: v for k, v in LLAMA.items() if k != "hidden_size"})
    # GQA splits whole KV groups over TP ranks: 2 KV heads do not split 4 ways
    with pytest.raises(SailorError, match="num_kv_heads=2 is not divisible by tp=4"):
        config_from_hf(LLAMA).check_tp(4)
    assert model_spec(config_from_hf(LLAMA), (1, 2, 4)).tp_degrees == (1, 2)


def test_load_registers_one_name_for_every_component(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "_name_or_path": "acme/tiny-llama"}))
    cfg = load_model_config(str(path))
    assert cfg.name == "tiny-llama" and get_config("tiny-llama") is cfg
    # the planner's sizes (the store's ModelSpec) are the runtime's parameters by construction
    spec = model_spec(cfg, (1, 2))
    assert sum(ly.params for ly in spec.layers if ly.tp == 1) == cfg.num_params()
    with pytest.raises(SailorError, match="already another model"):
        load_model_config(str(path), name="gpt-tiny")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sizes_match_torch(family):
    import torch

    from sailor_core.models.torch_model import build_layer, loss_sum

    cfg = config_from_hf(FAMILIES[family])
    b = 4
    for i in range(cfg.num_layers):
        layer = build_layer(cfg, i)
        assert sum(p.numel() for p in layer.parameters()) == layer_params(cfg, i)
        x = torch.randn(b, cfg.sequence_length, cfg.hidden_size, requires_grad=True)
        ids = torch.randint(0, cfg.vocab_size, (b, cfg.sequence_length))
        pids = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        seen: dict[int, int] = {}

        def pack(t, pids=pids, seen=seen):
            st = t.untyped_storage()
            if st.data_ptr() not in pids:
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(ids if i == 0 else x)
            if i == cfg.num_layers - 1:
                loss_sum(out, ids)
        per_seq = sum(seen.values()) / b
        want = layer_activation_bytes(cfg, i)
        # rotary tables do not scale with the batch; the profiler allows 10%
        assert abs(per_seq - want) <= 0.05 * want, (family, i, per_seq, want)


# -- weights: safetensors in any plan's layout, out in the original layout -------------------------

TRAIN_LLAMA = {**LLAMA, "_name_or_path": "test/tiny-llama-gqa"}


def hf_llama_weights(d: dict, seed: int = 0) -> dict:
    """Random weights under the names and shapes `transformers` gives a LlamaForCausalLM."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, f, v = d["hidden_size"], d["intermediate_size"], d["vocab_size"]
    hd = h // d["num_attention_heads"]
    kv = d["num_key_value_heads"] * hd

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    t = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": 1 + rnd(h), "lm_head.weight": rnd(v, h)}
    for i in range(d["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + rnd(h), p + "post_attention_layernorm.weight": 1 + rnd(h),
                  p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                  p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
                  p + "mlp.gate_proj.weight": rnd(f, h), p + "mlp.up_proj.weight": rnd(f, h),
                  p + "mlp.down_proj.weight": rnd(h, f)})
    return t


def reference_llama_logits(t: dict, d: dict, ids):
    """Hugging Face Llama's forward written out from its tensor names (independent of sailor's model)."""
    import torch

    nh, nkv, eps = d["num_attention_heads"], d["num_key_value_heads"], d["rms_norm_eps"]
    b, s = ids.shape
    hd = d["hidden_size"] // nh

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate_half(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat((-x2, x1), dim=-1)

    inv = 1.0 / (d["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = torch.outer(torch.arange(s).float(), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    mask = torch.full((s, s), float("-inf")).triu(1)
    x = t["model.embed_tokens.weight"][ids]
    for i in range(d["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = rms(x, t[p + "input_layernorm.weight"])

        def proj(name, y=y, p=p):  # Qwen2 has biases on q, k and v
            bias = t.get(f"{p}self_attn.{name}.bias")
            return y @ t[f"{p}self_attn.{name}.weight"].T + (0 if bias is None else bias)

        q = proj("q_proj").view(b, s, nh, hd).transpose(1, 2)
        k = proj("k_proj").view(b, s, nkv, hd).transpose(1, 2)
        v = proj("v_proj").view(b, s, nkv, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / hd**0.5 + mask, dim=-1) @ v
        x = x + att.transpose(1, 2).reshape(b, s, -1) @ t[p + "self_attn.o_proj.weight"].T
        y = rms(x, t[p + "post_attention_layernorm.weight"])
        gate, up = y @ t[p + "mlp.gate_proj.weight"].T, y @ t[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


def single_process_logits(cfg, states, ids):
    import torch

    from sailor_core.models.torch_model import StageModel

    with torch.no_grad():
        return StageModel(cfg, 0, cfg.num_layers - 1, states=states).logits(ids)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_weights_roundtrip_through_the_runtime_layout(family):
    import torch

    from sailor_core.models.safetensors_io import hf_to_layers, layers_to_hf
    from sailor_core.models.torch_model import full_layer_state

    cfg = config_from_hf(FAMILIES[family])
    ours = {i: full_layer_state(cfg, i, seed=1) for i in range(cfg.num_layers)}
    hf = layers_to_hf(cfg, ours)
    back = hf_to_layers(cfg, hf)
    assert all(torch.equal(back[i][n], ours[i][n]) for i in ours for n in ours[i])
    if family == "opt":
        assert "lm_head.weight" not in hf and hf["model.decoder.embed_positions.weight"].shape == (34, 64)
    with pytest.raises(SailorError, match="no tensor .*to fix"):
        hf_to_layers(cfg, {k: v for k, v in list(hf.items())[1:]})


def test_llama_mapping_matches_hugging_face_forward():
    import torch

    from sailor_core.models.safetensors_io import hf_to_layers

    cfg = config_from_hf(LLAMA)
    t = hf_llama_weights(LLAMA)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.sequence_length), generator=torch.Generator().manual_seed(0))
    ref = reference_llama_logits(t, LLAMA, ids)
    got = single_process_logits(cfg, hf_to_layers(cfg, t), ids)
    assert (got - ref).abs().max().item() < 1e-5


def test_train_llama_gqa_under_pp2_tp2_export_and_reload(tmp_path):
    """Done means: config.json + safetensors -> 2 stages x tp 2 on CPU -> export -> same logits in one process."""
    import torch
    from safetensors.torch import load_file, save_file

    from sailor_cli.main import main
    from sailor_core.domain import ParallelPlan, PipelineBatch, Replica, Stage
    from sailor_core.models.safetensors_io import hf_to_layers
    from sailor_core.models.torch_model import StageModel
    from sailor_core.plan_format import save_plan_file
    from sailor_core.runtime.data import TokenDataset, load_tokens
    from sailor_core.runtime.weights import checkpoint_layers

    (tmp_path / "config.json").write_text(json.dumps(TRAIN_LLAMA))
    initial = hf_llama_weights(TRAIN_LLAMA, seed=3)
    save_file(initial, str(tmp_path / "model.safetensors"))
    data = tmp_path / "corpus.txt"
    data.write_bytes(bytes(torch.randint(32, 127, (20000,), generator=torch.Generator().manual_seed(1)).tolist()))
    cfg = config_from_hf(TRAIN_LLAMA)
    rep = Replica(gpu_type="cpu", zone="local", tp=2, gpus_per_node=2)
    plan = ParallelPlan(model=cfg.name, global_batch_size=4, precision="fp32",
                        stages=(Stage(first_layer=0, last_layer=2, replicas=(rep,)),
                                Stage(first_layer=3, last_layer=5, replicas=(rep,))),
                        pipelines=(PipelineBatch(microbatch_size=2, num_microbatches=2),))
    save_plan_file(plan, str(tmp_path / "plan.json"))
    ckpt_dir, out, metrics = tmp_path / "ckpt", tmp_path / "export", tmp_path / "metrics.jsonl"
    rc = main(["train", str(tmp_path / "plan.json"), "--model-config", str(tmp_path / "config.json"),
               "--init-weights", str(tmp_path / "model.safetensors"), "--checkpoint-dir", str(ckpt_dir),
               "--export", str(out), "--steps", "3", "--data", str(data), "--metrics-out", str(metrics),
               "--timeout", "60"])
    assert rc == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]

    # step 1 trained the imported weights: its loss is the single-process loss of those weights
    ds = TokenDataset(load_tokens(str(data)), cfg.sequence_length, 0, cfg.vocab_size)
    x, y = ds.batch(0, 4)
    with torch.no_grad():
        model = StageModel(cfg, 0, cfg.num_layers - 1, states=hf_to_layers(cfg, initial))
        first = (model.loss_sum(model(x), y) / y.numel()).item()
    assert abs(rows[0]["loss"] - first) <= 1e-5 * abs(first), (rows[0]["loss"], first)

    # the export is in the original layout, trained, and gives the trained model's logits
    exported = load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(initial)
    assert all(exported[k].shape == initial[k].shape for k in initial)
    assert not torch.equal(exported["model.layers.0.self_attn.k_proj.weight"],
                           initial["model.layers.0.self_attn.k_proj.weight"])
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    trained, step = checkpoint_layers(cfg, str(ckpt_dir))
    assert step == 3
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.sequence_length), generator=torch.Generator().manual_seed(5))
    from_run = single_process_logits(cfg, trained, ids)
    reloaded = single_process_logits(cfg, hf_to_layers(cfg, exported), ids)
    assert (reloaded - from_run).abs().max().item() <= 1e-5
    reference = reference_llama_logits(exported, TRAIN_LLAMA, ids)
    assert (reference - from_run).abs().max().item() <= 1e-5


def _ln(x, w, b, eps=1e-5):
    import torch

    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)


def _attend(q, k, v):
    import torch

    s, hd = q.shape[-2], q.shape[-1]
    mask = torch.full((s, s), float("-inf")).triu(1)
    return torch.softmax(q @ k.transpose(-1, -2) / hd**0.5 + mask, dim=-1) @ v


def reference_neox_logits(t: dict, d: dict, ids):
    """Hugging Face GPT-NeoX's forward from its tensor names: fused per-head [q|k|v], partial rotary,
    parallel residual."""
    import torch

    nh = d["num_attention_heads"]
    b, s = ids.shape
    hd = d["hidden_size"] // nh
    rd = int(hd * d["rotary_pct"])
    inv = 1.0 / (10000.0 ** (torch.arange(0, rd, 2).float() / rd))
    freqs = torch.outer(torch.arange(s).float(), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()

    def rope(x):
        r, rest = x[..., :rd], x[..., rd:]
        half = torch.cat((-r[..., rd // 2:], r[..., : rd // 2]), dim=-1)
        return torch.cat((r * cos + half * sin, rest), dim=-1)

    x = t["gpt_neox.embed_in.weight"][ids]
    for i in range(d["num_hidden_layers"]):
        p = f"gpt_neox.layers.{i}."
        y = _ln(x, t[p + "input_layernorm.weight"], t[p + "input_layernorm.bias"])
        qkv = (y @ t[p + "attention.query_key_value.weight"].T + t[p + "attention.query_key_value.bias"])
        q, k, v = qkv.view(b, s, nh, 3 * hd).transpose(1, 2).chunk(3, dim=-1)
        att = _attend(rope(q), rope(k), v).transpose(1, 2).reshape(b, s, -1)
        att = att @ t[p + "attention.dense.weight"].T + t[p + "attention.dense.bias"]
        y2 = _ln(x, t[p + "post_attention_layernorm.weight"], t[p + "post_attention_layernorm.bias"])
        h4 = torch.nn.functional.gelu(y2 @ t[p + "mlp.dense_h_to_4h.weight"].T + t[p + "mlp.dense_h_to_4h.bias"])
        x = x + att + h4 @ t[p + "mlp.dense_4h_to_h.weight"].T + t[p + "mlp.dense_4h_to_h.bias"]
    x = _ln(x, t["gpt_neox.final_layer_norm.weight"], t["gpt_neox.final_layer_norm.bias"])
    return x @ t["embed_out.weight"].T


def reference_opt_logits(t: dict, d: dict, ids):
    """Hugging Face OPT's forward from its tensor names: positions offset by 2, pre-norm, tied head."""
    import torch

    nh = d["num_attention_heads"]
    b, s = ids.shape
    hd = d["hidden_size"] // nh
    emb = t["model.decoder.embed_tokens.weight"]
    x = emb[ids] + t["model.decoder.embed_positions.weight"][torch.arange(s) + 2]
    for i in range(d["num_hidden_layers"]):
        p = f"model.decoder.layers.{i}."
        y = _ln(x, t[p + "self_attn_layer_norm.weight"], t[p + "self_attn_layer_norm.bias"])

        def proj(name, y=y, p=p):
            return (
                (y @ t[f"{p}self_attn.{name}.weight"].T + t[f"{p}self_attn.{name}.bias"])
                .view(b, s, nh, hd)
                .transpose(1, 2)
            )

        att = _attend(proj("q_proj"), proj("k_proj"), proj("v_proj")).transpose(1, 2).reshape(b, s, -1)
        x = x + att @ t[p + "self_attn.out_proj.weight"].T + t[p + "self_attn.out_proj.bias"]
        y = _ln(x, t[p + "final_layer_norm.weight"], t[p + "final_layer_norm.bias"])
        x = x + torch.relu(y @ t[p + "fc1.weight"].T + t[p + "fc1.bias"]) @ t[p + "fc2.weight"].T + t[p + "fc2.bias"]
    x = _ln(x, t["model.decoder.final_layer_norm.weight"], t["model.decoder.final_layer_norm.bias"])
    return x @ emb.T


@pytest.mark.parametrize("family", ["gpt_neox", "opt"])
def test_neox_and_opt_mappings_match_hugging_face_forward(family):
    import torch

    from sailor_core.models.safetensors_io import layers_to_hf
    from sailor_core.models.torch_model import full_layer_state

    d = FAMILIES[family]
    cfg = config_from_hf(d)
    g = torch.Generator().manual_seed(7)
    # perturb every tensor (norm weights and biases too), so a swapped name cannot go unnoticed
    states = {i: {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in full_layer_state(cfg, i).items()}
              for i in range(cfg.num_layers)}
    if cfg.tied_head:
        states[cfg.num_layers - 1]["out.weight"] = states[0]["wte.weight"]
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.sequence_length), generator=g)
    ref = (reference_neox_logits if family == "gpt_neox" else reference_opt_logits)(layers_to_hf(cfg, states), d, ids)
    got = single_process_logits(cfg, states, ids)
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.s3
def test_weights_from_and_to_object_storage(s3_server, tmp_path):  # noqa: F811
    import torch
    from safetensors.torch import save

    from sailor_core.models.safetensors_io import read_safetensors
    from sailor_core.runtime.weights import checkpoint_layers, export_weights, import_weights

    cfg = config_from_hf(LLAMA)
    t = hf_llama_weights(LLAMA, seed=4)
    with s3_server.filesystem().open_output_stream(f"{BUCKET}/weights/in/model.safetensors") as f:
        f.write(save(t))
    import_weights(cfg, s3_server.uri(BUCKET, "weights/in"), str(tmp_path / "ckpt"))
    layers, step = checkpoint_layers(cfg, str(tmp_path / "ckpt"))
    assert step == 0
    with pytest.raises(SailorError, match="already holds steps"):
        import_weights(cfg, s3_server.uri(BUCKET, "weights/in"), str(tmp_path / "ckpt"))
    export_weights(cfg, str(tmp_path / "ckpt"), s3_server.uri(BUCKET, "weights/out"))
    back = read_safetensors(s3_server.uri(BUCKET, "weights/out/model.safetensors"))
    assert sorted(back) == sorted(t) and all(torch.equal(back[k], t[k]) for k in t)


def test_flops_per_token_by_hand():
    cfg = config_from_hf(LLAMA)  # h 64, 4 heads of 16 (2 KV), ffn 160, 4 blocks, vocab 320, seq 32
    block = 64 * (4 + 2 * 2) * 16 + 64 * 64 + 3 * 64 * 160 + 2 * 64  # qkv, out proj, SwiGLU, 2 RMSNorms
    assert cfg.flops_per_token() == 6 * (4 * block + 320 * 64) + 12 * 4 * 4 * 16 * 32


LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}


def hf_llama3_inv_freq(base: float, dim: int, rs: dict):
    """transformers' _compute_llama3_parameters, written out."""
    import math

    import torch

    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    old = rs["original_max_position_embeddings"]
    low_w, high_w = old / rs["low_freq_factor"], old / rs["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_w, inv / rs["factor"], inv)
    smooth = (old / wavelen - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / rs["factor"] + smooth * scaled
    medium = ~(wavelen < high_w) * ~(wavelen > low_w)
    return torch.where(medium, smoothed, scaled)


def test_llama3_rope_scaling_matches_hugging_face():
    import torch

    from sailor_core.models.torch_model import rope_inv_freq

    # rope_theta 100 puts the 8 frequencies of a 16-wide head on both sides of both wavelength bounds
    d = {**LLAMA, "rope_theta": 100.0, "rope_scaling": LLAMA31_SCALING}
    cfg = config_from_hf(d)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_positions) == ("llama3", 8.0, 64)
    assert config_from_hf(hf_config_of(cfg), name=cfg.name) == cfg
    want = hf_llama3_inv_freq(100.0, 16, LLAMA31_SCALING)
    got = rope_inv_freq(cfg)
    plain = rope_inv_freq(config_from_hf({**d, "rope_scaling": None}))
    assert torch.allclose(got.float(), want, rtol=1e-6)
    assert (got < plain).any() and (got == plain).any() and not torch.equal(got, plain / 8)  # all three regimes
    lin = config_from_hf({**d, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert torch.allclose(rope_inv_freq(lin), plain / 2)
    with pytest.raises(SailorError, match="rope_scaling .*dynamic.*to fix"):
        config_from_hf({**d, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_training_sequence_shorter_than_the_models_positions():
    import torch

    from sailor_core.models.hf_config import resolve_model
    from sailor_core.models.safetensors_io import hf_to_layers, layers_to_hf
    from sailor_core.models.torch_model import full_layer_state

    opt = config_from_hf(OPT, sequence_length=16)
    assert opt.name.endswith("-seq16") and opt.sequence_length == 16 and opt.position_rows == 32 + 2
    states = {i: full_layer_state(opt, i, seed=2) for i in range(opt.num_layers)}
    hf = layers_to_hf(opt, states)
    assert hf["model.decoder.embed_positions.weight"].shape == (34, 64)  # the published table, whole
    assert hf_config_of(opt)["max_position_embeddings"] == 32
    assert all(torch.equal(hf_to_layers(opt, hf)[i][n], states[i][n]) for i in states for n in states[i])
    llama = config_from_hf(LLAMA, sequence_length=16)
    t = hf_llama_weights(LLAMA)
    ids = torch.randint(0, llama.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    got = single_process_logits(llama, hf_to_layers(llama, t), ids)
    assert (got - reference_llama_logits(t, LLAMA, ids)).abs().max().item() < 1e-5
    with pytest.raises(SailorError, match="outside 1..max_position_embeddings=32"):
        config_from_hf(LLAMA, sequence_length=64)
    with pytest.raises(SailorError, match="--seq-len .*--model-config"):
        resolve_model("gpt-tiny", None, 64)


def test_sharded_export_reloads(tmp_path):
    import torch
    from safetensors.torch import save_file

    from sailor_core.models.safetensors_io import export_groups, hf_to_layers, read_safetensors
    from sailor_core.runtime.weights import checkpoint_layers, export_weights, import_weights

    cfg = config_from_hf(LLAMA)
    t = hf_llama_weights(LLAMA, seed=6)
    (tmp_path / "in").mkdir()
    save_file(t, str(tmp_path / "in" / "model.safetensors"))
    import_weights(cfg, str(tmp_path / "in"), str(tmp_path / "ckpt"))
    groups = export_groups(cfg, 100_000)  # ~100 kB files: several
    assert [i for g in groups for i in g] == list(range(cfg.num_layers)) and len(groups) > 2
    export_weights(cfg, str(tmp_path / "ckpt"), str(tmp_path / "out"), max_shard_bytes=100_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert files == [f"model-{k:05d}-of-{len(groups):05d}.safetensors" for k in range(1, len(groups) + 1)]
    assert sorted(index["weight_map"]) == sorted(t) and set(index["weight_map"].values()) == set(files)
    back = read_safetensors(str(tmp_path / "out"))  # the folder: every shard, lazily
    assert sorted(back) == sorted(t) and all(torch.equal(back[k], t[k]) for k in t)
    layers, _ = checkpoint_layers(cfg, str(tmp_path / "ckpt"))
    assert all(torch.equal(hf_to_layers(cfg, back)[i][n], layers[i][n]) for i in layers for n in layers[i])


def test_mistral_and_qwen2_are_llama_with_their_differences():
    import torch

    from sailor_core.models.safetensors_io import hf_to_layers, layers_to_hf

    mistral = config_from_hf({**LLAMA, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.variant == "llama" and hf_config_of(mistral)["architectures"] == ["MistralForCausalLM"]
    assert config_from_hf(hf_config_of(mistral), name=mistral.name) == mistral
    with pytest.raises(SailorError, match="sliding-window attention over 16 tokens.*--seq-len 16"):
        config_from_hf({**LLAMA, "model_type": "mistral", "sliding_window": 16})
    assert (
        config_from_hf({**LLAMA, "model_type": "mistral", "sliding_window": 16}, sequence_length=16).sliding_window
        == 16
    )

    d = {**LLAMA, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": False}
    qwen = config_from_hf(d)
    assert qwen.qkv_bias and qwen.sliding_window is None
    assert layer_params(qwen, 1) == layer_params(config_from_hf(LLAMA), 1) + qwen.qkv_size
    t = hf_llama_weights(LLAMA, seed=8)
    g = torch.Generator().manual_seed(9)
    for i in range(LLAMA["num_hidden_layers"]):
        for name, n in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
            t[f"model.layers.{i}.self_attn.{name}.bias"] = torch.randn(n, generator=g) * 0.05
    ids = torch.randint(0, qwen.vocab_size, (2, qwen.sequence_length), generator=g)
    states = hf_to_layers(qwen, t)
    got = single_process_logits(qwen, states, ids)
    assert (got - reference_llama_logits(t, d, ids)).abs().max().item() < 1e-5
    back = layers_to_hf(qwen, states)
    assert sorted(back) == sorted(t) and all(torch.equal(back[k], t[k]) for k in t)
    assert hf_config_of(qwen)["architectures"] == ["Qwen2ForCausalLM"]
