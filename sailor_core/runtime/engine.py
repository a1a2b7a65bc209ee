"""One rank of a heterogeneous PP x DP x TP training job (torch.distributed must be initialised).

Contract:
- `Trainer(plan, cfg, settings, rank, world_size)` builds this rank's process groups, its stage
  (layers [first, last] of its stage, sharded for its replica's TP degree, from the deterministic
  (seed, layer) init or from a checkpoint), its AdamW, and its point-to-point peers.
- `Trainer.train(until_step)` runs 1F1B (or GPipe) steps. Sample g of step k is global sample
  `samples_seen + g`; pipeline j takes the contiguous range of the global batch starting at
  `sample_offset(plan, j)`; each microbatch contributes sum(token CE) / (global tokens), so the
  gradient is the exact mean over the global batch for any pipelines' microbatch sizes and counts.
- Gradients are synchronised per stage: replicas with one TP degree all-reduce their shards among
  equal TP ranks; replicas with different TP degrees each place their shards into one full-layout
  buffer and all-reduce it over the whole stage, then take their slice back. Gradient clipping uses
  the global norm of full-layout gradients. Results match a single-process run of the same model.
- ZeRO-1 (`plan.zero1`, replicas of a stage with one TP degree): each replica keeps AdamW state for
  the parameters it owns (`zero1_owners`: balanced by size, in parameter order), steps only those
  after the gradient all-reduce, and broadcasts them to the other replicas; a checkpoint gathers
  every owner's state first, so it is the same full state a plan without ZeRO-1 writes. Replicas
  that shard differently keep the full state (logged). Gloo has no reduce-scatter, so gradients are
  still all-reduced whole: the memory saving is ZeRO-1's, the traffic is an all-reduce plus the
  parameter broadcast.
- Between stages activations go forward and gradients back, each message once, in slices: receiving
  TP rank r gets slice r from sending TP rank r mod tp_send and the receiving TP group all-gathers
  the slices; gradients go back from receiving rank t mod tp_recv to sending rank t the same way.
  Every exchange is one `dist.batch_isend_irecv` in the schedule's order (Megatron's pairing: a
  1F1B steady-state step sends its activation and receives its gradient in one batch, then sends
  its input gradient and receives the next activation in one batch), so no rank ever waits for a
  send to complete before posting the receive its peer is sending to: the schedules cannot deadlock
  when a send blocks until the matching receive is posted (NCCL), not only when sends are buffered
  (gloo). tests/test_blocking_p2p.py runs every schedule under such sends.
- A CUDA rank makes its own GPU current (`select_device`, from the local rank) before any
  communication; collectives that allocate on a device (barrier, object broadcast) are given it.
- Every step ends with one world all-reduce of [loss, grad norm^2, checkpoint flag, stop flag], so a
  preemption notice (SIGUSR1 or `settings.preempt_file` appearing) on any rank makes every rank take
  a just-in-time checkpoint at that step, and SIGTERM (or a stop file) checkpoints and stops.
- Rank 0 reports one metrics record per step through `on_metrics` (and `settings.metrics_out`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import signal
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sailor_core.catalog import is_cpu_type
from sailor_core.domain import ParallelPlan
from sailor_core.errors import SailorError
from sailor_core.models.config import TransformerConfig
from sailor_core.models.tensor_parallel import SHARD_ATTR, TPContext, shard, shard_slice
from sailor_core.models.torch_model import StageModel
from sailor_core.runtime import checkpoint as ckpt
from sailor_core.runtime import comm, memory_checkpoint
from sailor_core.runtime.data import TokenBatches, TokenDataset, load_tokens
from sailor_core.runtime.schedule import learning_rate
from sailor_core.runtime.topology import layout, ranks_of, sample_offset, tie_groups


@dataclass
class TrainSettings:
    model: str
    steps: int
    seed: int = 0
    data: str | None = None
    checkpoint_uri: str | None = None
    checkpoint_interval: int = 0  # 0: only at the end of the run (and just in time on a notice)
    resume: bool = False
    metrics_out: str | None = None
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    timeout_s: float = 60.0
    preempt_file: str | None = None
    stop_file: str | None = None
    plan_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # a model that is not built in (read from a config.json): TransformerConfig.to_dict()
    model_config: dict[str, Any] | None = None
    # learning-rate schedule (sailor_core.runtime.schedule): warmup, then constant, cosine or linear decay
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    recompute: bool = False  # activation recomputation: blocks keep only their input for backward

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["betas"] = list(self.betas)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TrainSettings:
        known = set(TrainSettings.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise SailorError(f"unknown training settings {unknown}; known: {sorted(known)}")
        d = dict(d)
        d["betas"] = tuple(d.get("betas", (0.9, 0.95)))
        return TrainSettings(**d)


class _Notices:
    """Signal-driven flags, installed once per process (handlers only set flags)."""

    checkpoint = False
    stop = False
    terminated = False  # SIGTERM came (`stop` is also set by a plan change)
    installed = False

    @classmethod
    def _on_sigterm(cls, *_: Any) -> None:
        cls.stop = cls.terminated = True

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        try:
            signal.signal(signal.SIGUSR1, lambda *_: setattr(cls, "checkpoint", True))
            signal.signal(signal.SIGTERM, cls._on_sigterm)
            cls.installed = True
        except ValueError:  # not the main thread (e.g. in a test harness): files still work
            pass


def device_for(gpu_type: str, local_rank: int) -> torch.device:
    if is_cpu_type(gpu_type):
        return torch.device("cpu")
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


def select_device(gpu_type: str, local_rank: int) -> torch.device:
    """This rank's device, made current on CUDA: NCCL and every collective that allocates on "the
    current device" then use this rank's GPU, not GPU 0 (several ranks of one VM would share it)."""
    device = device_for(gpu_type, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def device_ids(device: torch.device) -> list[int] | None:
    """`device_ids` for `dist.barrier`: NCCL's barrier allocates on the device given (else it guesses)."""
    return (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
    )


# Gradient bucket size for the data-parallel all-reduce: torch DDP's default `bucket_cap_mb`.
BUCKET_CAP_BYTES = 25 * 1024 * 1024


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


def _grad(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient once this step's backward ran (`_sync_grads` zero-fills the ones it left unset)."""
    if p.grad is None:
        raise RuntimeError(f"a parameter of shape {tuple(p.shape)} has no gradient: the step's backward has not run")
    return p.grad


def backend_for(gpu_type: str) -> str:
    return "gloo" if is_cpu_type(gpu_type) else "nccl"


class Trainer:
    def __init__(self, plan: ParallelPlan, cfg: TransformerConfig, settings: TrainSettings, rank: int,
                 world_size: int, *, local_rank: int = 0, dataset: TokenBatches | None = None,
                 on_metrics: Callable[[dict[str, Any]], None] | None = None, log: Callable[[str], None] | None = None):
        lay = layout(plan)
        if world_size != len(lay):
            raise SailorError(f"the plan needs {len(lay)} ranks but the job has {world_size}")
        self.plan, self.cfg, self.settings = plan, cfg, settings
        self.rank, self.world = rank, world_size
        self.me = lay[rank]
        self.log = log or (lambda m: None)
        self.on_metrics = on_metrics
        self.stage = plan.stages[self.me.stage]
        self.pipe = plan.pipelines[self.me.pipeline]
        self.device = select_device(self.me.gpu_type, local_rank)
        self.bf16 = plan.precision == "bf16"
        self.comm_dtype = torch.bfloat16 if self.bf16 else torch.float32
        self._build_groups()
        self._build_tie_group()
        self.model = StageModel(cfg, self.stage.first_layer, self.stage.last_layer, self.tp, settings.seed,
                                recompute=settings.recompute or self.stage.recompute).to(self.device)
        self._params = list(self.model.named_parameters())
        self._setup_zero1()
        owned = self._owned_by[self.me.pipeline] if self.zero1 else [p for _, p in self._params]
        self._mine = {id(p) for p in owned}  # parameters this rank's optimizer steps
        decay = [p for p in owned if p.dim() >= 2]
        no_decay = [p for p in owned if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=settings.lr, betas=settings.betas, eps=1e-8,
        )
        self._init_peers()
        self._setup_overlap()
        self.data: TokenBatches | None = dataset
        if self.data is None and (self.model.has_embedding or self.model.has_head):
            self.data = TokenDataset(load_tokens(settings.data), cfg.sequence_length, settings.seed, cfg.vocab_size)
        self.storage = ckpt.open_storage(settings.checkpoint_uri) if settings.checkpoint_uri else None
        self.checkpointer = ckpt.AsyncCheckpointer(self.storage) if self.storage else None
        self.step = 0
        # False only while the optimizer updates the state: a trainer whose generation failed (a lost
        # peer raises only from a communication wait) otherwise holds exactly the state of `step`
        self.consistent = True
        self._saved_step = -1
        self._write_unconfirmed = False  # a background write started at the last checkpoint, not yet agreed done
        self._stall_s: float | None = None  # the last checkpoint's snapshot time on this rank
        self._measured: dict[str, float] = {}  # the slowest rank's last checkpoint times, for the next record
        self._preempt_seen: float | None = None
        self.samples_seen = 0
        self.opt_steps = 0
        self.loss_scale = 1.0 / (plan.global_batch_size * cfg.sequence_length)
        self.flops_per_token = cfg.flops_per_token()  # for the metrics' model FLOP/s (MFU = that / peak)
        self.history: list[dict[str, Any]] = []
        _Notices.install()

    # -- process groups and peers --------------------------------------------------------------
    def _build_groups(self) -> None:
        """Create every group in one fixed order on every rank (torch requires all ranks to call)."""
        self.tp = TPContext.single()
        self.dp_group: Any = None  # all-reduce group for my gradients, None when dp == 1
        self.hetero = False
        backend = backend_for(self.me.gpu_type)
        for s, st in enumerate(self.plan.stages):
            for j, rep in enumerate(st.replicas):
                if rep.tp > 1:
                    ranks = ranks_of(self.plan, s, j)
                    g = dist.new_group(ranks, backend=backend)
                    if self.rank in ranks:
                        self.tp = TPContext(g, ranks.index(self.rank), rep.tp)
            if len(st.replicas) == 1:
                continue
            tps = {r.tp for r in st.replicas}
            if len(tps) == 1:
                for t in range(tps.pop()):
                    ranks = [ranks_of(self.plan, s, j)[t] for j in range(len(st.replicas))]
                    g = dist.new_group(ranks, backend=backend)
                    if self.rank in ranks:
                        self.dp_group = g
            else:
                ranks = [r for j in range(len(st.replicas)) for r in ranks_of(self.plan, s, j)]
                g = dist.new_group(ranks, backend=backend)
                if self.rank in ranks:
                    self.dp_group, self.hetero = g, True

    def _setup_zero1(self) -> None:
        """Under ZeRO-1, the parameters each replica of my stage owns (keeps optimizer state for and
        steps), in parameter order, and my TP rank's peer in each replica."""
        dp = len(self.stage.replicas)
        self.zero1 = self.plan.zero1 and self.dp_group is not None and not self.hetero
        if self.plan.zero1 and self.hetero and self.rank == 0:
            self.log("zero1: replicas of a stage shard differently (different TP degrees); "
                     "every replica keeps the full optimizer state")
        if not self.zero1:
            return
        owner = zero1_owners([p.numel() for _, p in self._params], dp)
        self._owned_by = [[p for (_, p), o in zip(self._params, owner, strict=True) if o == j] for j in range(dp)]
        self._dp_ranks = [ranks_of(self.plan, self.me.stage, j)[self.tp.rank] for j in range(dp)]

    def _zero1_broadcast(self, tensors_of: Callable[[int], Sequence[torch.Tensor]]) -> None:
        """For every replica j, broadcast `tensors_of(j)` (tensors it owns) from j to the others, in place."""
        for j, src in enumerate(self._dp_ranks):
            ts = tensors_of(j)
            if not ts:
                continue
            flat = torch.cat([t.reshape(-1) for t in ts])
            comm.wait(dist.broadcast(flat, src=src, group=self.dp_group, async_op=True))
            if j != self.me.pipeline:
                off = 0
                for t in ts:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()

    def _zero1_share_params(self) -> None:
        with torch.no_grad():
            self._zero1_broadcast(lambda j: self._owned_by[j])

    def _zero1_gather_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every parameter's AdamW moments on every replica (for a checkpoint), keyed by id(param)."""
        moments = ("exp_avg", "exp_avg_sq")
        out: dict[int, dict[str, torch.Tensor]] = {}
        for _, p in self._params:
            st = self.opt.state.get(p, {})  # only the parameters this rank owns have state
            out[id(p)] = {k: st[k].detach().clone() if k in st else torch.zeros_like(p) for k in moments}
        if self.opt_steps > 0:  # before the first step nobody has state: zeros everywhere
            self._zero1_broadcast(lambda j: [out[id(p)][k] for p in self._owned_by[j] for k in moments])
        return out

    def _build_tie_group(self) -> None:
        """A tied head on another stage than the embedding keeps its own copy; after the data-parallel
        sync each replica of the two stages holds its stage's total, and each pipeline's embedding and
        head add theirs (Megatron's embedding group), so both copies stay the single weight's. Where
        the two TP degrees agree, TP rank t of one meets TP rank t of the other and they add their
        vocabulary slice; else the pipeline's two TP groups meet in the full layout (`tie_groups`)."""
        self.tie_group: Any = None
        self.tie_sliced = False
        self.tied_split = self.cfg.tied_head and self.plan.num_stages > 1
        if not self.tied_split:
            return
        for ranks, sliced in tie_groups(self.plan):  # every rank creates every group, in one order
            g = dist.new_group(ranks, backend=backend_for(self.me.gpu_type))
            if self.rank in ranks:
                self.tie_group, self.tie_sliced = g, sliced

    def process_groups(self) -> list[Any]:
        """The subgroups this rank belongs to. A failed generation's worker keeps these (not the trainer)
        until the process ends: gloo work blocked on a lost peer runs on their threads until its
        timeout, and freeing a group joins them."""
        return [g for g in (self.tp.group, self.dp_group, self.tie_group) if g is not None]

    def _tied_param(self) -> nn.Parameter | None:
        if self.model.has_embedding:
            return self.model.embedding().wte.weight
        if self.model.has_head:
            return self.model.head().out.weight
        return None

    def _sync_tied(self) -> None:
        p = self._tied_param()
        if self.tie_group is None or p is None:
            return
        if self.tie_sliced:  # both ends hold the same vocabulary slice
            buf = _grad(p).to(torch.float32)
            comm.wait(dist.all_reduce(buf, group=self.tie_group, async_op=True))
            if buf is not _grad(p):
                _grad(p).copy_(buf)
            return
        full_shape = (p.shape[0] * self.tp.size, p.shape[1])
        buf = torch.zeros(full_shape, dtype=torch.float32, device=self.device)
        idx = shard_slice(full_shape, 0, self.tp.rank, self.tp.size)
        buf[idx] = _grad(p)
        comm.wait(dist.all_reduce(buf, group=self.tie_group, async_op=True))
        _grad(p).copy_(buf[idx])

    def _init_peers(self) -> None:
        s, j, t = self.me.stage, self.me.pipeline, self.me.tp_rank
        tp_me = self.me.tp
        self.recv_fwd_from = self.send_fwd_to = self.recv_bwd_from = None
        # (peer rank, which of the peer group's slices it gets): TP rank r of a receiving group gets
        # slice r of the message and the group all-gathers the slices (`_p2p`)
        self.send_bwd_to: list[tuple[int, int]] = []
        self.send_fwd_to_list: list[tuple[int, int]] = []
        self.fwd_slices = self.bwd_slices = 1
        if s > 0:
            prev = ranks_of(self.plan, s - 1, j)
            self.recv_fwd_from = prev[t % len(prev)]
            self.send_bwd_to = [(prev[u], u) for u in range(len(prev)) if u % tp_me == t]
            self.bwd_slices = len(prev)
        if s < self.plan.num_stages - 1:
            nxt = ranks_of(self.plan, s + 1, j)
            self.send_fwd_to_list = [(nxt[r], r) for r in range(len(nxt)) if r % tp_me == t]
            self.recv_bwd_from = nxt[t % len(nxt)]
            self.fwd_slices = len(nxt)
        if self.device.type == "cuda":
            # NCCL builds a group's communicator at its first collective, and a batch of point-to-point
            # operations may only be that first call if every rank of the group takes part: make the
            # world's communicator now, on this rank's GPU.
            comm.wait(dist.barrier(async_op=True, device_ids=device_ids(self.device)))

    # -- checkpoints ---------------------------------------------------------------------------
    def _layer_snapshot(self, li: int, layer: torch.nn.Module,
                        gathered: dict[int, dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
        params, m1, m2, dims = {}, {}, {}, {}
        for name, p in layer.named_parameters(remove_duplicate=False):
            params[name] = p.detach().to("cpu", copy=True)
            st = gathered[id(p)] if gathered is not None else self.opt.state.get(p, {})
            m1[name] = (
                st["exp_avg"].detach().to("cpu", copy=True) if "exp_avg" in st else torch.zeros_like(params[name])
            )
            m2[name] = (
                st["exp_avg_sq"].detach().to("cpu", copy=True) if "exp_avg_sq" in st else torch.zeros_like(params[name])
            )
            dims[name] = getattr(p, SHARD_ATTR, None)
        return {"layer": li, "tp": self.tp.size, "tp_rank": self.tp.rank, "shard_dims": dims,
                "params": params, "exp_avg": m1, "exp_avg_sq": m2}

    def save_checkpoint(self, *, blocking: bool = False, prune: bool = True) -> None:
        """This step's checkpoint (every rank calls it at the same step); `blocking`: written and agreed
        by every rank on return; `prune=False`: no retention pass on the way (a just-in-time checkpoint)."""
        if self.checkpointer is None:
            return
        # Every rank runs this at the same steps (the decision is part of the step's world all-reduce),
        # so the ZeRO-1 gather, a collective over the stage's replicas, is reached by all of them.
        if self._saved_step != self.step:
            self._wait_for_writes(blocking)
            self._saved_step = self.step
            t0 = time.perf_counter()
            gathered = self._zero1_gather_state() if self.zero1 else None
            if self.me.pipeline == 0:  # replica 0 of each stage writes its layers; the others hold copies
                self._write_checkpoint(gathered, blocking, prune)
            self._stall_s = time.perf_counter() - t0
            self._write_unconfirmed = not blocking
        if blocking:
            self.checkpointer.wait(retention=prune)
            comm.wait(dist.barrier(async_op=True, device_ids=device_ids(self.device)))

    def _wait_for_writes(self, blocking: bool = False) -> None:
        """Until no rank's last checkpoint write is still going; a write that failed is raised here.

        Every rank pauses together, meeting in one small all-reduce per poll (at most one a second), so
        none takes the wait for a lost peer. Called before the step after a checkpoint commits, so a
        write that fails for good (a full disk, a store down past its retries) ends the job with at
        most one interval of steps lost: the write overlaps that step's forward and backward only."""
        t0, pause, told = time.monotonic(), 0.02, -30.0
        while self._checkpoint_times(wait=blocking):
            waited = time.monotonic() - t0
            if waited - told >= 30.0:
                told = waited
                self.log(f"rank {self.rank}: step {self.step + 1} waits for the checkpoint write of step "
                         f"{self._saved_step} ({waited:.0f} s so far)")
            time.sleep(pause)
            pause = min(1.0, pause * 2)
        self._write_unconfirmed = False

    def _checkpoint_times(self, *, wait: bool) -> bool:
        """Whether any rank's previous write is still going (after waiting for this rank's when `wait`),
        and the slowest rank's last checkpoint times, the stall (snapshot) and the write, for the next
        step's record (the flow chooses the checkpoint interval from them). Every rank checkpoints at the
        same steps, so one MAX all-reduce per checkpoint carries them. A write that failed is raised here."""
        assert self.checkpointer is not None
        if wait:
            self.checkpointer.wait(retention=False)
        self.checkpointer.raise_if_failed()
        t = torch.tensor([self._stall_s or 0.0, self.checkpointer.last_write_s, float(self.checkpointer.busy())],
                         dtype=torch.float64, device=self.device)
        comm.wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True))
        if self._stall_s is not None and not t[2]:  # the first checkpoint of this trainer measured nothing yet
            self._measured = {"checkpoint_stall_s": float(t[0]), "checkpoint_write_s": float(t[1])}
        return bool(t[2])

    def _write_checkpoint(self, gathered: dict[int, dict[str, torch.Tensor]] | None, blocking: bool,
                          prune: bool = True) -> None:
        assert self.checkpointer is not None
        states = {li: self._layer_snapshot(li, layer, gathered)
                  for li, layer in zip(self.model.layer_ids, self.model.layers, strict=True)}
        meta = None
        if self.rank == 0:
            meta = {"step": self.step, "samples_seen": self.samples_seen, "opt_steps": self.opt_steps,
                    "model": self.cfg.name, "seed": self.settings.seed, "num_layers": self.cfg.num_layers,
                    "plan_version": self.settings.plan_version, "time": time.time()}
        self.checkpointer.save(self.step, states, f"part_s{self.me.stage}_t{self.tp.rank}.json", meta,
                               blocking=blocking, prune=prune)

    def _layer_key(self, li: int) -> tuple[Any, ...]:
        """What this rank holds of layer `li`: the same key means the same tensors, shard for shard."""
        return (self.cfg.name, li, self.tp.rank, self.tp.size)

    def kept_layers(self, previous: Trainer | None) -> set[int]:
        """The layers of this rank's shard that `previous` (this process's trainer of the last generation)
        holds shard for shard, in a consistent state; empty when nothing can be kept (ZeRO-1 keeps
        partial optimizer state, so it never is)."""
        if previous is None or self.zero1 or previous.zero1 or not previous.consistent:
            return set()
        theirs = {previous._layer_key(li) for li in previous.model.layer_ids}
        return {li for li in self.model.layer_ids if self._layer_key(li) in theirs}

    def resume(self, previous: Trainer | None) -> str:
        """Resume every rank at one step, from memory where it can: when every rank's previous trainer
        holds its whole shard at the same step, nobody reads a checkpoint ('memory'); otherwise every
        rank resumes at the newest valid checkpoint's step (rank 0 decides), a rank whose previous
        trainer is at that step keeps the layers it holds from memory, and loads the rest ('memory'
        when it loaded nothing, else 'checkpoint'; 'none' without a checkpoint: a fresh start).
        Collective."""
        kept = self.kept_layers(previous)
        whole = previous is not None and kept == set(self.model.layer_ids)
        mine = float(previous.step) if whole and previous is not None else -1.0
        agree = torch.tensor([mine, -mine], dtype=torch.float64, device=self.device)
        comm.wait(dist.all_reduce(agree, op=dist.ReduceOp.MAX, async_op=True))
        if previous is not None and mine >= 0 and agree[0].item() == mine == -agree[1].item():
            self._adopt(previous, kept)
            self.step, self.samples_seen, self.opt_steps = previous.step, previous.samples_seen, previous.opt_steps
            self._saved_step = previous._saved_step
            self.log(f"rank {self.rank}: kept its state from memory at step {self.step}")
            return "memory"
        if self.storage is None:
            return "none"
        step: list[Any] = [None]
        if self.rank == 0:
            step = [ckpt.latest_valid_step(self.storage, self.cfg.num_layers, self.log)]
        # The survivors of a lost member may together hold a newer step than any checkpoint (a lost
        # replica's layers live on in its stage's other replicas): write it, and resume there.
        newer = memory_checkpoint.write_from_memory(self, previous, step[0])
        if self.rank == 0 and newer is not None:
            step = [newer]
        dist.broadcast_object_list(step, src=0, device=self.device)
        if step[0] is None:
            return "none"
        if previous is None or previous.step != step[0]:
            kept = set()
        self._adopt(previous, kept)
        loaded = self._load_step(self.storage, int(step[0]), ckpt.read_meta(self.storage, int(step[0])), skip=kept)
        self.log(f"rank {self.rank}: at step {self.step}: {len(kept)} layer(s) kept from memory, {loaded} loaded")
        return "checkpoint" if loaded else "memory"

    def _adopt(self, old: Trainer | None, layers: set[int]) -> None:
        """Copy `layers` (parameters and this rank's optimizer state) from `old`, which holds them shard for shard."""
        if old is None or not layers:
            return
        theirs = dict(zip(old.model.layer_ids, old.model.layers, strict=True))
        with torch.no_grad():
            for li, layer in zip(self.model.layer_ids, self.model.layers, strict=True):
                if li not in layers:
                    continue
                pairs = zip(layer.named_parameters(remove_duplicate=False),
                            theirs[li].named_parameters(remove_duplicate=False), strict=True)
                for (name, p), (old_name, q) in pairs:
                    assert name == old_name, (name, old_name)
                    p.copy_(q.detach().to(self.device))
                    if q in old.opt.state and id(p) in self._mine:
                        self.opt.state[p] = {
                            k: (v.to(self.device) if v.dim() else v.clone()) for k, v in old.opt.state[q].items()
                        }

    def load_checkpoint(self, step: int | None = None) -> bool:
        """Resume from the newest valid checkpoint (rank 0 decides, everyone loads). False if none.
        With `step` (agreed by every rank already), load that one without deciding again."""
        if step is not None and self.storage is not None:
            self._load_step(self.storage, step, ckpt.read_meta(self.storage, step))
            return True
        if self.storage is None:
            return False
        decision: list[Any] = [None]
        if self.rank == 0:
            step = ckpt.latest_valid_step(self.storage, self.cfg.num_layers, self.log)
            decision = [None if step is None else (step, ckpt.read_meta(self.storage, step))]
        dist.broadcast_object_list(decision, src=0, device=self.device)
        if decision[0] is None:
            return False
        self._load_step(self.storage, *decision[0])
        return True

    def _load_step(self, storage: ckpt.CheckpointStorage, step: int, meta: dict[str, Any],
                   skip: Collection[int] = ()) -> int:
        """Load the layers of checkpoint `step` this rank holds, except `skip` (kept from memory), and
        the step counters; returns how many layers it read."""
        if meta.get("model") != self.cfg.name:
            raise SailorError(f"checkpoint step {step} is of model {meta.get('model')!r}, not {self.cfg.name!r}")
        opt_steps = int(meta["opt_steps"])
        wanted = [li for li in self.model.layer_ids if li not in skip]
        fulls = ckpt.load_layer_states(storage, step, wanted)
        with torch.no_grad():
            for li, layer in zip(self.model.layer_ids, self.model.layers, strict=True):
                if li not in fulls:
                    continue
                full = fulls[li]
                for name, p in layer.named_parameters(remove_duplicate=False):
                    dim = getattr(p, SHARD_ATTR, None)
                    p.copy_(shard(full["params"][name], dim, self.tp.rank, self.tp.size))
                    if opt_steps > 0 and id(p) in self._mine:
                        self.opt.state[p] = {
                            "step": torch.tensor(float(opt_steps)),
                            "exp_avg": shard(full["exp_avg"][name], dim, self.tp.rank, self.tp.size).to(self.device),
                            "exp_avg_sq": shard(full["exp_avg_sq"][name], dim, self.tp.rank, self.tp.size).to(
                                self.device
                            ),
                        }
        self.step, self.samples_seen, self.opt_steps = int(meta["step"]), int(meta["samples_seen"]), opt_steps
        self.log(f"rank {self.rank}: resumed from checkpoint step {step}")
        return len(wanted)

    # -- one training step -----------------------------------------------------------------------
    def _autocast(self) -> Any:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _samples(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.data is not None
        first = self.samples_seen + sample_offset(self.plan, self.me.pipeline) + m * self.pipe.microbatch_size
        x, y = self.data.batch(first, self.pipe.microbatch_size)
        return x.to(self.device), y.to(self.device)

    def _act_shape(self) -> tuple[int, int, int]:
        return (self.pipe.microbatch_size, self.cfg.sequence_length, self.cfg.hidden_size)

    def _forward(self, m: int, inp: torch.Tensor | None) -> torch.Tensor | None:
        """Forward of microbatch m on the received activation `inp` (None on the first stage).
        Returns the activation to send to the next stage (None on the last)."""
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
            self._loss_acc += loss.detach().float()
            self._stash[m] = (inp, loss)
            return None
        self._stash[m] = (inp, out)
        return out.detach().to(self.comm_dtype).contiguous()

    def _backward(self, m: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of microbatch m given its output's gradient (None on the last stage). Returns
        the gradient of its input to send to the previous stage (None when nobody receives it)."""
        inp, out = self._stash.pop(m)
        if self._buckets and m == self.pipe.num_microbatches - 1:
            self._overlap_on = True  # gradients become final during this backward
        if self.model.has_head:
            out.backward()
        else:
            assert grad_out is not None
            torch.autograd.backward(out, grad_out.to(out.dtype))
        if inp is None or not self.send_bwd_to:
            return None
        if inp.grad is None:
            raise RuntimeError(f"microbatch {m}: the received activation got no gradient in backward")
        return inp.grad.to(self.comm_dtype).contiguous()

    def _p2p(self, send: torch.Tensor | None, to: Sequence[tuple[int, int]], recv_from: int | None,
             slices: int = 1) -> torch.Tensor | None:
        """One batch of point-to-point operations: to every (rank, i) in `to` slice i of `send` cut in
        `slices` (`message_slices`) and, if `recv_from` is set, this rank's slice of an
        activation-shaped tensor from it; the TP group then all-gathers its slices and the whole
        tensor is returned. So a message crosses the link between two stages once whatever their TP
        degrees (DeepSpeed's and Megatron's scatter/gather between stages), not once per receiving
        rank, and the TP group's own link rebuilds it. All of a batch's operations are posted
        together, so a peer whose own batch sends to us while it receives from us meets our receive
        whatever the send's semantics. Works of a batch without a receive are waited for at the end
        of the step (the tensors stay referenced until then)."""
        ops = []
        part = None
        numel = math.prod(self._act_shape())
        if recv_from is not None:
            part = torch.empty(-(-numel // self.tp.size), dtype=self.comm_dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, part, recv_from))
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
            comm.wait(w)
        if self.tp.size == 1:
            return part.view(self._act_shape())
        whole = torch.empty(part.numel() * self.tp.size, dtype=self.comm_dtype, device=self.device)
        comm.wait(dist.all_gather_single(whole, part, group=self.tp.group, async_op=True))
        return whole[:numel].view(self._act_shape())

    def _schedule(self) -> None:
        """GPipe (all forwards, then all backwards) or 1F1B (Megatron's order: stage s runs
        min(S - s - 1, n) warm-up forwards, then alternates one forward and one backward, then
        drains the backwards). Each line below is one batch of point-to-point operations; the
        steady state pairs "send activation, receive gradient" and "send gradient, receive the next
        activation", which the neighbouring stage issues as the mirror-image batches."""
        n, s, S = self.pipe.num_microbatches, self.me.stage, self.plan.num_stages
        prev, nxt = self.recv_fwd_from, self.recv_bwd_from  # None at the first / last stage
        fwd_to, bwd_to = self.send_fwd_to_list, self.send_bwd_to
        fk, bk = self.fwd_slices, self.bwd_slices
        if self.plan.schedule == "gpipe":
            for m in range(n):
                self._p2p(self._forward(m, self._p2p(None, (), prev)), fwd_to, None, fk)
            for m in range(n):
                self._p2p(self._backward(m, self._p2p(None, (), nxt)), bwd_to, None, bk)
            return
        warmup = min(S - s - 1, n)
        for m in range(warmup):
            self._p2p(self._forward(m, self._p2p(None, (), prev)), fwd_to, None, fk)
        steady = n - warmup
        inp = self._p2p(None, (), prev) if steady else None
        for i in range(steady):
            grad_out = self._p2p(self._forward(warmup + i, inp), fwd_to, nxt, fk)
            last = i == steady - 1
            inp = self._p2p(self._backward(i, grad_out), bwd_to, None if last else prev, bk)
        for m in range(steady, n):
            self._p2p(self._backward(m, self._p2p(None, (), nxt)), bwd_to, None, bk)

    def _setup_overlap(self) -> None:
        """DDP-style overlap for replicas that shard alike: during the last microbatch's backward the
        gradients are all-reduced bucket by bucket as soon as a bucket's are final, while earlier
        layers compute. Buckets are whole layers, from the last, filled up to `BUCKET_CAP_BYTES`
        (DDP's default), so a small stage sends one all-reduce rather than one per layer: each
        collective has a fixed cost (on CPU/gloo ~0.2-1.5 ms of latency and wake-ups)."""
        self._buckets: list[list[Any]] = []
        self._inflight: list[tuple[Any, torch.Tensor, list[Any]]] = []
        self._overlap_on = False
        if self.dp_group is None or self.hetero:
            return
        seen: set[int] = set()
        size = 0
        for layer in reversed(list(self.model.layers)):  # backward reaches the last layer first
            # a weight shared by two layers belongs to the first bucket that has it
            ps = [p for p in layer.parameters() if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in ps)
            if not ps:
                continue
            nbytes = sum(p.numel() * p.element_size() for p in ps)
            if self._buckets and size + nbytes <= BUCKET_CAP_BYTES:
                self._buckets[-1].extend(ps)
                size += nbytes
            else:
                self._buckets.append(ps)
                size = nbytes
        self._ready = [0] * len(self._buckets)
        self._next = 0
        for b, ps in enumerate(self._buckets):
            for p in ps:
                p.register_post_accumulate_grad_hook(lambda _p, b=b: self._grad_ready(b))

    def _grad_ready(self, b: int) -> None:
        if not self._overlap_on:
            return
        self._ready[b] += 1
        # Launch in bucket order only: every rank of the group must issue its collectives in the same
        # order, whatever order autograd finishes independent branches in.
        while self._next < len(self._buckets) and self._ready[self._next] == len(self._buckets[self._next]):
            ps = self._buckets[self._next]
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            self._inflight.append((dist.all_reduce(flat, group=self.dp_group, async_op=True), flat, ps))
            self._next += 1

    def _finish_overlap(self) -> set[int]:
        """Wait for the launched bucket all-reduces; returns ids of the parameters they covered."""
        done: set[int] = set()
        for work, flat, ps in self._inflight:
            comm.wait(work)
            off = 0
            for p in ps:
                n = p.numel()
                p.grad.copy_(flat[off:off + n].view_as(p))
                off += n
                done.add(id(p))
        self._inflight = []
        self._overlap_on = False
        self._ready = [0] * len(self._buckets)
        self._next = 0
        return done

    def _sync_grads(self) -> None:
        done = self._finish_overlap() if self._buckets else set()
        for _, p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.dp_group is None:
            return
        if not self.hetero:
            rest = [(n, p) for n, p in self._params if id(p) not in done]
            if not rest:
                return
            flat = torch.cat([_grad(p).reshape(-1) for _, p in rest])
            comm.wait(dist.all_reduce(flat, group=self.dp_group, async_op=True))
            off = 0
            for _, p in rest:
                n = p.numel()
                _grad(p).copy_(flat[off:off + n].view_as(p))
                off += n
            return
        # Replicas shard differently: meet in the full layout. Each replica's TP ranks together
        # cover every full tensor exactly once (replicated tensors: TP rank 0 only).
        views, total = [], 0
        for _, p in self._params:
            dim = getattr(p, SHARD_ATTR, None)
            full_shape = list(p.shape)
            if dim is not None:
                full_shape[dim] *= self.tp.size
            n = math.prod(full_shape)
            views.append((p, dim, tuple(full_shape), total, n))
            total += n
        flat = torch.zeros(total, dtype=torch.float32, device=self.device)
        for p, dim, shape, off, n in views:
            if dim is None and self.tp.rank != 0:
                continue
            flat[off:off + n].view(shape)[shard_slice(shape, dim, self.tp.rank, self.tp.size)] = _grad(p)
        comm.wait(dist.all_reduce(flat, group=self.dp_group, async_op=True))
        for p, dim, shape, off, n in views:
            _grad(p).copy_(flat[off:off + n].view(shape)[shard_slice(shape, dim, self.tp.rank, self.tp.size)])

    def _grad_sq_norm(self) -> torch.Tensor:
        """This rank's share of the global squared norm: pipeline 0 only, replicated tensors once per TP group."""
        acc = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.me.pipeline != 0:
            return acc
        for _, p in self._params:
            if getattr(p, SHARD_ATTR, None) is None and self.tp.rank != 0:
                continue
            if self.tied_split and self.model.has_head and p is self.model.head().out.weight:
                continue  # the head's copy of a tied weight: counted once, on the embedding's stage
            acc += _grad(p).float().pow(2).sum()
        return acc

    def _notice_flags(self) -> tuple[float, float]:
        s = self.settings
        jit = _Notices.checkpoint
        if s.preempt_file:
            # a notice is the file appearing or being rewritten, not its mere presence: one checkpoint each
            try:
                stamp: float | None = os.stat(s.preempt_file).st_mtime_ns
            except OSError:
                stamp = None
            if stamp is not None and stamp != self._preempt_seen:
                jit = True
            self._preempt_seen = stamp
        stop = _Notices.stop or bool(s.stop_file and os.path.exists(s.stop_file))
        _Notices.checkpoint = False
        return float(jit), float(stop)

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.model.zero_grad(set_to_none=True)  # every gradient: under ZeRO-1 the optimizer sees only its own
        self._stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # microbatch -> (input, output)
        self._pending: list[Any] = []
        self._loss_acc = torch.zeros((), dtype=torch.float32, device=self.device)
        self._schedule()
        for work, _ in self._pending:
            comm.wait(work)
        self._pending = []
        self._sync_grads()
        self._sync_tied()
        head_reporter = self.model.has_head and self.tp.rank == 0
        jit, stop = self._notice_flags()
        red = torch.stack([
            self._loss_acc if head_reporter else torch.zeros((), device=self.device),
            self._grad_sq_norm(),
            torch.tensor(jit, device=self.device),
            torch.tensor(stop, device=self.device),
        ])
        comm.wait(dist.all_reduce(red, async_op=True))
        loss, sq, jit_any, stop_any = red.tolist()
        if jit_any and self.settings.preempt_file:
            # every rank takes this checkpoint, so every rank has now answered the current notice
            with contextlib.suppress(OSError):
                self._preempt_seen = os.stat(self.settings.preempt_file).st_mtime_ns
        norm = math.sqrt(max(sq, 0.0))
        if self.settings.max_grad_norm > 0 and norm > self.settings.max_grad_norm:
            coef = self.settings.max_grad_norm / (norm + 1e-6)
            for _, p in self._params:
                _grad(p).mul_(coef)
        for group in self.opt.param_groups:  # the schedule is a function of the optimizer step
            group["lr"] = self.lr_now = learning_rate(
                self.opt_steps, base_lr=self.settings.lr, schedule=self.settings.lr_schedule,
                warmup_steps=self.settings.warmup_steps, total_steps=self.settings.steps,
                min_lr_ratio=self.settings.min_lr_ratio)
        if self._write_unconfirmed:  # the last checkpoint is durable before this step commits (see
            self._wait_for_writes()   # _wait_for_writes): a failed write loses at most one interval
        self.consistent = False  # parameters and optimizer state move to the next step
        self.opt.step()
        if self.zero1:
            self._zero1_share_params()
        self.opt_steps += 1
        self.step += 1
        self.consistent = True
        self.samples_seen += self.plan.global_batch_size
        dt = time.perf_counter() - t0
        rec = {"step": self.step, "loss": loss, "samples": self.plan.global_batch_size,
               "samples_seen": self.samples_seen, "iteration_time_s": dt, "grad_norm": norm,
               "tokens_per_s": self.plan.global_batch_size * self.cfg.sequence_length / dt,
               "memory_bytes": peak_memory_bytes(self.device), "plan_version": self.settings.plan_version,
               "world_size": self.world, "time": time.time(), "lr": self.lr_now,
               "model_flops_per_s": self.plan.global_batch_size * self.cfg.sequence_length * self.flops_per_token / dt}
        rec["_jit"], rec["_stop"] = jit_any > 0, stop_any > 0
        rec.update(self._measured)
        self._measured = {}
        return rec

    def _emit(self, rec: dict[str, Any]) -> None:
        clean = {k: v for k, v in rec.items() if not k.startswith("_")}
        self.history.append(clean)
        rank_dir = self.settings.extra.get("rank_metrics_dir")
        if rank_dir:  # per-rank time and memory, for the worker agent's reports
            with open(os.path.join(rank_dir, f"rank-{self.rank}.jsonl"), "a") as f:
                f.write(json.dumps({**clean, "rank": self.rank, "stage": self.me.stage,
                                    "pipeline": self.me.pipeline}) + "\n")
        if self.rank != 0:
            return
        if self.settings.metrics_out:
            with open(self.settings.metrics_out, "a") as f:
                f.write(json.dumps(clean) + "\n")
        if self.on_metrics:
            self.on_metrics(clean)

    def train(self, until_step: int | None = None) -> str:
        """Train to `until_step` (default settings.steps). Returns 'done' or 'stopped'."""
        until = self.settings.steps if until_step is None else until_step
        every = self.settings.checkpoint_interval
        while self.step < until:
            rec = self.train_step()
            self._emit(rec)
            if self.checkpointer is not None:  # a background write that failed ends the job now, not at
                self.checkpointer.raise_if_failed()  # the next checkpoint (its peers are aborted with it)
            if rec["_jit"] or rec["_stop"]:
                self.log(f"rank {self.rank}: just-in-time checkpoint at step {self.step}")
                self.save_checkpoint(blocking=True, prune=False)
                if rec["_stop"]:
                    return "stopped"
            elif every and self.step % every == 0:
                self.save_checkpoint()
        if self.checkpointer is not None:
            self.save_checkpoint(blocking=True)
        return "done"

    def close(self) -> None:
        """Waits for this rank's checkpoint writes; a retention pass in progress is cancelled."""
        if self.checkpointer is not None:
            with contextlib.suppress(SailorError):
                self.checkpointer.close()


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
