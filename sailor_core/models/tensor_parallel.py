"""Megatron-style tensor parallelism over a torch.distributed process group.

Contract:
- `TPContext(group, rank, size)`: the TP group of one replica. `TPContext.single()` is tp=1 and
  needs no process group at all (every collective below is then the identity).
- `ColumnParallelLinear` holds rows [r*out/tp, (r+1)*out/tp) of the full weight; its input is
  replicated and its output sharded. `RowParallelLinear` holds columns [r*in/tp, ...); its input is
  sharded and its output is all-reduced (bias added once, after the reduction).
- `VocabParallelEmbedding` holds rows of the vocabulary; `gather_last_dim` rebuilds a full tensor.
- Every parameter carries `sailor_shard_dim` (0, 1 or None for replicated), so full weights can be
  split into shards (`shard`) and shards gathered back (`unshard`) for any TP degree.
The autograd functions are the conjugate pairs of Megatron (copy <-> reduce), so gradients of
replicated tensors are identical on every TP rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SHARD_ATTR = "sailor_shard_dim"

# How a collective's work handle is awaited. The runtime installs an abortable wait (so a lost peer
# cannot hang a survivor); the profiler and tests keep the plain one.
_WAIT: list[Callable[[Any], None]] = [lambda work: work.wait()]


def set_wait(fn: Callable[[Any], None]) -> None:
    _WAIT[0] = fn


def _all_reduce(x: torch.Tensor, group: Any, op: Any = None) -> None:
    _WAIT[0](dist.all_reduce(x, op=op if op is not None else dist.ReduceOp.SUM, group=group, async_op=True))


@dataclass(frozen=True)
class TPContext:
    group: Any  # a ProcessGroup, or None for tp == 1
    rank: int = 0
    size: int = 1

    @staticmethod
    def single() -> TPContext:
        return TPContext(None, 0, 1)

    def __post_init__(self) -> None:
        if self.size > 1 and self.group is None:
            raise ValueError(f"tp={self.size} needs a process group")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside 0..{self.size - 1}")


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.contiguous()
        _all_reduce(g, ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        _all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.size = rank, size
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        _WAIT[0](dist.all_gather(parts, x, group=group, async_op=True))
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return g.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None, None, None


def apply_function(fn: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    """`fn.apply(*args)` for an autograd Function returning one tensor, typed (torch's `apply` is not)."""
    out: torch.Tensor = fn.apply(*args)
    return out


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else apply_function(_CopyToTP, x, tp.group)


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else apply_function(_ReduceFromTP, x, tp.group)


def all_reduce_(x: torch.Tensor, tp: TPContext, op: str = "sum") -> None:
    """In-place all-reduce over the TP group outside autograd (a no-op for tp == 1)."""
    if tp.size > 1:
        _all_reduce(x, tp.group, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)


def gather_last_dim(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return x if tp.size == 1 else apply_function(_GatherLastDim, x, tp.group, tp.rank, tp.size)


def _param(shape: tuple[int, ...], shard_dim: int | None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape))
    setattr(p, SHARD_ATTR, shard_dim)
    return p


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r with W split by output rows; input replicated, output sharded."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool = True):
        super().__init__()
        if out_features % tp.size:
            raise ValueError(f"out_features {out_features} not divisible by tp {tp.size}")
        self.tp = tp
        self.weight = _param((out_features // tp.size, in_features), 0)
        self.bias = _param((out_features // tp.size,), 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b with W split by input columns; input sharded, output replicated."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool = True):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"in_features {in_features} not divisible by tp {tp.size}")
        self.tp = tp
        self.weight = _param((out_features, in_features // tp.size), 1)
        self.bias = _param((out_features,), None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split in contiguous row ranges over the TP group."""

    def __init__(self, vocab_size: int, dim: int, tp: TPContext):
        super().__init__()
        if vocab_size % tp.size:
            raise ValueError(f"vocab {vocab_size} not divisible by tp {tp.size}")
        self.tp = tp
        self.per_rank = vocab_size // tp.size
        self.weight = _param((self.per_rank, dim), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        lo = self.tp.rank * self.per_rank
        outside = (ids < lo) | (ids >= lo + self.per_rank)
        local = (ids - lo).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp)


def shard(full: torch.Tensor, shard_dim: int | None, rank: int, size: int) -> torch.Tensor:
    """This rank's piece of a full tensor (a copy, contiguous)."""
    if shard_dim is None or size == 1:
        return full.clone()
    return full.chunk(size, dim=shard_dim)[rank].clone().contiguous()


def unshard(pieces: list[torch.Tensor], shard_dim: int | None) -> torch.Tensor:
    """Full tensor from the pieces of all TP ranks in rank order."""
    if shard_dim is None:
        return pieces[0].clone()
    return torch.cat(pieces, dim=shard_dim)


def shard_slice(full_shape: tuple[int, ...], shard_dim: int | None, rank: int, size: int) -> tuple[slice, ...]:
    """Index of this rank's piece inside the full tensor (for placing a shard into a full buffer)."""
    idx = [slice(None)] * len(full_shape)
    if shard_dim is not None and size > 1:
        n = full_shape[shard_dim] // size
        idx[shard_dim] = slice(rank * n, (rank + 1) * n)
    return tuple(idx)
