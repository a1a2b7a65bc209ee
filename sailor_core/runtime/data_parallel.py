"""Data parallelism in the runtime: gradient synchronisation per stage, bucketed and overlapped, and ZeRO-1.

Contract:
- `dp_group(plan, rank, backend)` creates every stage's data-parallel groups (collective over the
  world, one order) and returns this rank's (group, hetero): replicas of a stage with one TP degree
  all-reduce their shards among equal TP ranks; replicas with different TP degrees (hetero) meet in
  one group over the whole stage. (None, False) when the stage has one replica.
- `GradSync` makes every replica's gradients the stage's total. Replicas that shard alike overlap it
  with backward as DDP does: during the last microbatch's backward (`arm()`), the gradients are
  all-reduced bucket by bucket as soon as a bucket's are final, while earlier layers compute.
  Buckets are whole layers, from the last, filled up to `BUCKET_CAP_BYTES` (DDP's default), so a
  small stage sends one all-reduce rather than one per layer: each collective has a fixed cost (on
  CPU/gloo ~0.2-1.5 ms of latency and wake-ups). Buckets are launched in bucket order only, so every
  rank of the group issues its collectives in one order whatever order autograd finishes in.
  `sync()` waits for them and all-reduces what they did not cover; hetero replicas each place their
  shards into one full-layout buffer (runtime/tp_groups.py) and all-reduce it over the whole
  stage, then take their slice back. `close()` removes its gradient hooks.
- ZeRO-1 (`Zero1`, replicas of a stage with one TP degree): each replica keeps AdamW state for the
  parameters it owns (`zero1_owners`: balanced by size, in parameter order), steps only those after
  the gradient all-reduce, and broadcasts them to the other replicas (`share_params`); a checkpoint
  gathers every owner's state first (`gather_state`), so it is the same full state a plan without
  ZeRO-1 writes. Gloo has no reduce-scatter, so gradients are still all-reduced whole: the memory
  saving is ZeRO-1's, the traffic is an all-reduce plus the parameter broadcast.
- `grad_sq_norm`: this rank's share of the global squared gradient norm (pipeline 0 only: every
  replica holds the same totals; a replicated tensor once per TP group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sailor_core.domain import ParallelPlan
from sailor_core.models.tensor_parallel import SHARD_ATTR, TPContext
from sailor_core.runtime.topology import RankInfo, ranks_of
from sailor_core.runtime.tp_groups import FullLayout

# Gradient bucket size for the data-parallel all-reduce: torch DDP's default `bucket_cap_mb`.
BUCKET_CAP_BYTES = 25 * 1024 * 1024

Wait = Callable[[Any], None]


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient once this step's backward ran (`GradSync.sync` zero-fills the ones it left unset)."""
    if p.grad is None:
        raise RuntimeError(f"a parameter of shape {tuple(p.shape)} has no gradient: the step's backward has not run")
    return p.grad


def dp_group(plan: ParallelPlan, rank: int, backend: str) -> tuple[Any, bool]:
    """Create every stage's data-parallel groups (every rank, one order); (this rank's group, hetero)."""
    mine: Any = None
    hetero = False
    for s, st in enumerate(plan.stages):
        if len(st.replicas) == 1:
            continue
        tps = {r.tp for r in st.replicas}
        if len(tps) == 1:
            for t in range(tps.pop()):
                ranks = [ranks_of(plan, s, j)[t] for j in range(len(st.replicas))]
                g = dist.new_group(ranks, backend=backend)
                if rank in ranks:
                    mine = g
        else:
            ranks = [r for j in range(len(st.replicas)) for r in ranks_of(plan, s, j)]
            g = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                mine, hetero = g, True
    return mine, hetero


def buckets_of(layers: Sequence[nn.Module], cap_bytes: int = BUCKET_CAP_BYTES) -> list[list[nn.Parameter]]:
    """Whole layers' trainable parameters, from the last layer (backward reaches it first), filled up
    to `cap_bytes` (a larger layer is a bucket of its own); a weight two layers share goes to the first."""
    buckets: list[list[nn.Parameter]] = []
    seen: set[int] = set()
    size = 0
    for layer in reversed(list(layers)):
        ps = [p for p in layer.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in ps)
        if not ps:
            continue
        nbytes = sum(p.numel() * p.element_size() for p in ps)
        if buckets and size + nbytes <= cap_bytes:
            buckets[-1].extend(ps)
            size += nbytes
        else:
            buckets.append(ps)
            size = nbytes
    return buckets


def _all_reduce_flat(tensors: Sequence[torch.Tensor], group: Any, wait: Wait) -> None:
    """All-reduce `tensors` (summed) as one flat message, in place."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    wait(dist.all_reduce(flat, group=group, async_op=True))
    _unflatten(flat, tensors)


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        t.copy_(flat[off:off + t.numel()].view_as(t))
        off += t.numel()


class GradSync:
    """This rank's gradient synchronisation with its stage's other replicas (see the module's contract)."""

    def __init__(self, group: Any, hetero: bool, params: Sequence[nn.Parameter], layers: Sequence[nn.Module],
                 tp: TPContext, device: torch.device, wait: Wait) -> None:
        self.group, self.hetero = group, hetero
        self.params = list(params)
        self.tp, self.device, self.wait = tp, device, wait
        # overlap only where replicas shard alike (hetero replicas meet in the full layout, at the end)
        self.buckets = buckets_of(layers) if group is not None and not hetero else []
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._armed = False
        self._inflight: list[tuple[Any, torch.Tensor, list[nn.Parameter]]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(lambda _p, b=b: self._grad_ready(b))
                       for b, ps in enumerate(self.buckets) for p in ps]

    def arm(self) -> None:
        """The gradients become final during the backward that runs now (the step's last microbatch)."""
        self._armed = bool(self.buckets)

    def _grad_ready(self, b: int) -> None:
        if not self._armed:
            return
        self._ready[b] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            ps = self.buckets[self._next]
            flat = torch.cat([grad_of(p).reshape(-1) for p in ps])
            self._inflight.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, ps))
            self._next += 1

    def _finish_overlap(self) -> set[int]:
        """Wait for the launched bucket all-reduces; returns ids of the parameters they covered."""
        done: set[int] = set()
        for work, flat, ps in self._inflight:
            self.wait(work)
            _unflatten(flat, [grad_of(p) for p in ps])
            done.update(id(p) for p in ps)
        self._inflight = []
        self._armed = False
        self._ready = [0] * len(self.buckets)
        self._next = 0
        return done

    def sync(self) -> None:
        """Every gradient (zero where backward left none) summed over the stage's replicas."""
        done = self._finish_overlap() if self.buckets else set()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.group is None:
            return
        if not self.hetero:
            rest = [grad_of(p) for p in self.params if id(p) not in done]
            if rest:
                _all_reduce_flat(rest, self.group, self.wait)
            return
        full = FullLayout(self.params, self.tp)
        grads = [grad_of(p) for p in self.params]
        flat = full.place(grads, self.device)
        self.wait(dist.all_reduce(flat, group=self.group, async_op=True))
        full.take(flat, grads)

    def close(self) -> None:
        """Remove the gradient hooks (they hold this object: a parameter would keep it alive)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def zero1_owners(sizes: list[int], replicas: int) -> list[int]:
    """Owner replica of each parameter: the largest first, each to the replica owning the fewest
    elements so far (ties: the lowest index), so every replica keeps about 1/replicas of the state."""
    load = [0] * replicas
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        j = min(range(replicas), key=lambda j: (load[j], j))
        owner[i] = j
        load[j] += sizes[i]
    return owner


class Zero1:
    """ZeRO-1 over a stage's replicas (see the module's contract). `peers[j]`: this TP rank's peer in
    replica j (global rank); `me`: this rank's replica."""

    MOMENTS = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Sequence[nn.Parameter], peers: Sequence[int], me: int, group: Any, wait: Wait) -> None:
        self.params = list(params)
        owner = zero1_owners([p.numel() for p in self.params], len(peers))
        self.owned_by = [[p for p, o in zip(self.params, owner, strict=True) if o == j] for j in range(len(peers))]
        self.peers, self.me, self.group, self.wait = list(peers), me, group, wait

    @property
    def mine(self) -> list[nn.Parameter]:
        return self.owned_by[self.me]

    def _broadcast(self, tensors_of: Callable[[int], Sequence[torch.Tensor]]) -> None:
        """For every replica j, broadcast `tensors_of(j)` (tensors it owns) from j to the others, in place."""
        for j, src in enumerate(self.peers):
            ts = tensors_of(j)
            if not ts:
                continue
            flat = torch.cat([t.reshape(-1) for t in ts])
            self.wait(dist.broadcast(flat, src=src, group=self.group, async_op=True))
            if j != self.me:
                _unflatten(flat, ts)

    def share_params(self) -> None:
        """After this replica's optimizer stepped its own parameters: everyone's, everywhere."""
        with torch.no_grad():
            self._broadcast(lambda j: self.owned_by[j])

    def gather_state(self, opt: torch.optim.Optimizer, opt_steps: int) -> dict[int, dict[str, torch.Tensor]]:
        """Every parameter's AdamW moments on every replica (for a checkpoint), keyed by id(param)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for p in self.params:
            st = opt.state.get(p, {})  # only the parameters this rank owns have state
            out[id(p)] = {k: st[k].detach().clone() if k in st else torch.zeros_like(p) for k in self.MOMENTS}
        if opt_steps > 0:  # before the first step nobody has state: zeros everywhere
            self._broadcast(lambda j: [out[id(p)][k] for p in self.owned_by[j] for k in self.MOMENTS])
        return out


def zero1_for(plan: ParallelPlan, me: RankInfo, tp_rank: int, params: Sequence[nn.Parameter], group: Any,
              hetero: bool, wait: Wait) -> Zero1 | None:
    """ZeRO-1 where the plan asks for it and `me`'s stage has replicas that shard alike; else None
    (every replica keeps the full optimizer state)."""
    if not plan.zero1 or group is None or hetero:
        return None
    peers = [ranks_of(plan, me.stage, j)[tp_rank] for j in range(len(plan.stages[me.stage].replicas))]
    return Zero1(params, peers, me.pipeline, group, wait)


def grad_sq_norm(params: Sequence[nn.Parameter], *, pipeline: int, tp_rank: int, device: torch.device,
                 skip: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's share of the global squared norm: pipeline 0 only, replicated tensors once per TP
    group, `skip` (the head's copy of a tied weight: counted on the embedding's stage) never."""
    acc = torch.zeros((), dtype=torch.float32, device=device)
    if pipeline != 0:
        return acc
    for p in params:
        if getattr(p, SHARD_ATTR, None) is None and tp_rank != 0:
            continue
        if skip is not None and p is skip:
            continue
        acc += grad_of(p).float().pow(2).sum()
    return acc
