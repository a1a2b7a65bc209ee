"""Pipeline parallelism in the runtime: who a stage exchanges with, and in which order (1F1B, GPipe).

Contract:
- Between stages activations go forward and gradients back, each message once, in slices
  (`stage_peers`): receiving TP rank r gets slice r from sending TP rank r mod tp_send and the
  receiving TP group all-gathers the slices; gradients go back from receiving rank t mod tp_recv to
  sending rank t the same way. So a message crosses the link between two stages once whatever their
  TP degrees (DeepSpeed's and Megatron's scatter/gather between stages), not once per receiving rank,
  and the TP group's own link rebuilds it.
- `P2P.exchange` posts one batch of point-to-point operations (`dist.batch_isend_irecv`): all of a
  batch's operations are posted together, so a peer whose own batch sends to us while it receives
  from us meets our receive whatever the send's semantics. Works of a batch without a receive are
  waited for at the end of the step (`drain`; the tensors stay referenced until then).
- `run_schedule` runs one step's microbatches in the plan's order: GPipe (all forwards, then all
  backwards) or 1F1B (Megatron's order: stage s runs min(S - s - 1, n) warm-up forwards, then
  alternates one forward and one backward, then drains the backwards). The steady state pairs "send
  activation, receive gradient" and "send gradient, receive the next activation" in one batch each,
  which the neighbouring stage issues as the mirror-image batches, so no rank ever waits for a send
  to complete before posting the receive its peer is sending to: the schedules cannot deadlock when
  a send blocks until the matching receive is posted (NCCL), not only when sends are buffered
  (gloo). tests/test_blocking_p2p.py runs every schedule under such sends; the simulator replays
  this order batch by batch (sailor_core/simulator/schedule.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sailor_core.domain import ParallelPlan
from sailor_core.models.tensor_parallel import TPContext
from sailor_core.runtime.topology import RankInfo, ranks_of

Forward = Callable[[int, "torch.Tensor | None"], "torch.Tensor | None"]  # (microbatch, input) -> output to send
Backward = Callable[[int, "torch.Tensor | None"], "torch.Tensor | None"]  # (microbatch, grad) -> grad to send


@dataclass(frozen=True)
class Peers:
    """This rank's pipeline neighbours: (peer rank, which of the peer group's slices it gets)."""

    recv_fwd_from: int | None  # None on the first stage
    send_fwd_to: tuple[tuple[int, int], ...]  # empty on the last stage
    fwd_slices: int  # the next stage's TP degree
    recv_bwd_from: int | None  # None on the last stage
    send_bwd_to: tuple[tuple[int, int], ...]  # empty on the first stage
    bwd_slices: int  # the previous stage's TP degree


def stage_peers(plan: ParallelPlan, me: RankInfo) -> Peers:
    """`me`'s neighbours in its pipeline (see the module's contract)."""
    s, j, t = me.stage, me.pipeline, me.tp_rank
    recv_fwd = recv_bwd = None
    send_fwd: tuple[tuple[int, int], ...] = ()
    send_bwd: tuple[tuple[int, int], ...] = ()
    fwd_slices = bwd_slices = 1
    if s > 0:
        prev = ranks_of(plan, s - 1, j)
        recv_fwd = prev[t % len(prev)]
        send_bwd = tuple((prev[u], u) for u in range(len(prev)) if u % me.tp == t)
        bwd_slices = len(prev)
    if s < plan.num_stages - 1:
        nxt = ranks_of(plan, s + 1, j)
        send_fwd = tuple((nxt[r], r) for r in range(len(nxt)) if r % me.tp == t)
        recv_bwd = nxt[t % len(nxt)]
        fwd_slices = len(nxt)
    return Peers(recv_fwd, send_fwd, fwd_slices, recv_bwd, send_bwd, bwd_slices)


def message_slices(t: torch.Tensor, k: int) -> list[torch.Tensor]:
    """`t` flattened and cut into k equal contiguous slices (the last padded with zeros): TP rank r of
    the receiving group gets slice r, and the group's all-gather of the k slices, cut back to t's
    size, is t again."""
    flat = t.reshape(-1)
    if k == 1:
        return [flat]
    size = -(-flat.numel() // k)
    if size * k != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(size * k - flat.numel())])
    return list(flat.view(k, size).unbind(0))


class P2P:
    """One rank's batches of point-to-point operations (see the module's contract)."""

    def __init__(self, act_shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, tp: TPContext,
                 wait: Callable[[Any], None]) -> None:
        self.act_shape, self.dtype, self.device, self.tp, self.wait = act_shape, dtype, device, tp, wait
        self._pending: list[tuple[Any, Any]] = []  # send-only works and the tensors they send

    def exchange(self, send: torch.Tensor | None, to: Sequence[tuple[int, int]], recv_from: int | None,
                 slices: int = 1) -> torch.Tensor | None:
        """To every (rank, i) in `to` slice i of `send` cut in `slices` (`message_slices`) and, if
        `recv_from` is set, this rank's slice of an activation-shaped tensor from it, which the TP
        group then all-gathers: returns the whole tensor (None without a receive)."""
        ops = []
        part = None
        numel = math.prod(self.act_shape)
        if recv_from is not None:
            part = torch.empty(-(-numel // self.tp.size), dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, part, recv_from))
        cut: list[torch.Tensor] = []
        if send is not None:
            cut = message_slices(send, slices)
            ops += [dist.P2POp(dist.isend, cut[i], dst) for dst, i in to]
        if not ops:
            return None
        works = dist.batch_isend_irecv(ops)
        if part is None:
            self._pending += [(w, send if slices == 1 else cut) for w in works]
            return None
        for w in works:
            self.wait(w)
        if self.tp.size == 1:
            return part.view(self.act_shape)
        whole = torch.empty(part.numel() * self.tp.size, dtype=self.dtype, device=self.device)
        self.wait(dist.all_gather_single(whole, part, group=self.tp.group, async_op=True))
        return whole[:numel].view(self.act_shape)

    def drain(self) -> None:
        """Wait for this step's send-only batches."""
        for work, _ in self._pending:
            self.wait(work)
        self._pending = []


def run_schedule(schedule: str, n: int, stage: int, num_stages: int, peers: Peers, p2p: P2P,
                 forward: Forward, backward: Backward) -> None:
    """One step's `n` microbatches of `stage` in the order of `schedule` ("gpipe" or 1F1B); each
    `x(...)` below is one batch of point-to-point operations."""
    x = p2p.exchange
    prev, nxt = peers.recv_fwd_from, peers.recv_bwd_from  # None at the first / last stage
    fwd_to, bwd_to = peers.send_fwd_to, peers.send_bwd_to
    fk, bk = peers.fwd_slices, peers.bwd_slices
    if schedule == "gpipe":
        for m in range(n):
            x(forward(m, x(None, (), prev)), fwd_to, None, fk)
        for m in range(n):
            x(backward(m, x(None, (), nxt)), bwd_to, None, bk)
        return
    warmup = min(num_stages - stage - 1, n)
    for m in range(warmup):
        x(forward(m, x(None, (), prev)), fwd_to, None, fk)
    steady = n - warmup
    inp = x(None, (), prev) if steady else None
    for i in range(steady):
        grad_out = x(forward(warmup + i, inp), fwd_to, nxt, fk)
        last = i == steady - 1
        inp = x(backward(i, grad_out), bwd_to, None if last else prev, bk)
    for m in range(steady, n):
        x(backward(m, x(None, (), nxt)), bwd_to, None, bk)
