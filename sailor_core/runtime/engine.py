"""One rank of a heterogeneous PP x DP x TP training job (torch.distributed must be initialised).

Contract:
- `Trainer(plan, cfg, settings, rank, world_size)` builds, in its constructor, this rank's process
  groups, its stage (layers [first, last] of its stage, sharded for its replica's TP degree, from the
  deterministic (seed, layer) init), its AdamW, its point-to-point peers and its checkpoint I/O,
  composed from one module per technique in the order `Trainer.__init__` states:
  tp_groups.py (TP groups), data_parallel.py (gradient sync, overlap, ZeRO-1),
  tied_weights.py (a tied embedding and head on two stages), pipeline_schedule.py (peers and the
  1F1B / GPipe order), stage_compute.py (a microbatch's forward and backward, the samples it reads),
  checkpoint_io.py (snapshot, write, resume; it sees the trainer only as a `TrainState`),
  notices.py (preemption notices, stops), lr_schedule.py (the learning rate).
- `Trainer.resume(previous)` resumes from this process's previous trainer and/or the newest valid
  checkpoint (checkpoint_io.py); `Trainer.train(until_step)` runs steps. The gradient is the exact
  mean over the global batch for any pipelines' microbatch sizes and counts, and gradient clipping
  uses the global norm of full-layout gradients: results match a single-process run of the model.
- A CUDA rank makes its own GPU current (`select_device`, from the local rank) before any
  communication; collectives that allocate on a device (barrier, object broadcast) are given it.
- `Trainer.train_step()` returns a `StepResult`: the step's metrics record, whether every rank
  checkpoints now and whether every rank stops. Every step ends with one world all-reduce of [loss,
  grad norm^2, checkpoint flag, stop flag], so a preemption notice (SIGUSR1 or
  `settings.preempt_file` appearing) on any rank makes every rank take a just-in-time checkpoint at
  that step, and SIGTERM (or a stop file, or the worker's plan change) checkpoints and stops. Every
  rank does the same collectives in the same order. A checkpoint's background write is durable
  before the next step's optimizer update commits (`CheckpointIO.before_commit`).
- Rank 0 reports one metrics record per step through `on_metrics` (and `settings.metrics_out`),
  with `checkpoint_stall_s` and `checkpoint_write_s` in the record after a checkpoint's write ended;
  with `settings.rank_metrics_dir` every rank also appends its own records there.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sailor_core.catalog import is_cpu_type
from sailor_core.domain import ParallelPlan
from sailor_core.errors import SailorError
from sailor_core.models.config import TransformerConfig
from sailor_core.models.torch_model import StageModel
from sailor_core.runtime.checkpoint import layer_state
from sailor_core.runtime.checkpoint_io import CheckpointIO
from sailor_core.runtime.comm import Waiter
from sailor_core.runtime.data import TokenBatches, TokenDataset, load_tokens
from sailor_core.runtime.data_parallel import GradSync, dp_group, grad_of, grad_sq_norm, zero1_for
from sailor_core.runtime.islands import IslandSettings, island_sync_for, resume_outer
from sailor_core.runtime.lr_schedule import learning_rate
from sailor_core.runtime.notices import NoticePoll, Notices
from sailor_core.runtime.pipeline_schedule import P2P, run_schedule, stage_peers
from sailor_core.runtime.stage_compute import StageCompute
from sailor_core.runtime.tied_weights import TiedWeights
from sailor_core.runtime.topology import layout
from sailor_core.runtime.tp_groups import tp_context
from sailor_core.runtime.train_state import Progress, TrainState


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
    rank_metrics_dir: str | None = None  # every rank appends its own records here (per-stage step times)
    # a model that is not built in (read from a config.json): TransformerConfig.to_dict()
    model_config: dict[str, Any] | None = None
    # learning-rate schedule (sailor_core.runtime.lr_schedule): warmup, then constant, cosine or linear decay
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    recompute: bool = False  # activation recomputation: blocks keep only their input for backward
    # semi-synchronous training: this job is one island of the run (runtime/islands.IslandSettings.to_dict())
    islands: dict[str, Any] | None = None

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



@dataclass(frozen=True, kw_only=True)
class StepResult:
    """One step's outcome, the same on every rank: its metrics record, and what every rank does next."""

    metrics: dict[str, Any]  # the step's record (rank 0 reports it; see the module's contract)
    checkpoint_now: bool  # a preemption notice somewhere: every rank checkpoints at this step
    stop: bool  # a stop somewhere: every rank checkpoints and stops


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


def backend_for(gpu_type: str) -> str:
    return "gloo" if is_cpu_type(gpu_type) else "nccl"


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class Trainer:
    """One rank of the job, composed from the runtime's techniques (see the module's contract)."""

    def __init__(self, plan: ParallelPlan, cfg: TransformerConfig, settings: TrainSettings, rank: int,
                 world_size: int, *, local_rank: int = 0, dataset: TokenBatches | None = None,
                 on_metrics: Callable[[dict[str, Any]], None] | None = None, log: Callable[[str], None] | None = None,
                 notices: Notices | None = None, waiter: Waiter | None = None):
        lay = layout(plan)
        if world_size != len(lay):
            raise SailorError(f"the plan needs {len(lay)} ranks but the job has {world_size}")
        self.plan, self.cfg, self.settings = plan, cfg, settings
        self.rank, self.world, self.me = rank, world_size, lay[rank]
        self.log = log or (lambda m: None)
        self.on_metrics = on_metrics
        self.waiter = waiter or Waiter()  # plain waits unless the worker hands in its abortable one
        self.notice_poll = NoticePoll(notices or Notices(), settings.preempt_file, settings.stop_file)
        stage, backend = plan.stages[self.me.stage], backend_for(self.me.gpu_type)
        # 1. The device, before any communication: NCCL and device-allocating collectives use the current GPU.
        self.device = select_device(self.me.gpu_type, local_rank)
        # 2. Every process group, every rank in one order (torch requires it), before the model: its
        #    TP layers communicate over the TP group. Then data parallelism's, then the tie's.
        self.tp = tp_context(plan, rank, backend)
        group, hetero = dp_group(plan, rank, backend)
        self.tied = TiedWeights(plan, cfg, rank, backend)
        # 3. The stage's layers, sharded for this TP rank, from the deterministic (seed, layer) init.
        self.model = StageModel(cfg, stage.first_layer, stage.last_layer, self.tp, settings.seed,
                                recompute=settings.recompute or stage.recompute).to(self.device)
        params = [p for _, p in self.model.named_parameters()]
        # 4. ZeRO-1 ownership before the optimizer, which then keeps state for the owned parameters only.
        #    Replicas that shard differently keep the full state.
        self.zero1 = zero1_for(plan, self.me, self.tp.rank, params, group, hetero, self.waiter.wait)
        if plan.zero1 and hetero and rank == 0:
            self.log("zero1: replicas of a stage shard differently (different TP degrees); "
                     "every replica keeps the full optimizer state")
        owned = self.zero1.mine if self.zero1 is not None else params
        self.owned = {id(p) for p in owned}  # the parameters this rank's optimizer steps
        self.opt: torch.optim.Optimizer = torch.optim.AdamW(
            [{"params": [p for p in owned if p.dim() >= 2], "weight_decay": settings.weight_decay},
             {"params": [p for p in owned if p.dim() < 2], "weight_decay": 0.0}],
            lr=settings.lr, betas=settings.betas, eps=1e-8)
        # 5. Gradient sync after the model: its overlap hooks the parameters' gradients, bucket by layer.
        self.grads = GradSync(group, hetero, params, list(self.model.layers), self.tp, self.device, self.waiter.wait)
        # 6. The pipeline: its peers, and a stage compute that arms the overlap at the last backward.
        self.peers = stage_peers(plan, self.me)
        self.data = dataset
        if self.data is None and (self.model.has_embedding or self.model.has_head):  # only they read tokens
            self.data = TokenDataset(load_tokens(settings.data), cfg.sequence_length, settings.seed, cfg.vocab_size)
        self.compute = StageCompute(self.model, self.data, plan, self.me, cfg.sequence_length, cfg.hidden_size,
                                    self.device, sends_input_grad=bool(self.peers.send_bwd_to),
                                    on_last_backward=self.grads.arm)
        self.p2p = P2P(self.compute.act_shape, self.compute.comm_dtype, self.device, self.tp, self.waiter.wait)
        if self.device.type == "cuda":
            # NCCL builds a group's communicator at its first collective, and a batch of point-to-point
            # operations may only be that first call if every rank of the group takes part: make the
            # world's communicator now, on this rank's GPU.
            self.waiter.barrier(self.device)
        # 7. Checkpoint I/O last: it snapshots everything above.
        self.checkpoints = CheckpointIO(settings.checkpoint_uri, rank=rank, device=self.device, waiter=self.waiter,
                                        log=self.log)
        # 8. Islands (semi-synchronous training): a global copy of the initial parameters, the outer loop.
        self.outer = island_sync_for(
            IslandSettings.from_dict(settings.islands) if settings.islands else None, plan=plan, me=self.me,
            params=params, dp_group=group, tokens_per_step=plan.global_batch_size * cfg.sequence_length,
            timeout_s=settings.timeout_s, log=self.log, wait=self.waiter.wait)
        self.step = self.samples_seen = self.opt_steps = 0
        # False only while the optimizer updates the state: a trainer whose generation failed (a lost
        # peer raises only from a communication wait) otherwise holds exactly the state of `step`
        self.consistent = True
        self.lr_now = settings.lr
        self.flops_per_token = cfg.flops_per_token()  # for the metrics' model FLOP/s (MFU = that / peak)

    def process_groups(self) -> list[Any]:
        """The subgroups this rank belongs to. A failed generation's worker keeps these (not the trainer)
        until the process ends: gloo work blocked on a lost peer runs on their threads until its
        timeout, and freeing a group joins them."""
        return [g for g in (self.tp.group, self.grads.group, self.tied.group) if g is not None]

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, *, blocking: bool = False, prune: bool = True) -> None:
        """This step's checkpoint (every rank calls it at the same step); `blocking`: written and agreed
        by every rank on return; `prune=False`: no retention pass on the way (a just-in-time checkpoint)."""
        self.checkpoints.save(self.step, self._snapshot, f"part_s{self.me.stage}_t{self.tp.rank}.json",
                              blocking=blocking, prune=prune)

    def _snapshot(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any] | None] | None:
        """(this rank's layer states, meta.json on rank 0), or None: replica 0 of each stage writes its
        layers, the others hold copies. The ZeRO-1 gather is a collective: every replica runs it."""
        gathered = self.zero1.gather_state(self.opt, self.opt_steps) if self.zero1 is not None else None
        if self.me.pipeline != 0:
            return None
        state_of = (lambda p: gathered[id(p)]) if gathered is not None else (lambda p: self.opt.state.get(p, {}))
        extra_of = self.outer.extra_of if self.outer is not None else None
        states = {li: layer_state(li, layer, state_of, self.tp.rank, self.tp.size, extra_of)
                  for li, layer in zip(self.model.layer_ids, self.model.layers, strict=True)}
        meta = None
        if self.rank == 0:
            meta = {"step": self.step, "samples_seen": self.samples_seen, "opt_steps": self.opt_steps,
                    "model": self.cfg.name, "seed": self.settings.seed, "num_layers": self.cfg.num_layers,
                    "plan_version": self.settings.plan_version, "time": time.time()}
            if self.outer is not None:
                meta["outer"] = self.outer.state.round_meta()
        return states, meta

    def state(self) -> TrainState:
        """This rank's training state as checkpointing sees it (train_state.py)."""
        return TrainState(cfg=self.cfg, model=self.model, opt=self.opt, tp=self.tp, owned=frozenset(self.owned),
                          zero1=self.zero1, consistent=self.consistent,
                          progress=Progress(self.step, self.samples_seen, self.opt_steps),
                          saved_step=self.checkpoints.saved_step)

    def resume(self, previous: Trainer | None) -> str:
        """Resume every rank at one step, from `previous` (this process's trainer of the last
        generation) where it can, else from the newest valid checkpoint: 'memory', 'checkpoint' or
        'none' (checkpoint_io.py). Collective."""
        how, at = self.checkpoints.resume(self.state(), previous.state() if previous is not None else None,
                                          world=self.world, seed=self.settings.seed,
                                          plan_version=self.settings.plan_version)
        if at is not None:
            self.step, self.samples_seen, self.opt_steps = at.step, at.samples_seen, at.opt_steps
        if self.outer is not None:
            resume_outer(self.outer, how=how, step=at.step if at is not None else None,
                         storage=self.checkpoints.storage, previous=previous.outer if previous is not None else None,
                         model=self.model, tp=self.tp)
        return how

    # -- one training step -----------------------------------------------------------------------
    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        self.model.zero_grad(set_to_none=True)  # every gradient: under ZeRO-1 the optimizer sees only its own
        self.compute.begin(self.samples_seen)
        run_schedule(self.plan.schedule, self.compute.num_microbatches, self.me.stage, self.plan.num_stages,
                     self.peers, self.p2p, self.compute.forward, self.compute.backward)
        self.p2p.drain()
        t_pipe = time.perf_counter()
        self.grads.sync()
        self.tied.sync(self.model, self.tp, self.device, self.waiter.wait)
        t_sync = time.perf_counter()
        loss, norm, jit, stop = self._agree()
        t_agree = time.perf_counter()
        if self.settings.max_grad_norm > 0 and norm > self.settings.max_grad_norm:
            coef = self.settings.max_grad_norm / (norm + 1e-6)
            for p in self.grads.params:
                grad_of(p).mul_(coef)
        s = self.settings
        for group in self.opt.param_groups:  # the schedule is a function of the optimizer step
            group["lr"] = self.lr_now = learning_rate(
                self.opt_steps, base_lr=s.lr, schedule=s.lr_schedule, warmup_steps=s.warmup_steps,
                total_steps=s.steps, min_lr_ratio=s.min_lr_ratio)
        self.checkpoints.before_commit(self.step)  # the last checkpoint is durable before this step commits
        self.consistent = False  # parameters and optimizer state move to the next step
        self.opt.step()
        if self.zero1 is not None:
            self.zero1.share_params()
        self.opt_steps += 1
        self.step += 1
        outer_s = self.outer.after_step() if self.outer is not None else None  # at a boundary: the outer step
        self.consistent = True
        self.samples_seen += self.plan.global_batch_size
        t_end = time.perf_counter()
        phases = {"pipeline_s": t_pipe - t0, "grad_sync_s": t_sync - t_pipe, "agree_s": t_agree - t_sync,
                  "optimizer_s": t_end - t_agree, **({"outer_sync_s": outer_s} if outer_s is not None else {})}
        return StepResult(metrics=self._record(loss, norm, t_end - t0, phases), checkpoint_now=jit, stop=stop)

    def _agree(self) -> tuple[float, float, bool, bool]:
        """The step's one world all-reduce: (loss, global grad norm, checkpoint now, stop) for every rank."""
        head_reporter = self.model.has_head and self.tp.rank == 0
        jit, stop = self.notice_poll.poll()
        red = torch.stack([
            self.compute.loss if head_reporter else torch.zeros((), device=self.device),
            grad_sq_norm(self.grads.params, pipeline=self.me.pipeline, tp_rank=self.tp.rank, device=self.device,
                         skip=self.tied.duplicate(self.model)),
            torch.tensor(jit, device=self.device),
            torch.tensor(stop, device=self.device),
        ])
        self.waiter.wait(dist.all_reduce(red, async_op=True))
        loss, sq, jit_any, stop_any = red.tolist()
        if jit_any:
            self.notice_poll.answered()
        return loss, math.sqrt(max(sq, 0.0)), jit_any > 0, stop_any > 0

    def _record(self, loss: float, norm: float, dt: float, phases: dict[str, float]) -> dict[str, Any]:
        tokens = self.plan.global_batch_size * self.cfg.sequence_length
        rec = {"step": self.step, "loss": loss, "samples": self.plan.global_batch_size,
               "samples_seen": self.samples_seen, "iteration_time_s": dt, "grad_norm": norm,
               "tokens_per_s": tokens / dt, "memory_bytes": peak_memory_bytes(self.device),
               "plan_version": self.settings.plan_version, "world_size": self.world, "time": time.time(),
               "lr": self.lr_now, "model_flops_per_s": tokens * self.flops_per_token / dt, **phases}
        rec.update(self.checkpoints.take_measured())
        return rec

    def _emit(self, rec: dict[str, Any]) -> None:
        rank_dir = self.settings.rank_metrics_dir
        if rank_dir:  # per-rank time and memory, for the worker agent's reports
            with open(os.path.join(rank_dir, f"rank-{self.rank}.jsonl"), "a") as f:
                f.write(json.dumps({**rec, "rank": self.rank, "stage": self.me.stage,
                                    "pipeline": self.me.pipeline}) + "\n")
        if self.rank != 0:
            return
        if self.settings.metrics_out:
            with open(self.settings.metrics_out, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if self.on_metrics:
            self.on_metrics(rec)

    def train(self, until_step: int | None = None) -> str:
        """Train to `until_step` (default settings.steps). Returns 'done' or 'stopped'."""
        until = self.settings.steps if until_step is None else until_step
        every = self.settings.checkpoint_interval
        while self.step < until:
            result = self.train_step()
            self._emit(result.metrics)
            # a background write that failed ends the job now, not at the next checkpoint (its peers
            # are aborted with it)
            self.checkpoints.raise_if_failed()
            if result.checkpoint_now or result.stop:
                self.log(f"rank {self.rank}: just-in-time checkpoint at step {self.step}")
                self.save_checkpoint(blocking=True, prune=False)
                if result.stop:
                    if self.outer is not None:
                        self.outer.leave()  # the other islands stop waiting for this one
                    return "stopped"
            elif every and self.step % every == 0:
                self.save_checkpoint()
        if self.checkpoints.checkpointer is not None:
            self.save_checkpoint(blocking=True)
        if self.outer is not None:
            self.outer.leave()  # done: an island still training stops waiting for this one
        return "done"

    def close(self) -> None:
        """Waits for this rank's checkpoint writes (a retention pass in progress is cancelled) and
        unhooks the gradient sync, so nothing but its holders keeps this trainer's memory alive."""
        self.checkpoints.close()
        self.grads.close()
