"""Weights in the ecosystem's layout: Hugging Face tensor names <-> the runtime's full-layout layers.

Contract:
- `hf_to_layers(cfg, tensors)` maps a Hugging Face state dict (Llama, GPT-NeoX or OPT names, as
  `transformers` saves them) onto full-layout per-layer states keyed by the store's layer index
  (0 embedding, 1..L blocks, L+1 final norm + head), each exactly what
  `torch_model.load_full_state` takes, so `StageModel(..., states=...)` or a checkpoint built from
  them loads into any plan's stages and TP degrees. Separate q/k/v projections are fused into the
  runtime's QKV rows (KV group, [its query heads, key, value], head_dim); GPT-NeoX's fused
  query_key_value already is that layout. A tied head takes the embedding when the file has no
  lm_head. A missing tensor, or a tensor whose shape disagrees with the config (`hf_shapes`,
  checked by its Hugging Face name before anything is fused), is a `SailorError` naming it;
  buffers a checkpoint may carry (rotary inv_freq, attention masks) are ignored.
- `layers_to_hf(cfg, states)` is the inverse: the same names and shapes `transformers` loads
  (a tied head is written once, as the embedding, as `save_pretrained` does).
- `read_safetensors(uri)` reads one `.safetensors` file; the files a `model.safetensors.index.json`
  lists (the index itself, or a folder holding one: files it does not list are not read, and a
  tensor the index puts in a file that lacks it is an error); or every `*.safetensors` of a folder
  without an index (a tensor in two files is an error). Local files are read lazily (a tensor when
  asked for), object storage (s3://, gs://) whole. A file that is not safetensors, or is
  truncated, is a `SailorError` naming it; `write_safetensors(tensors, cfg, out)` writes `model.safetensors` and
  `config.json` (sailor_core.models.hf_config) into a folder or object-storage prefix;
  `write_safetensors_sharded` writes transformers' sharded layout (files of at most 5 GB by
  default, `export_groups`, with `model.safetensors.index.json`) one group of layers at a time.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from sailor_core.errors import SailorError
from sailor_core.models.config import TransformerConfig
from sailor_core.models.export_target import export_writer
from sailor_core.models.hf_config import hf_config_of, read_bytes
from sailor_core.models.tensor_parallel import TPContext
from sailor_core.models.torch_model import _new_layer
from sailor_core.uris import filesystem_for, redact

IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")

# (our name inside a block) -> (Hugging Face name inside layer i), per family; qkv is handled apart
_BLOCK = {
    "llama": {"ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
              "attn.proj.weight": "self_attn.o_proj.weight", "mlp.w1.weight": "mlp.gate_proj.weight",
              "mlp.w3.weight": "mlp.up_proj.weight", "mlp.w2.weight": "mlp.down_proj.weight"},
    "gpt-neox": {"ln1.weight": "input_layernorm.weight", "ln1.bias": "input_layernorm.bias",
                 "ln2.weight": "post_attention_layernorm.weight", "ln2.bias": "post_attention_layernorm.bias",
                 "attn.qkv.weight": "attention.query_key_value.weight",
                 "attn.qkv.bias": "attention.query_key_value.bias",
                 "attn.proj.weight": "attention.dense.weight", "attn.proj.bias": "attention.dense.bias",
                 "mlp.fc1.weight": "mlp.dense_h_to_4h.weight", "mlp.fc1.bias": "mlp.dense_h_to_4h.bias",
                 "mlp.fc2.weight": "mlp.dense_4h_to_h.weight", "mlp.fc2.bias": "mlp.dense_4h_to_h.bias"},
    "opt": {"ln1.weight": "self_attn_layer_norm.weight", "ln1.bias": "self_attn_layer_norm.bias",
            "ln2.weight": "final_layer_norm.weight", "ln2.bias": "final_layer_norm.bias",
            "attn.proj.weight": "self_attn.out_proj.weight", "attn.proj.bias": "self_attn.out_proj.bias",
            "mlp.fc1.weight": "fc1.weight", "mlp.fc1.bias": "fc1.bias",
            "mlp.fc2.weight": "fc2.weight", "mlp.fc2.bias": "fc2.bias"},
}
_LAYER_PREFIX = {"llama": "model.layers.", "gpt-neox": "gpt_neox.layers.", "opt": "model.decoder.layers."}
_SEPARATE_QKV = {"llama": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "opt": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}
# embedding and head: (our layer kind, our name) -> Hugging Face name
_ENDS = {
    "llama": {("embedding", "wte.weight"): "model.embed_tokens.weight", ("head", "norm.weight"): "model.norm.weight",
              ("head", "out.weight"): "lm_head.weight"},
    "gpt-neox": {("embedding", "wte.weight"): "gpt_neox.embed_in.weight",
                 ("head", "norm.weight"): "gpt_neox.final_layer_norm.weight",
                 ("head", "norm.bias"): "gpt_neox.final_layer_norm.bias", ("head", "out.weight"): "embed_out.weight"},
    "opt": {("embedding", "wte.weight"): "model.decoder.embed_tokens.weight",
            ("embedding", "wpe"): "model.decoder.embed_positions.weight",
            ("head", "norm.weight"): "model.decoder.final_layer_norm.weight",
            ("head", "norm.bias"): "model.decoder.final_layer_norm.bias", ("head", "out.weight"): "lm_head.weight"},
}


def _family(cfg: TransformerConfig) -> str:
    hf_config_of(cfg)  # refuses a config without a Hugging Face layout, with the fix
    return cfg.variant


def _fuse_qkv(cfg: TransformerConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Rows (KV group, [q_1..q_g, k, v], head_dim) from q [nh*hd, ...], k and v [nkv*hd, ...]."""
    g, hd, nkv = cfg.num_heads // cfg.kv_heads, cfg.head_dim, cfg.kv_heads
    rest = q.shape[1:]
    parts = [q.reshape(nkv, g, hd, *rest), k.reshape(nkv, 1, hd, *rest), v.reshape(nkv, 1, hd, *rest)]
    return torch.cat(parts, dim=1).reshape(cfg.qkv_size, *rest)


def _split_qkv(cfg: TransformerConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, hd, nkv = cfg.num_heads // cfg.kv_heads, cfg.head_dim, cfg.kv_heads
    rest = qkv.shape[1:]
    t = qkv.reshape(nkv, g + 2, hd, *rest)
    return (t[:, :g].reshape(nkv * g * hd, *rest).clone(), t[:, g].reshape(nkv * hd, *rest).clone(),
            t[:, g + 1].reshape(nkv * hd, *rest).clone())


def _names(cfg: TransformerConfig, index: int) -> dict[str, str]:
    """Our parameter name -> Hugging Face name for layer `index` (fused qkv excluded)."""
    fam = _family(cfg)
    kind = cfg.layer_kind(index)
    if kind == "block":
        pre = f"{_LAYER_PREFIX[fam]}{index - 1}."
        return {ours: pre + theirs for ours, theirs in _BLOCK[fam].items()}
    return {ours: theirs for (k, ours), theirs in _ENDS[fam].items() if k == kind}


def layer_shapes(cfg: TransformerConfig, index: int) -> dict[str, tuple[int, ...]]:
    """Full-layout parameter shapes of layer `index`, without allocating or initialising it."""

    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in _new_layer(cfg, index, TPContext.single()).named_parameters()}


def hf_shapes(cfg: TransformerConfig, index: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> the shape `cfg` gives it, for layer `index` (separate q/k/v included;
    a tied head's lm_head, which a file may leave out, too)."""
    fam = _family(cfg)
    shapes = layer_shapes(cfg, index)
    out = {theirs: shapes[ours] for ours, theirs in _names(cfg, index).items() if ours in shapes}
    if cfg.layer_kind(index) == "block" and fam in _SEPARATE_QKV:
        pre = f"{_LAYER_PREFIX[fam]}{index - 1}."
        rows = (cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim)
        for kind in ("weight", "bias"):
            if f"attn.qkv.{kind}" in shapes:
                rest = shapes[f"attn.qkv.{kind}"][1:]
                out.update({f"{pre}{p}.{kind}": (n, *rest) for p, n in zip(_SEPARATE_QKV[fam], rows, strict=True)})
    return out


def _shape_error(cfg: TransformerConfig, name: str, got: tuple[int, ...], want: tuple[int, ...]) -> SailorError:
    why = ""
    if any(p in name for p in (".k_proj.", ".v_proj.")):
        why = f" (num_key_value_heads {cfg.kv_heads} x head_dim {cfg.head_dim} rows)"
    elif ".q_proj." in name:
        why = f" (num_attention_heads {cfg.num_heads} x head_dim {cfg.head_dim} rows)"
    return SailorError(f"tensor {name!r} has shape {list(got)} in the weights but model {cfg.name}'s config gives "
                       f"{list(want)}{why}; to fix: pass the config.json these weights were saved with")


def hf_to_layers(cfg: TransformerConfig, tensors: Mapping[str, torch.Tensor],
                 layers: list[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Full-layout states of `layers` (default: all; with all, unused tensors are an error). Every
    tensor's shape is checked against the config, by its Hugging Face name, before it is fused."""
    fam = _family(cfg)
    used: set[str] = set()
    embedding_name = _ENDS[fam][("embedding", "wte.weight")]

    def take(name: str, want: tuple[int, ...]) -> torch.Tensor:
        if name not in tensors:
            raise SailorError(f"the weights have no tensor {name!r} that model {cfg.name} needs; to fix: pass the "
                              f"safetensors of the model its config.json describes")
        t = tensors[name]
        if tuple(t.shape) != want:
            raise _shape_error(cfg, name, tuple(t.shape), want)
        used.add(name)
        return t.detach().to(torch.float32)

    out: dict[int, dict[str, torch.Tensor]] = {}
    for i in range(cfg.num_layers) if layers is None else layers:
        shapes, expected = layer_shapes(cfg, i), hf_shapes(cfg, i)
        state: dict[str, torch.Tensor] = {}
        for ours, theirs in _names(cfg, i).items():
            if ours not in shapes:
                continue
            want = expected[theirs]
            if ours == "out.weight" and cfg.tied_head and theirs not in tensors:
                theirs = embedding_name  # save_pretrained writes a tied weight once
            state[ours] = take(theirs, want)
        if cfg.layer_kind(i) == "block" and fam in _SEPARATE_QKV:
            pre = f"{_LAYER_PREFIX[fam]}{i - 1}."
            for kind in ("weight", "bias"):
                if f"attn.qkv.{kind}" in shapes:
                    q, k, v = (take(f"{pre}{p}.{kind}", expected[f"{pre}{p}.{kind}"]) for p in _SEPARATE_QKV[fam])
                    state[f"attn.qkv.{kind}"] = _fuse_qkv(cfg, q, k, v)
        for n, shape in shapes.items():
            if n not in state:
                raise SailorError(f"model {cfg.name}: no weights map to layer {i}'s {n}")
            if tuple(state[n].shape) != shape:
                raise SailorError(f"model {cfg.name}: layer {i}'s {n} has shape {tuple(state[n].shape)} in the "
                                  f"weights but {shape} in the config; to fix: pass the config.json of these weights")
        out[i] = state
    unused = sorted(n for n in set(tensors) - used if not n.endswith(IGNORED_SUFFIXES))
    if unused and layers is None:
        raise SailorError(f"the weights hold tensors model {cfg.name} does not use, e.g. {unused[:3]}; to fix: pass "
                          f"the config.json these weights were saved with")
    return out


def layers_to_hf(cfg: TransformerConfig, states: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Hugging Face tensors of the layers in `states` (all of them, or a group of a sharded export)."""
    fam = _family(cfg)
    out: dict[str, torch.Tensor] = {}
    for i in sorted(states):
        state = states[i]
        for ours, theirs in _names(cfg, i).items():
            if ours not in state or (ours == "out.weight" and cfg.tied_head):
                continue
            out[theirs] = state[ours].detach().to("cpu").contiguous().clone()
        if cfg.layer_kind(i) == "block" and fam in _SEPARATE_QKV:
            pre = f"{_LAYER_PREFIX[fam]}{i - 1}."
            for kind in ("weight", "bias"):
                if f"attn.qkv.{kind}" in state:
                    for p, t in zip(_SEPARATE_QKV[fam], _split_qkv(cfg, state[f"attn.qkv.{kind}"]), strict=True):
                        out[f"{pre}{p}.{kind}"] = t.contiguous()
    return out


INDEX_NAME = "model.safetensors.index.json"  # transformers' sharded layout: tensor name -> file


def _unreadable(path: str, e: Exception) -> SailorError:
    reason = " ".join(str(e).split()) or type(e).__name__
    return SailorError(f"weights file {redact(path)!r} is not a readable safetensors file ({reason}); to fix: pass "
                       f"the model's .safetensors files (download or export this one again)")


class LazyTensors(Mapping[str, torch.Tensor]):
    """Tensors of local .safetensors files, each read from its file only when asked for (memory-
    mapped by safetensors), so a model far larger than memory can be mapped layer by layer."""

    def __init__(self, paths: list[str], keep: Callable[[str], bool] = lambda name: True):
        from safetensors import safe_open

        self._where: dict[str, Any] = {}
        self.file_of: dict[str, str] = {}
        for p in paths:
            try:
                handle = safe_open(p, framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error type (and OSError)
                raise _unreadable(p, e) from None
            for k in handle.keys():  # noqa: SIM118 - not a dict
                if keep(k):
                    _no_duplicate(k, self.file_of, p)
                    self._where[k], self.file_of[k] = handle, p

    def __getitem__(self, name: str) -> torch.Tensor:
        t: torch.Tensor = self._where[name].get_tensor(name)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def meta(self) -> dict[str, torch.Tensor]:
        """Shape-only (meta device) stand-ins of every tensor, read from the files' headers."""
        return {k: torch.empty(self._where[k].get_slice(k).get_shape(), device="meta") for k in self._where}


def _no_duplicate(name: str, file_of: dict[str, str], path: str) -> None:
    if name in file_of:
        raise SailorError(f"tensor {name!r} is in both {redact(file_of[name])!r} and {redact(path)!r}; to fix: pass "
                          f"the model's {INDEX_NAME}, or a folder holding one copy of the weights")


def read_safetensors(uri: str) -> Mapping[str, torch.Tensor]:
    """Every tensor of one .safetensors file, of the files a `model.safetensors.index.json` lists (the
    index itself, or a folder holding one: files it does not list are not read), or of all
    *.safetensors in a folder without an index: lazily from local files (`LazyTensors`), read whole
    from object storage (s3:// / gs://). An unreadable file, a tensor in two files, or a tensor the
    index names but its file lacks is a `SailorError` naming the file."""
    from safetensors.torch import load

    files, weight_map = _weight_files(uri)
    keep: Callable[[str], bool] = (lambda name: True) if weight_map is None else weight_map.__contains__
    tensors: Mapping[str, torch.Tensor]
    if all("://" not in f or f.startswith("file://") for f in files):
        lazy = LazyTensors([f.removeprefix("file://") for f in files], keep)
        tensors, file_of = lazy, lazy.file_of
    else:
        out: dict[str, torch.Tensor] = {}
        file_of = {}
        for f in files:
            try:
                part = load(read_bytes(f))
            except SailorError:
                raise
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
                raise _unreadable(f, e) from None
            for k, t in part.items():
                if keep(k):
                    _no_duplicate(k, file_of, f)
                    out[k], file_of[k] = t, f
        tensors = out
    if weight_map is not None:
        _check_index(uri, weight_map, file_of)
    return tensors


def _check_index(uri: str, weight_map: dict[str, str], file_of: dict[str, str]) -> None:
    for name, file in sorted(weight_map.items()):
        found = file_of.get(name)
        if found is None or _base_name(found) != file:
            where = f"is in {_base_name(found)!r}" if found else "is in none of its files"
            raise SailorError(f"{INDEX_NAME} of {redact(uri)!r} puts tensor {name!r} in {file!r} but it {where}; "
                              f"to fix: pass the index written with these files (or the files without it)")


def _base_name(path: str) -> str:
    return path.partition("?")[0].rstrip("/").rsplit("/", 1)[-1]


def meta_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Shape-only stand-ins of `tensors`, without reading their data where it is lazy."""
    if isinstance(tensors, LazyTensors):
        return tensors.meta()
    return {n: t.to("meta") for n, t in tensors.items()}


def _weight_files(uri: str) -> tuple[list[str], dict[str, str] | None]:
    """The weight files `uri` names and, where an index names them, its weight_map (tensor -> file)."""
    base, _, query = uri.partition("?")
    if base.endswith(".safetensors"):
        return [uri], None
    if base.endswith(".json"):
        return _indexed_files(uri)
    names = _folder_names(uri)
    if INDEX_NAME in names:
        return _indexed_files(_join(uri, INDEX_NAME))
    found = [_join(uri, n) for n in sorted(names) if n.endswith(".safetensors")]
    if not found:
        raise SailorError(
            f"no .safetensors files in {redact(uri)!r}; to fix: pass a .safetensors file, the folder holding "
            f"them or their {INDEX_NAME}"
        )
    return found, None


def _join(folder_uri: str, name: str) -> str:
    base, sep, query = folder_uri.partition("?")
    return f"{base.rstrip('/')}/{name}{sep}{query}"


def _folder_names(uri: str) -> list[str]:
    """Names of the files directly in folder or prefix `uri`."""
    if "://" not in uri or uri.startswith("file://"):
        path = uri.removeprefix("file://")
        if not os.path.isdir(path):
            raise SailorError(f"{path!r} is neither a .safetensors file, an index nor a folder; to fix: check the path")
        return [n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))]
    from pyarrow import fs as pafs


    filesystem, root = filesystem_for(uri)
    infos = filesystem.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    return [i.base_name for i in infos if i.type == pafs.FileType.File]


def _indexed_files(index_uri: str) -> tuple[list[str], dict[str, str]]:
    """The files of a `model.safetensors.index.json` (beside it) and its weight_map."""
    shown = redact(index_uri)
    try:
        index = json.loads(read_bytes(index_uri))
    except json.JSONDecodeError as e:
        raise SailorError(f"{shown!r} is not valid JSON ({e}); to fix: pass the {INDEX_NAME} transformers "
                          f"wrote, or the .safetensors files") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(f, str) and f.endswith(".safetensors") and "/" not in f for f in weight_map.values()):
        raise SailorError(f"{shown!r} has no weight_map of tensor names to .safetensors files beside it; to fix: "
                          f"pass a {INDEX_NAME} as transformers writes it, or the .safetensors files")
    base, sep, query = index_uri.partition("?")
    folder = base.rsplit("/", 1)[0] if "/" in base else "."
    files = [f"{folder}/{name}{sep}{query}" for name in sorted(set(weight_map.values()))]
    for f in files:
        if ("://" not in f or f.startswith("file://")) and not os.path.isfile(f.removeprefix("file://")):
            raise SailorError(f"{shown!r} lists {_base_name(f)!r}, which is not beside it; to fix: put every file "
                              f"the index lists in its folder")
    return files, weight_map


DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default max_shard_size ("5GB")


def export_groups(cfg: TransformerConfig, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[list[int]]:
    """Consecutive layers per output file, each file at most `max_shard_bytes` of fp32 tensors (a
    layer larger than that gets a file of its own)."""
    groups: list[list[int]] = [[]]
    size = 0
    for i in range(cfg.num_layers):
        shapes = layer_shapes(cfg, i)
        if cfg.tied_head and cfg.layer_kind(i) == "head":
            shapes.pop("out.weight", None)  # written once, as the embedding
        n = 4 * sum(math.prod(s) for s in shapes.values())
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def write_safetensors_sharded(parts: Iterable[dict[str, torch.Tensor]], num_parts: int, cfg: TransformerConfig,
                              out: str, *, flag: str = "export folder") -> list[str]:
    """Write `num_parts` tensor groups as `model.safetensors` (one part) or `model-0000k-of-0000n.safetensors`
    plus `model.safetensors.index.json` (transformers' sharded layout), then `config.json`, into folder or
    prefix `out`, holding one part in memory at a time; returns the names written. An earlier export there
    is replaced as a unit, and a folder holding anything else is refused (sailor_core/models/export_target.py)."""
    from safetensors.torch import save


    names: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    with export_writer(flag, out) as write:
        for k, tensors in enumerate(parts):
            name = "model.safetensors" if num_parts == 1 else f"model-{k + 1:05d}-of-{num_parts:05d}.safetensors"
            write(name, save(tensors, metadata={"format": "pt"}))
            names.append(name)
            weight_map.update({t: name for t in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        if len(names) != num_parts:
            raise SailorError(f"export wrote {len(names)} weight files, expected {num_parts}")
        if num_parts > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            write("model.safetensors.index.json", json.dumps(index, indent=1).encode())
            names.append("model.safetensors.index.json")
        write("config.json", json.dumps(hf_config_of(cfg), indent=1).encode())
    return [*names, "config.json"]


def write_safetensors(tensors: dict[str, torch.Tensor], cfg: TransformerConfig, out: str) -> list[str]:
    """`model.safetensors` and `config.json` into folder or prefix `out`; returns the names written."""
    return write_safetensors_sharded([tensors], 1, cfg, out)
