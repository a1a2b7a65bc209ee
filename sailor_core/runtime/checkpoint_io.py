"""One trainer's checkpoint I/O: snapshot, background write, durable before the next commit, resume.

Contract (the storage layer, the on-disk layout and what "valid" means: runtime/checkpoint.py):
- `CheckpointIO(uri, rank, device, waiter, log)`: no storage without a URI, and then every call is a
  no-op. Every rank calls `save` at the same steps (the decision is part of the step's world
  all-reduce), so a collective inside the snapshot (the ZeRO-1 gather) is reached by all of them.
  `save(step, snapshot, part_name)` first waits until no rank's previous write is still going,
  then snapshots this rank's layers (`snapshot()`: (layer states, meta.json or None) or None where
  this rank writes nothing: replica 0 of each stage writes its layers, the others hold copies) and
  hands them to a background writer; `blocking`: written and agreed by every rank on return, and
  this rank's retention pass done (after the agreement: no peer waits on it);
  `prune=False`: no retention pass on the way (a just-in-time checkpoint).
- A background write is durable before the step after it commits: the trainer calls
  `before_commit(step)` before its optimizer update, which waits while a write is unconfirmed, so a write that fails
  for good (a full disk, a store down past its retries) ends the job with at most one interval of
  steps lost. Every rank pauses together, meeting in one small MAX all-reduce per poll (at most one
  a second), which also carries the slowest rank's last checkpoint times, the stall (snapshot) and
  the write: `take_measured()` hands them to the next step's record as `checkpoint_stall_s` and
  `checkpoint_write_s` (the flow chooses the checkpoint interval from them).
- `resume(me, previous)` resumes every rank at one step, from memory where it can: when every
  rank's previous trainer (this process's trainer of the last generation) holds its whole shard at
  the same step, nobody reads a checkpoint ('memory'); otherwise every rank resumes at the newest
  valid checkpoint's step (rank 0 decides; the survivors of a lost member first write a newer one
  from memory where they hold every layer: runtime/memory_checkpoint.py), a rank whose previous
  trainer is at that step keeps the layers it holds from memory, and loads the rest ('memory' when
  it loaded nothing, else 'checkpoint'; 'none' without a checkpoint: a fresh start). Collective.
  ZeRO-1 keeps partial optimizer state, so its trainers never keep state from memory.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist

from sailor_core.errors import SailorError
from sailor_core.models.tensor_parallel import SHARD_ATTR, shard
from sailor_core.runtime import checkpoint as ckpt
from sailor_core.runtime import memory_checkpoint
from sailor_core.runtime.checkpoint_writer import AsyncCheckpointer
from sailor_core.runtime.comm import Waiter
from sailor_core.runtime.train_state import Progress, TrainState

LayerState = dict[str, Any]
Snapshot = Callable[[], "tuple[dict[int, LayerState], dict[str, Any] | None] | None"]


def kept_layers(me: TrainState, previous: TrainState | None) -> set[int]:
    """The layers of `me`'s shard that `previous` holds shard for shard, in a consistent state."""
    if previous is None or me.zero1 is not None or previous.zero1 is not None or not previous.consistent:
        return set()
    theirs = {previous.layer_key(li) for li in previous.model.layer_ids}
    return {li for li in me.model.layer_ids if me.layer_key(li) in theirs}


def adopt(me: TrainState, old: TrainState | None, layers: set[int], device: torch.device) -> None:
    """Copy `layers` (parameters and this rank's optimizer state) from `old`, which holds them shard for shard."""
    if old is None or not layers:
        return
    theirs = dict(zip(old.model.layer_ids, old.model.layers, strict=True))
    with torch.no_grad():
        for li, layer in zip(me.model.layer_ids, me.model.layers, strict=True):
            if li not in layers:
                continue
            pairs = zip(layer.named_parameters(remove_duplicate=False),
                        theirs[li].named_parameters(remove_duplicate=False), strict=True)
            for (name, p), (old_name, q) in pairs:
                assert name == old_name, (name, old_name)
                p.copy_(q.detach().to(device))
                if q in old.opt.state and id(p) in me.owned:
                    me.opt.state[p] = {k: (v.to(device) if v.dim() else v.clone()) for k, v in old.opt.state[q].items()}


class CheckpointIO:
    """This rank's checkpoints (see the module's contract)."""

    def __init__(self, uri: str | None, *, rank: int, device: torch.device, waiter: Waiter,
                 log: Callable[[str], None]) -> None:
        self.storage = ckpt.open_storage(uri) if uri else None
        self.checkpointer = AsyncCheckpointer(self.storage) if self.storage else None
        self.rank, self.device, self.waiter, self.log = rank, device, waiter, log
        self.saved_step = -1
        self.write_unconfirmed = False  # a background write started at the last checkpoint, not yet agreed done
        self._stall_s: float | None = None  # the last checkpoint's snapshot time on this rank
        self._measured: dict[str, float] = {}  # the slowest rank's last checkpoint times, for the next record

    def save(self, step: int, snapshot: Snapshot, part_name: str, *, blocking: bool = False,
             prune: bool = True) -> None:
        """Checkpoint `step` (every rank calls it at the same step; see the module's contract)."""
        if self.checkpointer is None:
            return
        if self.saved_step != step:
            self.wait_for_writes(step, blocking)
            self.saved_step = step
            t0 = time.perf_counter()
            taken = snapshot()
            if taken is not None:
                states, meta = taken
                self.checkpointer.save(step, states, part_name, meta, prune=prune)
                if blocking:
                    self.checkpointer.wait(retention=False)
            self._stall_s = time.perf_counter() - t0
            self.write_unconfirmed = not blocking
        if blocking:
            # Every rank's files written, agreed at the barrier; then this rank's retention pass, after it: a
            # slow pass (older checkpoints read back from object storage) held the peers in the barrier past
            # their timeout, and a job that had trained every step failed at its last checkpoint.
            self.checkpointer.wait(retention=False)
            self.waiter.barrier(self.device)
            if prune:
                self.checkpointer.wait()

    def before_commit(self, step: int) -> None:
        """Before the optimizer update that ends step `step + 1`: the last checkpoint's write is durable
        on every rank (a failed write is raised here), so a write that fails loses at most one interval."""
        if self.write_unconfirmed:
            self.wait_for_writes(step)

    def wait_for_writes(self, step: int, blocking: bool = False) -> None:
        """Until no rank's last checkpoint write is still going (`step`: where training stands); a
        write that failed is raised here. Every rank pauses together, so none takes the wait for a
        lost peer."""
        t0, pause, told = time.monotonic(), 0.02, -30.0
        while self._checkpoint_times(wait=blocking):
            waited = time.monotonic() - t0
            if waited - told >= 30.0:
                told = waited
                self.log(f"rank {self.rank}: step {step + 1} waits for the checkpoint write of step "
                         f"{self.saved_step} ({waited:.0f} s so far)")
            time.sleep(pause)
            pause = min(1.0, pause * 2)
        self.write_unconfirmed = False

    def _checkpoint_times(self, *, wait: bool) -> bool:
        """Whether any rank's previous write is still going (after waiting for this rank's when `wait`);
        notes the slowest rank's last stall and write for the next record."""
        assert self.checkpointer is not None
        if wait:
            self.checkpointer.wait(retention=False)
        self.checkpointer.raise_if_failed()
        t = torch.tensor([self._stall_s or 0.0, self.checkpointer.last_write_s, float(self.checkpointer.busy())],
                         dtype=torch.float64, device=self.device)
        self.waiter.wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True))
        if self._stall_s is not None and not t[2]:  # the first checkpoint of this trainer measured nothing yet
            self._measured = {"checkpoint_stall_s": float(t[0]), "checkpoint_write_s": float(t[1])}
        return bool(t[2])

    def take_measured(self) -> dict[str, float]:
        """The checkpoint times measured since the last call (for one step's record)."""
        out, self._measured = self._measured, {}
        return out

    def raise_if_failed(self) -> None:
        """A background write that failed ends the job now, not at the next checkpoint."""
        if self.checkpointer is not None:
            self.checkpointer.raise_if_failed()

    def close(self) -> None:
        """Waits for this rank's checkpoint writes; a retention pass in progress is cancelled."""
        if self.checkpointer is not None:
            with contextlib.suppress(SailorError):
                self.checkpointer.close()

    # -- resume --------------------------------------------------------------------------------
    def resume(self, me: TrainState, previous: TrainState | None, *, world: int, seed: int,
               plan_version: int) -> tuple[str, Progress | None]:
        """How `me` resumed ('memory', 'checkpoint' or 'none') and where it stands now (None: at 0).
        Collective (see the module's contract); `seed`, `plan_version`: the run's, for a meta.json
        written from memory."""
        kept = kept_layers(me, previous)
        whole = previous is not None and kept == set(me.model.layer_ids)
        mine = float(previous.progress.step) if whole and previous is not None else -1.0
        agree = torch.tensor([mine, -mine], dtype=torch.float64, device=self.device)
        self.waiter.wait(dist.all_reduce(agree, op=dist.ReduceOp.MAX, async_op=True))
        if previous is not None and mine >= 0 and agree[0].item() == mine == -agree[1].item():
            adopt(me, previous, kept, self.device)
            self.saved_step = previous.saved_step
            self.log(f"rank {self.rank}: kept its state from memory at step {previous.progress.step}")
            return "memory", previous.progress
        if self.storage is None:
            return "none", None
        step: list[Any] = [None]
        if self.rank == 0:
            step = [ckpt.latest_valid_step(self.storage, me.cfg.num_layers, self.log)]
        # The survivors of a lost member may together hold a newer step than any checkpoint (a lost
        # replica's layers live on in its stage's other replicas): write it, and resume there.
        newer = memory_checkpoint.write_from_memory(
            memory_checkpoint.Writer(storage=self.storage, rank=self.rank, device=self.device, waiter=self.waiter,
                                     log=self.log),
            previous, step[0], world=world, cfg=me.cfg, seed=seed, plan_version=plan_version)
        if self.rank == 0 and newer is not None:
            step = [newer]
        dist.broadcast_object_list(step, src=0, device=self.device)
        if step[0] is None:
            return "none", None
        if previous is None or previous.progress.step != step[0]:
            kept = set()
        adopt(me, previous, kept, self.device)
        loaded, at = self.load_step(me, int(step[0]), ckpt.read_meta(self.storage, int(step[0])), skip=kept)
        self.log(f"rank {self.rank}: at step {at.step}: {len(kept)} layer(s) kept from memory, {loaded} loaded")
        return ("checkpoint" if loaded else "memory"), at

    def load_step(self, me: TrainState, step: int, meta: dict[str, Any],
                  skip: Collection[int] = ()) -> tuple[int, Progress]:
        """Load the layers of checkpoint `step` that `me` holds, except `skip` (kept from memory), into
        `me`; (how many layers it read, where the checkpoint stands)."""
        assert self.storage is not None
        if meta.get("model") != me.cfg.name:
            raise SailorError(f"checkpoint step {step} is of model {meta.get('model')!r}, not {me.cfg.name!r}")
        opt_steps = int(meta["opt_steps"])
        wanted = [li for li in me.model.layer_ids if li not in skip]
        fulls = ckpt.load_layer_states(self.storage, step, wanted)
        tp = me.tp
        with torch.no_grad():
            for li, layer in zip(me.model.layer_ids, me.model.layers, strict=True):
                if li not in fulls:
                    continue
                full = fulls[li]
                for name, p in layer.named_parameters(remove_duplicate=False):
                    dim = getattr(p, SHARD_ATTR, None)
                    p.copy_(shard(full["params"][name], dim, tp.rank, tp.size))
                    if opt_steps > 0 and id(p) in me.owned:
                        me.opt.state[p] = {
                            "step": torch.tensor(float(opt_steps)),
                            "exp_avg": shard(full["exp_avg"][name], dim, tp.rank, tp.size).to(self.device),
                            "exp_avg_sq": shard(full["exp_avg_sq"][name], dim, tp.rank, tp.size).to(self.device),
                        }
        self.log(f"rank {self.rank}: resumed from checkpoint step {step}")
        return len(wanted), Progress(int(meta["step"]), int(meta["samples_seen"]), opt_steps)
