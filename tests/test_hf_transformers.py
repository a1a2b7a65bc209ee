"""Models built by `transformers` itself, saved in both config forms, imported, exported, reloaded.

transformers >= 5 writes rotary settings under `rope_parameters`; older versions wrote top-level
`rope_theta` / `rope_scaling` / `rotary_pct` (GPT-NeoX: `rotary_emb_base`). Each supported family
is built with transformers (tiny, random, nothing downloaded), saved with `save_pretrained`, and its
config.json also rewritten by hand in the other form. For both forms: the weights go through
`import_weights` (a checkpoint at step 0, as `sailor train --init-weights` does) and
`export_weights`, the export's config.json keeps the input's form, and transformers loads the
export to the same logits as the original model. A config read with the default rope settings
instead gives different logits, so the comparison would catch the old silent fallback.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 96,
         "max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
# (case, transformers config class, its arguments): non-default theta, linear and llama3 scaling,
# GQA, Qwen2's q/k/v biases, GPT-NeoX's partial rotary with its own base, OPT's learned positions
CASES = {
    "llama-theta": ("LlamaConfig", {"intermediate_size": 96, "num_key_value_heads": 2,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 50.0}}),
    "llama-linear": ("LlamaConfig", {"intermediate_size": 96, "num_key_value_heads": 2,
                                     "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 300.0}}),
    "llama-llama3": ("LlamaConfig", {"intermediate_size": 96, "num_key_value_heads": 1,
                                     "rope_parameters": {**LLAMA3, "rope_theta": 100.0}}),
    "mistral": ("MistralConfig", {"intermediate_size": 96, "num_key_value_heads": 2,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 80.0}}),
    "qwen2": ("Qwen2Config", {"intermediate_size": 96, "num_key_value_heads": 2,
                              "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 120.0}}),
    "gpt_neox": ("GPTNeoXConfig", {"intermediate_size": 128, "rope_parameters": {
        "rope_type": "default", "rope_theta": 60.0, "partial_rotary_factor": 0.5}}),
    "gpt_neox-linear": ("GPTNeoXConfig", {"intermediate_size": 128, "rope_parameters": {
        "rope_type": "linear", "factor": 3.0, "rope_theta": 200.0, "partial_rotary_factor": 0.75}}),
    "opt": ("OPTConfig", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
}
LEGACY_ONLY = ("rope_theta", "rope_scaling", "rotary_pct", "rotary_emb_base", "partial_rotary_factor")


def legacy_form(d: dict) -> dict:
    """The config.json transformers < 5 wrote for the same model: top-level rope keys."""
    d = dict(d)
    rp = dict(d.pop("rope_parameters", None) or {})
    if not rp:
        return d
    theta, partial = rp.pop("rope_theta"), rp.pop("partial_rotary_factor", None)
    scaling = rp if rp.get("rope_type", "default") != "default" else None
    if d["model_type"] == "gpt_neox":
        d.update(rotary_emb_base=theta, rotary_pct=partial)
    else:
        d["rope_theta"] = theta
    d["rope_scaling"] = scaling
    return d


def build(case: str):
    import torch

    cls, kwargs = CASES[case]
    config = getattr(transformers, cls)(**SMALL, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger than the init's 0.02, norms not all ones: rope errors show in the logits
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
    return model


def logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def ids():
    import torch

    return torch.randint(0, SMALL["vocab_size"], (2, SMALL["max_position_embeddings"]),
                         generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("form", ["rope_parameters", "top-level"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_model_imports_and_exports_in_its_own_form(case, form, ids, tmp_path):
    from sailor_core.models.hf_config import config_from_hf
    from sailor_core.models.safetensors_io import hf_to_layers, read_safetensors
    from sailor_core.models.torch_model import StageModel
    from sailor_core.runtime.weights import export_weights, import_weights

    original = build(case)
    src = tmp_path / "src"
    original.save_pretrained(src)
    written = json.loads((src / "config.json").read_text())
    rotary = case != "opt"
    assert ("rope_parameters" in written) == rotary  # transformers >= 5 writes the new form
    if form == "top-level":
        written = legacy_form(written)
        assert "rope_parameters" not in written
        (src / "config.json").write_text(json.dumps(written))
    want = logits(original, ids)

    cfg = config_from_hf(written, name=f"hf-{case}-{form}")
    import_weights(cfg, str(src), str(tmp_path / "ckpt"))
    export_weights(cfg, str(tmp_path / "ckpt"), str(tmp_path / "out"))
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    if rotary:
        assert ("rope_parameters" in exported) == (form == "rope_parameters")
        if form == "rope_parameters":
            assert not set(LEGACY_ONLY) & set(exported)
    assert config_from_hf(exported, name=cfg.name) == cfg
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert (logits(reloaded, ids) - want).abs().max().item() < 1e-5

    import torch

    states = hf_to_layers(cfg, read_safetensors(str(tmp_path / "out")))
    with torch.no_grad():
        ours = StageModel(cfg, 0, cfg.num_layers - 1, states=states).logits(ids)
    assert (ours - want).abs().max().item() < 1e-5
    if rotary:  # the fallback the old reader took (theta 10000, no scaling, rotary 0.25) is not this model
        fallback = {k: v for k, v in written.items() if k not in ("rope_parameters", *LEGACY_ONLY)}
        wrong = config_from_hf(fallback, name=f"wrong-{case}-{form}")
        with torch.no_grad():
            bad = StageModel(wrong, 0, wrong.num_layers - 1, states=states).logits(ids)
        assert (bad - want).abs().max().item() > 1e-3


def test_both_forms_read_as_one_model():
    from sailor_core.models.hf_config import config_from_hf

    for case, (cls, kwargs) in CASES.items():
        d = getattr(transformers, cls)(**SMALL, **kwargs).to_dict()
        new, old = config_from_hf(d, name=case), config_from_hf(legacy_form(d), name=case)
        assert new == old and new.hf_rope_parameters == (case != "opt") and not old.hf_rope_parameters, case


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0}, {"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
                                  {"rope_type": "no-such-rope"}])
def test_unsupported_rope_types_are_refused_in_both_forms(rope):
    from sailor_core.errors import SailorError
    from sailor_core.models.hf_config import config_from_hf

    d = transformers.LlamaConfig(**SMALL, intermediate_size=96).to_dict()
    new = {**d, "rope_parameters": {**rope, "rope_theta": 10000.0}}
    with pytest.raises(SailorError, match=f"rope_parameters rope_type '{rope['rope_type']}' is not supported.*to fix"):
        config_from_hf(new)
    with pytest.raises(SailorError, match=f"rope_scaling rope_type '{rope['rope_type']}' is not supported.*to fix"):
        config_from_hf(legacy_form(new))


def test_sharded_save_pretrained_is_read_through_its_index(tmp_path):
    import torch

    from sailor_core.models.hf_config import config_from_hf
    from sailor_core.models.safetensors_io import INDEX_NAME, hf_to_layers, read_safetensors

    model = build("llama-theta")
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / INDEX_NAME).exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    torch.save({}, tmp_path / "stray.safetensors")  # not listed by the index: never opened
    cfg = config_from_hf(json.loads((tmp_path / "config.json").read_text()), name="hf-sharded")
    for uri in (tmp_path, tmp_path / INDEX_NAME):
        tensors = read_safetensors(str(uri))
        assert sorted(tensors) == sorted(model.state_dict())
        states = hf_to_layers(cfg, tensors)
        assert torch.equal(states[1]["mlp.w2.weight"], model.state_dict()["model.layers.0.mlp.down_proj.weight"])
