"""Tensor parallelism in the runtime: each replica's TP group, and the full layout TP shards meet in.

Contract:
- `tp_context(plan, rank, backend)` creates the TP group of every replica with tp > 1, in stage-major
  order (every rank calls it: torch requires every rank to create every group, in one order), and
  returns this rank's `TPContext` (`TPContext.single()` when its replica has tp == 1). The sharded
  layers themselves are sailor_core/models/tensor_parallel.py's.
- `FullLayout(params, tp)`: where each parameter's full (unsharded) tensor lies in one flat buffer,
  and `place`/`take` of this TP rank's shard in it. Replicas that shard a stage differently (data
  parallelism over different TP degrees), and a tied embedding and head on two TP degrees, add
  their gradients there; each replica's TP ranks together cover every full tensor exactly once
  (a replicated tensor: TP rank 0 only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from sailor_core.domain import ParallelPlan
from sailor_core.models.tensor_parallel import SHARD_ATTR, TPContext, shard_slice
from sailor_core.runtime.topology import ranks_of


def tp_context(plan: ParallelPlan, rank: int, backend: str) -> TPContext:
    """Create every replica's TP group (collective over the world, one order); this rank's context."""
    mine = TPContext.single()
    for s, st in enumerate(plan.stages):
        for j, rep in enumerate(st.replicas):
            if rep.tp > 1:
                ranks = ranks_of(plan, s, j)
                g = dist.new_group(ranks, backend=backend)
                if rank in ranks:
                    mine = TPContext(g, ranks.index(rank), rep.tp)
    return mine


def full_shape(p: torch.Tensor, tp: TPContext) -> tuple[int, ...]:
    """The shape of the full tensor that `p` is this TP rank's shard of."""
    dim = getattr(p, SHARD_ATTR, None)
    shape = list(p.shape)
    if dim is not None:
        shape[dim] *= tp.size
    return tuple(shape)


class FullLayout:
    """Parameters' full tensors side by side in one flat float32 buffer (see the module's contract)."""

    def __init__(self, params: Sequence[torch.Tensor], tp: TPContext) -> None:
        self.tp = tp
        self.views: list[tuple[torch.Tensor, int | None, tuple[int, ...], int, int]] = []
        total = 0
        for p in params:
            shape = full_shape(p, tp)
            n = math.prod(shape)
            self.views.append((p, getattr(p, SHARD_ATTR, None), shape, total, n))
            total += n
        self.numel = total

    def place(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """A zero buffer holding `tensors` (one per parameter, shaped like it) at this TP rank's slices."""
        flat = torch.zeros(self.numel, dtype=torch.float32, device=device)
        for (_, dim, shape, off, n), t in zip(self.views, tensors, strict=True):
            if dim is None and self.tp.rank != 0:
                continue
            flat[off:off + n].view(shape)[shard_slice(shape, dim, self.tp.rank, self.tp.size)] = t
        return flat

    def take(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy this TP rank's slices of `flat` back into `tensors`."""
        for (_, dim, shape, off, n), t in zip(self.views, tensors, strict=True):
            t.copy_(flat[off:off + n].view(shape)[shard_slice(shape, dim, self.tp.rank, self.tp.size)])
