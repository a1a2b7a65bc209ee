"""The torch model family: layers built by store index, tensor-parallel, deterministic by (seed, layer).

Contract:
- `build_layer(cfg, index, tp=TPContext.single(), seed=0)` builds layer `index` of the store's
  indexing (0 embedding, 1..L blocks, L+1 final norm + head) holding this TP rank's shards, with
  weights that depend only on (seed, index): the full weights come from `full_layer_state`, and
  every TP degree slices the same full tensors, so every plan starts from the same model.
- `StageModel(cfg, first, last, tp, seed)` chains layers [first, last] (inclusive); its forward
  takes token ids (if it holds the embedding) or hidden states, and returns hidden states or, if
  it holds the head, full-vocabulary logits.
- `loss_sum(logits, targets)` is the summed token cross-entropy in fp32 (the runtime divides by
  the global token count so microbatches and pipelines of any size weigh samples exactly).
- `layer_full_state(layer)` / `load_full_state(layer, state)` move between a layer's TP shards
  and full-layout tensors keyed by parameter name (`unshard` needs the TP group's pieces; see
  runtime.checkpoint). `param_shard_dims(layer)` says how each parameter is split.
Activations kept for backward match config.layer_activation_bytes (the profiler tests this).
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from sailor_core.models.config import TransformerConfig
from sailor_core.models.tensor_parallel import (
    SHARD_ATTR,
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    gather_last_dim,
    shard,
)


def _norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        m: nn.Module = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
    else:
        m = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
    for p in m.parameters():
        setattr(p, SHARD_ATTR, None)
    return m


class EmbeddingLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, tp: TPContext):
        super().__init__()
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.wpe = None
        if cfg.learned_positions:
            self.wpe = nn.Parameter(torch.empty(cfg.sequence_length, cfg.hidden_size))
            setattr(self.wpe, SHARD_ATTR, None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        if self.wpe is not None:
            x = x + self.wpe[: ids.shape[-1]]
        return x


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig, tp: TPContext):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.local_heads = cfg.num_heads // tp.size
        # Full-layout QKV rows are ordered (head, q|k|v, head_dim), so splitting rows evenly gives
        # each TP rank whole heads with their q, k and v.
        self.qkv = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size, tp, bias=cfg.bias)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, tp, bias=cfg.bias)
        if cfg.variant == "llama":
            hd = cfg.head_dim
            inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
            ang = torch.outer(torch.arange(cfg.sequence_length, dtype=torch.float64), inv)
            ang = torch.cat([ang, ang], dim=-1)
            self.register_buffer("cos", ang.cos().float(), persistent=False)
            self.register_buffer("sin", ang.sin().float(), persistent=False)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[-2]
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos[:s] + torch.cat([-x2, x1], dim=-1) * self.sin[:s]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.local_heads, 3, self.cfg.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        if self.cfg.variant == "llama":
            q, k = self._rope(q), self._rope(k)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(b, s, self.local_heads * self.cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig, tp: TPContext):
        super().__init__()
        self.kind = cfg.mlp
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        if self.kind == "swiglu":
            self.w1 = ColumnParallelLinear(h, f, tp, bias=False)
            self.w3 = ColumnParallelLinear(h, f, tp, bias=False)
            self.w2 = RowParallelLinear(f, h, tp, bias=False)
        else:
            self.fc1 = ColumnParallelLinear(h, f, tp, bias=cfg.bias)
            self.fc2 = RowParallelLinear(f, h, tp, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        y = self.fc1(x)
        y = F.relu(y) if self.kind == "relu" else F.gelu(y)
        return self.fc2(y)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: TransformerConfig, tp: TPContext):
        super().__init__()
        self.ln1 = _norm(cfg)
        self.attn = Attention(cfg, tp)
        self.ln2 = _norm(cfg)
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class HeadLayer(nn.Module):
    """Final norm and the vocabulary projection (vocab-parallel; logits gathered to full width)."""

    def __init__(self, cfg: TransformerConfig, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.norm = _norm(cfg)
        self.out = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_last_dim(self.out(self.norm(x)), self.tp)


def _new_layer(cfg: TransformerConfig, index: int, tp: TPContext) -> nn.Module:
    kind = cfg.layer_kind(index)
    if kind == "embedding":
        return EmbeddingLayer(cfg, tp)
    if kind == "head":
        return HeadLayer(cfg, tp)
    return Block(cfg, tp)


def param_shard_dims(layer: nn.Module) -> dict[str, int | None]:
    return {n: getattr(p, SHARD_ATTR, None) for n, p in layer.named_parameters()}


def _layer_seed(seed: int, index: int) -> int:
    digest = hashlib.sha256(f"sailor-init/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)


def full_layer_state(cfg: TransformerConfig, index: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full-layout initial weights of layer `index`, a pure function of (config, seed, index).

    GPT-2 style: normal(0, init_std) matrices, output projections scaled by 1/sqrt(2 * blocks)
    (keeps the residual stream's variance flat with depth), zero biases, unit norm weights.
    A tied head starts as a copy of the embedding (same seed stream as layer 0).
    """
    full = _new_layer(cfg, index, TPContext.single())
    g = torch.Generator().manual_seed(_layer_seed(seed, index))
    out: dict[str, torch.Tensor] = {}
    for name, p in full.named_parameters():  # registration order is fixed, so the stream is too
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            t = torch.zeros(p.shape)
        elif p.dim() == 1:
            t = torch.ones(p.shape)
        else:
            std = cfg.init_std
            if name.endswith(("proj.weight", "fc2.weight", "w2.weight")):
                std /= (2 * cfg.num_blocks) ** 0.5
            t = torch.randn(p.shape, generator=g) * std
        out[name] = t
    if cfg.tied_head and cfg.layer_kind(index) == "head":
        out["out.weight"] = full_layer_state(cfg, 0, seed)["wte.weight"]
    return out


def load_full_state(layer: nn.Module, state: dict[str, torch.Tensor], tp: TPContext) -> None:
    """Copy this TP rank's shards of full-layout `state` into `layer`'s parameters."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name not in state:
                raise KeyError(f"state has no parameter {name!r} (has {sorted(state)})")
            piece = shard(state[name], getattr(p, SHARD_ATTR, None), tp.rank, tp.size)
            if piece.shape != p.shape:
                raise ValueError(f"{name}: full shape {tuple(state[name].shape)} gives {tuple(piece.shape)}, need {tuple(p.shape)}")
            p.copy_(piece)


def build_layer(cfg: TransformerConfig, index: int, tp: TPContext | None = None, seed: int = 0,
                state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Layer `index` on this TP rank, initialised from `state` (full layout) or from (seed, index)."""
    tp = tp or TPContext.single()
    cfg.check_tp(tp.size)
    layer = _new_layer(cfg, index, tp)
    load_full_state(layer, state if state is not None else full_layer_state(cfg, index, seed), tp)
    return layer


class StageModel(nn.Module):
    """Layers [first, last] of the model on one TP rank; `layer_ids[i]` is the store index of layers[i]."""

    def __init__(self, cfg: TransformerConfig, first: int, last: int, tp: TPContext | None = None,
                 seed: int = 0, states: dict[int, dict[str, torch.Tensor]] | None = None):
        super().__init__()
        if not 0 <= first <= last < cfg.num_layers:
            raise ValueError(f"layer range [{first}, {last}] outside 0..{cfg.num_layers - 1}")
        self.cfg = cfg
        self.layer_ids = list(range(first, last + 1))
        self.layers = nn.ModuleList(
            build_layer(cfg, i, tp, seed, (states or {}).get(i)) for i in self.layer_ids
        )
        self.has_embedding = first == 0
        self.has_head = last == cfg.num_layers - 1
        if cfg.tied_head and self.has_embedding and self.has_head:
            # one parameter for both ends, so its gradient is the sum of both uses
            self.layers[-1].out.weight = self.layers[0].wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy in fp32 over all tokens of the microbatch."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
