"""What a trainer hands to checkpointing: its shard, its optimizer and where it stands.

Contract: `TrainState` is a frozen view of one rank's training state at one moment, built by
`Trainer.state()`: the model config, this rank's stage model (TP-sharded), its optimizer, its TP
context, the ids of the parameters its optimizer steps (`owned`), its ZeRO-1 state (None without
ZeRO-1), whether the state is whole (`consistent`: False only while the optimizer updates it),
where training stands (`progress`) and the last step it checkpointed (`saved_step`). The tensors
are the trainer's own, not copies: checkpoint I/O (checkpoint_io.py, memory_checkpoint.py) reads and
writes them through this view and never reaches into the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sailor_core.models.config import TransformerConfig
from sailor_core.models.tensor_parallel import TPContext
from sailor_core.models.torch_model import StageModel
from sailor_core.runtime.data_parallel import Zero1


@dataclass(frozen=True)
class Progress:
    """Where training stands: steps done, samples consumed, optimizer steps taken."""

    step: int
    samples_seen: int
    opt_steps: int


@dataclass(frozen=True, kw_only=True)
class TrainState:
    """One rank's training state (see the module's contract)."""

    cfg: TransformerConfig
    model: StageModel
    opt: torch.optim.Optimizer
    tp: TPContext
    owned: frozenset[int]  # ids of the parameters this rank's optimizer steps
    zero1: Zero1 | None
    consistent: bool
    progress: Progress
    saved_step: int

    def layer_key(self, li: int) -> tuple[Any, ...]:
        """What this state holds of layer `li`: the same key means the same tensors, shard for shard."""
        return (self.cfg.name, li, self.tp.rank, self.tp.size)
