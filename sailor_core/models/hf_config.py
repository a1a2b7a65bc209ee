"""Hugging Face style `config.json` <-> TransformerConfig. Torch-free.

Contract:
- `config_from_hf(d, name=None)` maps a config.json dict of the Llama (`model_type` "llama",
  grouped-query attention via `num_key_value_heads`, RoPE; "mistral" and "qwen2", the same
  architecture with, for Qwen2, biases on q/k/v, and a sliding window no shorter than the trained
  sequence), GPT-NeoX ("gpt_neox": partial rotary,
  parallel residual) or OPT ("opt": pre-norm, learned positions with OPT's offset of 2, tied head)
  family onto a `TransformerConfig`. Rotary settings are read in both forms transformers writes:
  `rope_parameters` {rope_type, rope_theta, factor, ..., partial_rotary_factor} (transformers >= 5)
  and the older top-level `rope_theta` (GPT-NeoX: `rotary_emb_base`), `rope_scaling` and
  `rotary_pct`, with transformers' precedence (a top-level `rope_scaling` wins); rope types
  "default", "linear" and "llama3" (Llama 3.1 and later) are built. The sequence length is
  `max_position_embeddings` unless `sequence_length` is given. Anything the runtime would build
  differently (other rope types such as dynamic, yarn or longrope, rope parameters per layer type,
  partial rotary outside GPT-NeoX, biases Llama does not have, OPT-350m's post-norm or projected
  embeddings, other activations) is refused with what was wrong and how to fix it, never silently
  approximated.
- The model's name is `name`, else the config's `_name_or_path` (last path part), else
  `<model_type>-<8 hex digits of the config's content>`, with `-seq<N>` appended when a training
  sequence length N other than `max_position_embeddings` is asked for: one name per architecture,
  because the profile store keys profiles by it.
- `load_model_config(path_or_uri)` reads a config.json (local path, or s3:// / gs:// through
  pyarrow's filesystems), maps it and registers it (`sailor_core.models.config.register_config`),
  so `get_config(name)` finds it in this process.
- `hf_config_of(cfg)` is the config.json of a config (the inverse mapping), written next to exported
  weights so the result loads in the tools people already use; its rotary settings are in the form
  the source config used (`TransformerConfig.hf_rope_parameters`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from sailor_core.errors import SailorError
from sailor_core.models.config import TransformerConfig, get_config, register_config
from sailor_core.uris import read_uri

MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt_neox": "gpt-neox", "opt": "opt"}
LLAMA_FAMILY = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
OPT_POSITION_OFFSET = 2  # OPTLearnedPositionalEmbedding keeps two rows before position 0


def _bad(what: str, fix: str) -> SailorError:
    return SailorError(f"model config: {what}; to fix: {fix}")


def _int(d: dict[str, Any], key: str) -> int:
    if key not in d:
        raise _bad(f"{key} is missing", f"add {key} to config.json")
    try:
        return int(d[key])
    except (TypeError, ValueError):
        raise _bad(f"{key} must be an integer, got {d[key]!r}", f"fix {key} in config.json") from None


def _require(d: dict[str, Any], key: str, allowed: tuple[Any, ...], default: Any) -> None:
    value = d.get(key, default)
    if value not in allowed:
        raise _bad(f"{key}={value!r} is not supported (supported: {', '.join(map(repr, allowed))})",
                   "use a model of the Llama, GPT-NeoX or OPT family in its standard form")


def default_name(d: dict[str, Any]) -> str:
    src = str(d.get("_name_or_path") or "").rstrip("/")
    if src:
        return src.rsplit("/", 1)[-1]
    canon = json.dumps({k: v for k, v in sorted(d.items()) if not k.startswith("_")}, sort_keys=True)
    return f"{d.get('model_type', 'model')}-{hashlib.sha256(canon.encode()).hexdigest()[:8]}"


ROPE_TYPES = ("default", "linear", "llama3")  # what the runtime builds; dynamic, yarn, longrope, ... are refused
LLAMA3_KEYS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_source(d: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The rope settings dict and whether the config keeps them under `rope_parameters` (transformers
    >= 5). Like transformers, a top-level `rope_scaling` (the older form) takes precedence."""
    params, legacy = d.get("rope_parameters"), d.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise _bad(f"{key} must be an object, got {value!r}", "use the config.json the model was published with")
    if legacy:
        return dict(legacy), False
    if params and any(isinstance(v, dict) for v in params.values()):
        raise _bad(f"rope_parameters per layer type ({', '.join(params)}) are not supported",
                   "use a model with one rope setting for every layer")
    return dict(params or {}), params is not None


def _rope(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """TransformerConfig's rotary fields from either form: `rope_parameters` {rope_type, rope_theta,
    factor, ..., partial_rotary_factor} (transformers >= 5), or top-level rope_theta (rotary_emb_base
    for GPT-NeoX), rope_scaling {type or rope_type, factor, ...} and rotary_pct (older)."""
    rp, new_form = _rope_source(d)
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in ROPE_TYPES:
        where = "rope_parameters" if new_form else "rope_scaling"
        raise _bad(f"{where} rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})",
                   "use a model without rope scaling or with linear / llama3 scaling")
    neox = model_type == "gpt_neox"
    top_theta = d.get("rotary_emb_base", d.get("rope_theta")) if neox else d.get("rope_theta")
    top_partial = d.get("rotary_pct", d.get("partial_rotary_factor")) if neox else d.get("partial_rotary_factor")
    try:
        theta = float(rp.get("rope_theta", top_theta if top_theta is not None else 10000.0))
        partial = float(rp.get("partial_rotary_factor", top_partial if top_partial is not None else
                               (0.25 if neox else 1.0)))
        out: dict[str, Any] = {"rope_theta": theta, "hf_rope_parameters": new_form}
        if neox:
            out["rotary_pct"] = partial
        elif partial != 1.0:
            raise _bad(f"partial_rotary_factor {partial} is not built for model_type {model_type!r}",
                       "use a config that turns every head dimension (partial_rotary_factor 1.0)")
        if kind == "default":
            return out
        out.update(rope_scaling=kind, rope_factor=float(rp.get("factor", 1.0)))
        if kind == "llama3":
            missing = [k for k in LLAMA3_KEYS if k not in rp]
            if missing:
                raise _bad(f"llama3 rope scaling has no {missing[0]}",
                           "use the config.json the model was published with")
            out.update(rope_low_freq_factor=float(rp["low_freq_factor"]),
                       rope_high_freq_factor=float(rp["high_freq_factor"]),
                       rope_original_max_positions=int(rp["original_max_position_embeddings"]))
    except (TypeError, ValueError) as e:
        raise _bad(f"rope settings {rp or top_theta!r} are not numbers ({e})",
                   "use the config.json the model was published with") from None
    return out


def _rope_json(cfg: TransformerConfig) -> dict[str, Any]:
    """The rotary keys of `cfg`'s config.json, in the form its source used (see `_rope`)."""
    scaling: dict[str, Any] = {}
    if cfg.rope_scaling is not None:
        scaling = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
        if cfg.rope_scaling == "llama3":
            scaling.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                           original_max_position_embeddings=cfg.rope_original_max_positions)
    neox = cfg.variant == "gpt-neox"
    if cfg.hf_rope_parameters:
        params = {"rope_type": "default", "rope_theta": cfg.rope_theta, **scaling}
        if neox:
            params["partial_rotary_factor"] = cfg.rotary_pct
        return {"rope_parameters": params}
    if neox:
        return {"rotary_emb_base": cfg.rope_theta, "rotary_pct": cfg.rotary_pct, "rope_scaling": scaling or None}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling or None}


def config_from_hf(d: dict[str, Any], name: str | None = None, sequence_length: int | None = None) -> TransformerConfig:
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _bad(f"model_type {model_type!r} is not supported",
                   f"use a config.json whose model_type is one of {', '.join(MODEL_TYPES)}")
    h, nh, layers = _int(d, "hidden_size"), _int(d, "num_attention_heads"), _int(d, "num_hidden_layers")
    max_pos = _int(d, "max_position_embeddings")
    if sequence_length is not None and not 1 <= sequence_length <= max_pos:
        raise _bad(f"sequence length {sequence_length} is outside 1..max_position_embeddings={max_pos}",
                   f"train sequences of at most {max_pos} tokens")
    if name is None:
        name = default_name(d) + (f"-seq{sequence_length}" if sequence_length and sequence_length != max_pos else "")
    common: dict[str, Any] = dict(
        name=name, variant=MODEL_TYPES[model_type], num_blocks=layers, hidden_size=h,
        num_heads=nh, vocab_size=_int(d, "vocab_size"),
        sequence_length=sequence_length or max_pos, max_positions=max_pos,
        init_std=float(d.get("initializer_range", d.get("init_std", 0.02))),
    )
    if d.get("head_dim") not in (None, h // max(nh, 1)):
        raise _bad(f"head_dim {d['head_dim']} differs from hidden_size / num_attention_heads = {h // nh}",
                   "use a config whose heads split hidden_size evenly")
    if model_type in LLAMA_FAMILY:
        _require(d, "hidden_act", ("silu",), "silu")
        _require(d, "attention_bias", (False,), False)
        _require(d, "mlp_bias", (False,), False)
        window = d.get("sliding_window")
        if model_type == "qwen2" and not d.get("use_sliding_window", False):
            window = None  # Qwen2 keeps a window size in its config but attends in full unless told
        if window is not None and int(window) < common["sequence_length"]:
            raise _bad(f"sliding-window attention over {window} tokens is not built",
                       f"train sequences of at most {window} tokens (--seq-len {window})")
        return TransformerConfig(
            **common, **_rope(d, model_type), ffn_hidden_size=_int(d, "intermediate_size"),
            qkv_bias=model_type == "qwen2", sliding_window=int(window) if window is not None else None,
            hf_model_type=model_type,
            num_kv_heads=int(d.get("num_key_value_heads") or nh), norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tied_head=bool(d.get("tie_word_embeddings", False)),
        )
    if model_type == "gpt_neox":
        _require(d, "hidden_act", ("gelu",), "gelu")
        _require(d, "attention_bias", (True,), True)
        return TransformerConfig(
            **common,
            **_rope(d, model_type),
            ffn_hidden_size=_int(d, "intermediate_size"),
            norm_eps=float(d.get("layer_norm_eps", 1e-5)),
            parallel_residual=bool(d.get("use_parallel_residual", True)),
            tied_head=bool(d.get("tie_word_embeddings", False)),
        )
    # OPT
    _require(d, "activation_function", ("relu",), "relu")
    _require(d, "do_layer_norm_before", (True,), True)
    _require(d, "enable_bias", (True,), True)
    _require(d, "layer_norm_elementwise_affine", (True,), True)
    if int(d.get("word_embed_proj_dim", h)) != h:
        raise _bad(f"word_embed_proj_dim {d['word_embed_proj_dim']} != hidden_size {h} (projected embeddings)",
                   "use an OPT model without embedding projections (every size but 350m)")
    return TransformerConfig(
        **common, ffn_hidden_size=_int(d, "ffn_dim"), norm_eps=1e-5, position_offset=OPT_POSITION_OFFSET,
        tied_head=bool(d.get("tie_word_embeddings", True)),
    )


def hf_config_of(cfg: TransformerConfig) -> dict[str, Any]:
    """The config.json describing `cfg` (the inverse of `config_from_hf`)."""
    base: dict[str, Any] = {
        "_name_or_path": cfg.name, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_blocks,
        "num_attention_heads": cfg.num_heads, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_positions or cfg.sequence_length, "tie_word_embeddings": bool(cfg.tied_head),
        "initializer_range": cfg.init_std, "torch_dtype": "float32",
    }
    if cfg.variant == "llama":
        kind = cfg.hf_model_type or "llama"
        out = {**base, "model_type": kind, "architectures": [LLAMA_FAMILY[kind]],
               "intermediate_size": cfg.ffn_hidden_size, "num_key_value_heads": cfg.kv_heads,
               "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", **_rope_json(cfg)}
        if kind == "llama":
            out.update(attention_bias=False, mlp_bias=False)
        elif kind == "mistral":
            out["sliding_window"] = cfg.sliding_window
        else:
            out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window)
        return out
    if cfg.variant == "gpt-neox":
        return {**base, "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"],
                "intermediate_size": cfg.ffn_hidden_size, "layer_norm_eps": cfg.norm_eps,
                "use_parallel_residual": cfg.parallel_residual, "hidden_act": "gelu", **_rope_json(cfg)}
    if cfg.variant == "opt" and cfg.position_offset == OPT_POSITION_OFFSET:
        return {**base, "model_type": "opt", "architectures": ["OPTForCausalLM"], "ffn_dim": cfg.ffn_hidden_size,
                "do_layer_norm_before": True, "word_embed_proj_dim": cfg.hidden_size,
                "activation_function": "relu", "enable_bias": True}
    raise SailorError(f"model {cfg.name} (variant {cfg.variant}) has no Hugging Face layout; to fix: export a "
                      f"model built from a Llama, GPT-NeoX or OPT config.json")


def read_bytes(uri: str) -> bytes:
    """A file's bytes from a local path or an object-storage URI (s3://, gs://)."""
    if "://" not in uri or uri.startswith("file://"):
        path = uri.removeprefix("file://")
        if not os.path.isfile(path):
            raise SailorError(f"{path!r} does not exist; to fix: check the path")
        with open(path, "rb") as f:
            return f.read()

    return read_uri(uri)


def load_model_config(uri: str, name: str | None = None, sequence_length: int | None = None) -> TransformerConfig:
    """Read, map and register a config.json (see module contract)."""
    try:
        d = json.loads(read_bytes(uri))
    except json.JSONDecodeError as e:
        raise SailorError(f"{uri}: not valid JSON ({e}); to fix: pass a Hugging Face config.json") from None
    if not isinstance(d, dict):
        raise SailorError(f"{uri}: not a JSON object; to fix: pass a Hugging Face config.json")
    return register_config(config_from_hf(d, name, sequence_length))


def resolve_model(model: str | None, model_config: str | None, sequence_length: int | None = None) -> TransformerConfig:
    """The model a command names: `--model-config FILE` (with `--model` as its name, if given, and
    `--seq-len` as its training sequence length), else a built-in or registered `--model`."""
    if model_config:
        return load_model_config(model_config, name=model, sequence_length=sequence_length)
    if sequence_length is not None:
        raise SailorError("--seq-len sets the training sequence length of a --model-config model; to fix: pass "
                          "--model-config config.json with it (a built-in model has its own length)")
    if not model:
        raise SailorError("no model given; to fix: pass --model NAME or --model-config config.json")

    return get_config(model)
