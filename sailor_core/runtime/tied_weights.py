"""Tied embedding and head on different stages: two copies that stay one weight.

Contract: a model whose head shares the embedding's weight (`cfg.tied_head`) and whose plan puts
them on different stages keeps one copy on each. After the data-parallel sync each replica of the
two stages holds its stage's total, and each pipeline's embedding and head add theirs (Megatron's
embedding group), so both copies stay the single weight's.
- `TiedWeights(plan, cfg, rank, backend)` creates the tie groups (`topology.tie_groups`; every rank
  creates every group, in one order). Where the two TP degrees agree, TP rank t of one end meets TP
  rank t of the other and they add their vocabulary slice; else the pipeline's two TP groups meet
  in the full layout.
- `sync(model, tp, device, wait)` adds the two ends' gradients (nothing on a rank without an end).
- `duplicate(model)`: the head's copy, which the global gradient norm skips (counted once, on the
  embedding's stage); None where there is no second copy here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sailor_core.domain import ParallelPlan
from sailor_core.models.config import TransformerConfig
from sailor_core.models.tensor_parallel import TPContext, shard_slice
from sailor_core.models.torch_model import StageModel
from sailor_core.runtime.data_parallel import grad_of
from sailor_core.runtime.topology import tie_groups


def tied_param(model: StageModel) -> nn.Parameter | None:
    """This stage's end of the tied weight: the embedding's, else the head's (None: neither here)."""
    if model.has_embedding:
        return model.embedding().wte.weight
    if model.has_head:
        return model.head().out.weight
    return None


class TiedWeights:
    """This rank's end of the tie, if any (see the module's contract)."""

    def __init__(self, plan: ParallelPlan, cfg: TransformerConfig, rank: int, backend: str) -> None:
        self.split = cfg.tied_head and plan.num_stages > 1
        self.group: Any = None
        self.sliced = False
        if not self.split:
            return
        for ranks, sliced in tie_groups(plan):  # every rank creates every group, in one order
            g = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                self.group, self.sliced = g, sliced

    def duplicate(self, model: StageModel) -> torch.Tensor | None:
        return model.head().out.weight if self.split and model.has_head else None

    def sync(self, model: StageModel, tp: TPContext, device: torch.device, wait: Callable[[Any], None]) -> None:
        p = tied_param(model)
        if self.group is None or p is None:
            return
        if self.sliced:  # both ends hold the same vocabulary slice
            buf = grad_of(p).to(torch.float32)
            wait(dist.all_reduce(buf, group=self.group, async_op=True))
            if buf is not grad_of(p):
                grad_of(p).copy_(buf)
            return
        full_shape = (p.shape[0] * tp.size, p.shape[1])
        buf = torch.zeros(full_shape, dtype=torch.float32, device=device)
        idx = shard_slice(full_shape, 0, tp.rank, tp.size)
        buf[idx] = grad_of(p)
        wait(dist.all_reduce(buf, group=self.group, async_op=True))
        grad_of(p).copy_(buf[idx])
