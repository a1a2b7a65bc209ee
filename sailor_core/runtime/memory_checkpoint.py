"""A checkpoint from the survivors' memory: a lost VM costs no steps when its state lives on elsewhere.

Contract: when a generation ends because a member was lost, every surviving process keeps its
trainer (worker_proc) at the step it completed. The next generation's resume (checkpoint_io) first
calls `write_from_memory(writer, previous, newest_valid, ...)`, a collective over the new world
(`writer`: where and how this rank writes; `previous`: its last trainer's `TrainState`):
- every rank tells what its previous trainer holds, shard for shard, at which step (`Held`);
- `newest_complete_step` finds the newest step S, newer than the newest valid checkpoint, at which
  the ranks together hold every layer whole (all TP shards of one degree): a layer of a replica that
  was lost is still held by another replica of its stage (data parallelism keeps whole copies);
- if there is one, each shard is written once (by the lowest rank holding it, `writers`), an
  incomplete checkpoint of step S left by the lost VM (a just-in-time write that did not finish
  within its notice) is first moved to quarantine, and rank 0 writes meta.json last. The usual
  resume then finds step S valid: the survivors keep their layers from memory, the others load.
Nothing here holds state between calls. Without such a step nothing is written and the resume falls
back to the newest checkpoint, as before. ZeRO-1 keeps partial optimizer state: it never qualifies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sailor_core.models.config import TransformerConfig
from sailor_core.runtime import checkpoint as ckpt
from sailor_core.runtime.checkpoint_storage import CheckpointStorage
from sailor_core.runtime.comm import Waiter
from sailor_core.runtime.train_state import TrainState

Shard = tuple[int, int, int]  # (layer, tp rank, tp degree)


@dataclass(frozen=True)
class Held:
    """What one rank's previous trainer holds: its shards at `step` (-1: nothing usable)."""

    step: int
    samples_seen: int
    opt_steps: int
    shards: tuple[Shard, ...]


NOTHING = Held(-1, 0, 0, ())


@dataclass(frozen=True, kw_only=True)
class Writer:
    """Where and how this rank writes: the run's checkpoint storage, its rank, device, waits and log."""

    storage: CheckpointStorage | None
    rank: int
    device: torch.device
    waiter: Waiter
    log: Callable[[str], None]


def held_by(previous: TrainState | None) -> Held:
    """`previous` trainer's shards, or NOTHING when it has none in a consistent, whole state."""
    if previous is None or previous.zero1 is not None or not previous.consistent or previous.progress.step <= 0:
        return NOTHING
    shards = tuple((li, previous.tp.rank, previous.tp.size) for li in previous.model.layer_ids)
    at = previous.progress
    return Held(at.step, at.samples_seen, at.opt_steps, shards)


def _whole(shards: set[Shard], layer: int) -> bool:
    by_degree: dict[int, set[int]] = {}
    for li, t, size in shards:
        if li == layer:
            by_degree.setdefault(size, set()).add(t)
    return any(ts == set(range(size)) for size, ts in by_degree.items())


def newest_complete_step(helds: Sequence[Held], num_layers: int, newer_than: int | None) -> int | None:
    """The newest step above `newer_than` at which `helds` together hold every layer whole (None: none)."""
    floor = -1 if newer_than is None else newer_than
    for step in sorted({h.step for h in helds if h.step > floor}, reverse=True):
        shards = {s for h in helds if h.step == step for s in h.shards}
        if all(_whole(shards, li) for li in range(num_layers)):
            return step
    return None


def writers(helds: Sequence[Held], step: int) -> dict[int, list[Shard]]:
    """Rank -> the shards it writes for `step`: each shard once, by the lowest rank holding it."""
    out: dict[int, list[Shard]] = {}
    taken: set[Shard] = set()
    for rank, h in enumerate(helds):
        if h.step != step:
            continue
        for s in h.shards:
            if s not in taken:
                taken.add(s)
                out.setdefault(rank, []).append(s)
    return out


def write_from_memory(io: Writer, previous: TrainState | None, newest_valid: int | None, *, world: int,
                      cfg: TransformerConfig, seed: int, plan_version: int) -> int | None:
    """Collective over the `world` ranks: write checkpoint S with `io` from the ranks' previous
    trainers when they hold every layer at a step S newer than `newest_valid` (rank 0's answer
    counts); returns S, or None when nothing was written. `seed`, `plan_version`: the run's, for meta.json."""
    mine = held_by(previous)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (mine, newest_valid if io.rank == 0 else None))
    helds = [g[0] for g in gathered]
    step = newest_complete_step(helds, cfg.num_layers, gathered[0][1])
    if step is None and io.rank == 0 and any(h.step >= 0 for h in helds):
        io.log(f"no checkpoint from the survivors' memory: no step newer than {gathered[0][1]} at which they hold "
               f"every layer (each rank's step: {[h.step for h in helds]})")
    if step is None or io.storage is None:
        return None
    storage = io.storage
    if io.rank == 0 and storage.exists(ckpt.step_dir(step)):
        ckpt.quarantine(storage, step, "incomplete when its job lost a member; rewritten from the survivors' memory")
    io.waiter.barrier(io.device)
    assigned = writers(helds, step).get(io.rank, [])
    if assigned and previous is not None:
        layers = dict(zip(previous.model.layer_ids, previous.model.layers, strict=True))
        states = [(li, ckpt.layer_state(li, layers[li], previous.opt.state.get, previous.tp.rank, previous.tp.size))
                  for li, _, _ in assigned]
        ckpt.write_part(storage, step, states, f"part_mem_r{io.rank}.json")
    io.waiter.barrier(io.device)
    if io.rank == 0:
        src = next(h for h in helds if h.step == step)
        ckpt.write_meta(storage, step, {
            "step": step, "samples_seen": src.samples_seen, "opt_steps": src.opt_steps, "model": cfg.name,
            "seed": seed, "num_layers": cfg.num_layers,
            "plan_version": plan_version, "time": time.time(), "written_from": "memory"})
    io.waiter.barrier(io.device)
    io.log(f"rank {io.rank}: checkpoint step {step} written from the survivors' memory "
           f"({len(assigned)} shard(s) from this rank)")
    return step
