"""Models from Hugging Face style config.json files: mapping, sizes, weights in and out, training.

Every config and weight file is made here (tiny random models); nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest

from sailor_core.domain import SailorError
from sailor_core.models.config import get_config, layer_activation_bytes, layer_params, model_spec
from sailor_core.models.hf_config import config_from_hf, hf_config_of, load_model_config

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
        config_from_hf({**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}})
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
