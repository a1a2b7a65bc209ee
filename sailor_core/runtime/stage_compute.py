"""One stage's forward and backward of a microbatch, and the samples each microbatch reads.

Contract: sample g of a step is global sample `samples_seen + g`; pipeline j takes the contiguous
range of the global batch starting at `sample_offset(plan, j)`, microbatch m of it the next
`microbatch_size` samples from `m * microbatch_size` on. Each microbatch contributes
sum(token CE) / (global tokens) (`loss_scale`), so the gradient is the exact mean over the global
batch for any pipelines' microbatch sizes and counts. `begin(samples_seen)` starts a step;
`forward(m, inp)` returns the activation to send on (None on the last stage, which adds the
microbatch's loss to `loss`); `backward(m, grad_out)` returns its input's gradient to send back
(None where nobody receives it). Before the last microbatch's backward it calls `on_last_backward`
(the data-parallel overlap: the gradients become final during it). Under bf16 the forward runs in
autocast and messages travel in bf16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from sailor_core.domain import ParallelPlan
from sailor_core.models.torch_model import StageModel
from sailor_core.runtime.data import TokenBatches
from sailor_core.runtime.topology import RankInfo, sample_offset


class StageCompute:
    """Forward and backward of this rank's microbatches (see the module's contract)."""

    def __init__(self, model: StageModel, data: TokenBatches | None, plan: ParallelPlan, me: RankInfo,
                 sequence_length: int, hidden_size: int, device: torch.device, *, sends_input_grad: bool,
                 on_last_backward: Callable[[], None]) -> None:
        pipe = plan.pipelines[me.pipeline]
        self.model, self.data, self.device = model, data, device
        self.bf16 = plan.precision == "bf16"
        self.comm_dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.microbatch_size, self.num_microbatches = pipe.microbatch_size, pipe.num_microbatches
        self.act_shape = (pipe.microbatch_size, sequence_length, hidden_size)
        self.loss_scale = 1.0 / (plan.global_batch_size * sequence_length)
        self.offset = sample_offset(plan, me.pipeline)
        self.sends_input_grad = sends_input_grad
        self.on_last_backward = on_last_backward
        self.first_sample = 0
        self.stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # microbatch -> (input, output)
        self.loss = torch.zeros((), dtype=torch.float32, device=device)

    def begin(self, samples_seen: int) -> None:
        self.first_sample = samples_seen + self.offset
        self.stash = {}
        self.loss = torch.zeros((), dtype=torch.float32, device=self.device)

    def _autocast(self) -> Any:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _samples(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.data is not None
        x, y = self.data.batch(self.first_sample + m * self.microbatch_size, self.microbatch_size)
        return x.to(self.device), y.to(self.device)

    def forward(self, m: int, inp: torch.Tensor | None) -> torch.Tensor | None:
        """Forward of microbatch m on the received activation `inp` (None on the first stage)."""
        if self.model.has_embedding:
            x, _ = self._samples(m)
        else:
            assert inp is not None
            x = inp.requires_grad_(True)
        with self._autocast():
            out: torch.Tensor = self.model(x)
        if self.model.has_head:
            _, y = self._samples(m)
            loss = self.model.loss_sum(out, y) * self.loss_scale
            self.loss += loss.detach().float()
            self.stash[m] = (inp, loss)
            return None
        self.stash[m] = (inp, out)
        return out.detach().to(self.comm_dtype).contiguous()

    def backward(self, m: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of microbatch m given its output's gradient (None on the last stage)."""
        inp, out = self.stash.pop(m)
        if m == self.num_microbatches - 1:
            self.on_last_backward()
        if self.model.has_head:
            out.backward()
        else:
            assert grad_out is not None
            torch.autograd.backward(out, grad_out.to(out.dtype))
        if inp is None or not self.sends_input_grad:
            return None
        if inp.grad is None:
            raise RuntimeError(f"microbatch {m}: the received activation got no gradient in backward")
        return inp.grad.to(self.comm_dtype).contiguous()
