"""The torch model family: layers built by store index, tensor-parallel, deterministic by (seed, layer).

Contract:
- `build_layer(cfg, index, tp=TPContext.single(), seed=0)` builds layer `index` of the store's
  indexing (0 embedding, 1..L blocks, L+1 final norm + head) holding this TP rank's shards, with
  weights that depend only on (seed, index): the full weights come from `full_layer_state`, and
  every TP degree slices the same full tensors, so every plan starts from the same model.
- `StageModel(cfg, first, last, tp, seed, recompute=False)` chains layers [first, last]
  (inclusive); its forward takes token ids (if it holds the embedding) or hidden states, and returns
  hidden states or, if it holds the head, this TP rank's share of the logits (vocabulary-parallel:
  rows [r*V/tp, (r+1)*V/tp) of the vocabulary; `StageModel.logits` gathers them). With `recompute`
  its blocks keep only their input for backward and run their forward again during backward.
- `loss_sum(logits, targets, tp)` is the summed token cross-entropy in fp32 over vocabulary-
  parallel logits (Megatron's vocab-parallel cross-entropy: max, sum of exponentials and the
  target's logit are all-reduced over the TP group, so no rank holds full-vocabulary logits); the
  runtime divides by the global token count so microbatches and pipelines of any size weigh samples
  exactly.
- Attention's fused QKV rows are ordered (KV group, [its query heads..., key, value], head_dim), so
  an even split over TP ranks gives each rank whole KV groups (grouped-query attention needs
  num_kv_heads divisible by tp); with one query head per KV head this is (head, q|k|v, head_dim).
- `layer_full_state(layer)` / `load_full_state(layer, state)` move between a layer's TP shards
  and full-layout tensors keyed by parameter name (`unshard` needs the TP group's pieces; see
  runtime.checkpoint). `param_shard_dims(layer)` says how each parameter is split.
Activations kept for backward match config.layer_activation_bytes (the profiler tests this).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sailor_core.models.config import TransformerConfig
from sailor_core.models.tensor_parallel import (
    SHARD_ATTR,
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    all_reduce_,
    apply_function,
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
            self.offset = cfg.position_offset
            self.wpe = nn.Parameter(torch.empty(cfg.position_rows, cfg.hidden_size))
            setattr(self.wpe, SHARD_ATTR, None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.wte(ids)
        if self.wpe is not None:
            x = x + self.wpe[self.offset: self.offset + ids.shape[-1]]
        return x


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig, tp: TPContext):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.local_heads = cfg.num_heads // tp.size
        self.local_groups = cfg.kv_heads // tp.size
        self.group = cfg.num_heads // cfg.kv_heads  # query heads per KV head
        # Full-layout QKV rows are ordered (KV group, [q_1..q_group, k, v], head_dim), so splitting
        # rows evenly gives each TP rank whole KV groups with their queries, key and value.
        self.qkv = ColumnParallelLinear(cfg.hidden_size, cfg.qkv_size, tp, bias=cfg.bias or cfg.qkv_bias)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, tp, bias=cfg.bias)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        """Rotary positions on the first `rotary_dims` of each head (rotate-half convention)."""
        s, rd = x.shape[-2], self.cfg.rotary_dims
        cos, sin = rope_tables(self.cfg, x.device)
        rot = x if rd == x.shape[-1] else x[..., :rd]
        x1, x2 = rot.chunk(2, dim=-1)
        rot = rot * cos[:s] + torch.cat([-x2, x1], dim=-1) * sin[:s]
        return rot if rd == x.shape[-1] else torch.cat([rot, x[..., rd:]], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        g, hd = self.group, self.cfg.head_dim
        qkv = self.qkv(x).view(b, s, self.local_groups, g + 2, hd)
        if g == 1:
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        else:
            q = qkv[:, :, :, :g].reshape(b, s, self.local_heads, hd).transpose(1, 2)
            k, v = qkv[:, :, :, g].transpose(1, 2), qkv[:, :, :, g + 1].transpose(1, 2)
        if self.cfg.rotary:
            q, k = self._rope(q), self._rope(k)
        if g > 1:  # query head i uses KV head i // g (Hugging Face's repeat_kv)
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(o.transpose(1, 2).reshape(b, s, self.local_heads * self.cfg.head_dim))
        return out


_ROPE_TABLES: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_tables(cfg: TransformerConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotary angles, [sequence_length, rotary_dims] in fp32: one
    pair per (rotary settings, device) in the process, shared by every layer (one table per layer
    would hold, e.g., 2 x 4 MiB x 32 layers at 8192 positions of 128 dimensions)."""
    key = (cfg.sequence_length, cfg.rotary_dims, cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor,
           cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_positions, str(device))
    hit = _ROPE_TABLES.get(key)
    if hit is None:
        ang = torch.outer(torch.arange(cfg.sequence_length, dtype=torch.float64), rope_inv_freq(cfg))
        ang = torch.cat([ang, ang], dim=-1)
        hit = _ROPE_TABLES[key] = (ang.cos().float().to(device), ang.sin().float().to(device))
    return hit


def rope_inv_freq(cfg: TransformerConfig) -> torch.Tensor:
    """Rotary inverse frequencies (float64), with the config's scaling (Hugging Face's rope_init_fn)."""
    hd = cfg.rotary_dims
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if cfg.rope_scaling == "linear":
        return inv / cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        old = cfg.rope_original_max_positions
        low_wavelen, high_wavelen = old / cfg.rope_low_freq_factor, old / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        smooth = (old / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


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
        out: torch.Tensor
        if self.kind == "swiglu":
            out = self.w2(F.silu(self.w1(x)) * self.w3(x))
            return out
        y = self.fc1(x)
        y = F.relu(y) if self.kind == "relu" else F.gelu(y)
        out = self.fc2(y)
        return out


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: TransformerConfig, tp: TPContext):
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.ln1 = _norm(cfg)
        self.attn = Attention(cfg, tp)
        self.ln2 = _norm(cfg)
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn: torch.Tensor = self.attn(self.ln1(x))
        if self.parallel:  # GPT-NeoX: both branches read the block's input
            mlp: torch.Tensor = self.mlp(self.ln2(x))
            return x + attn + mlp
        x = x + attn
        mlp = self.mlp(self.ln2(x))
        return x + mlp


class HeadLayer(nn.Module):
    """Final norm and the vocabulary projection; returns this TP rank's vocabulary shard of the logits."""

    def __init__(self, cfg: TransformerConfig, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.norm = _norm(cfg)
        self.out = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.norm(x))
        return logits


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
                raise ValueError(
                    f"{name}: full shape {tuple(state[name].shape)} gives {tuple(piece.shape)}, need {tuple(p.shape)}"
                )
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
                 seed: int = 0, states: dict[int, dict[str, torch.Tensor]] | None = None,
                 recompute: bool = False):
        super().__init__()
        self.tp = tp or TPContext.single()
        self.recompute = recompute
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
            self.head().out.weight = self.embedding().wte.weight

    def embedding(self) -> EmbeddingLayer:
        """The token embedding (a stage holding layer 0)."""
        first = self.layers[0]
        if not isinstance(first, EmbeddingLayer):
            raise TypeError(f"layers {self.layer_ids[0]}..{self.layer_ids[-1]} of {self.cfg.name} hold no embedding")
        return first

    def head(self) -> HeadLayer:
        """The vocabulary head (a stage holding the last layer)."""
        last = self.layers[-1]
        if not isinstance(last, HeadLayer):
            raise TypeError(f"layers {self.layer_ids[0]}..{self.layer_ids[-1]} of {self.cfg.name} hold no head")
        return last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.recompute and isinstance(layer, Block) and torch.is_grad_enabled():
                # keep only the block's input; its forward (collectives included, in the same order
                # on every TP rank) runs again during backward
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (gathered over the TP group) of a stage holding the head."""
        return gather_last_dim(self(x), self.tp)

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_sum(logits, targets, self.tp)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary rows over the TP group (Megatron)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, tp: TPContext) -> torch.Tensor:
        logits = logits.float()
        mx = logits.max(dim=-1).values
        all_reduce_(mx, tp, op="max")
        shifted = logits - mx.unsqueeze(-1)
        per = logits.shape[-1]
        lo = tp.rank * per
        outside = (targets < lo) | (targets >= lo + per)
        local = (targets - lo).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        all_reduce_(picked, tp)
        ex = shifted.exp()
        total = ex.sum(dim=-1)
        all_reduce_(total, tp)
        ex.div_(total.unsqueeze(-1))  # this rank's share of the softmax: all backward needs
        ctx.save_for_backward(ex, local, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        soft, local, outside = ctx.saved_tensors
        grad = soft.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, tp: TPContext | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy in fp32 over all tokens of the microbatch.

    `logits` hold this TP rank's vocabulary rows (all of them for tp=1); the result is the same
    full-vocabulary loss on every rank of the TP group."""
    if tp is None or tp.size == 1:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return apply_function(_VocabParallelCE, logits, targets, tp).sum()
