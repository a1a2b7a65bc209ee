"""A semi-synchronous plan's iteration: its islands' own steps plus the exposed share of the outer step.

Contract: `simulate_islands(ip, book, options=None) -> SemiSyncResult` is a pure function of an
`IslandPlan` (sailor_core/semisync.py) and a ProfileBook. An iteration is one inner step of every
island (together they train the plan's global batch) plus 1/H of an outer step:

    inner_s = max_i simulate(island_i).iteration_time_s           (islands wait for the slowest at a boundary)
    outer_s = per fragment: max over shards of the ring all-reduce of the shard's pseudo-gradient among
              the islands (ring_allreduce: 2 (n - 1) steps of bytes / n over the slowest link of the ring,
              the shard's TP ranks as concurrent flows, as the data-parallel rings are timed) + pipeline 0's
              broadcast of the global copy and momentum to the island's other replicas (half a ring)
    iteration_s = inner_s + fragments x outer_s / H

where a shard is one (stage, TP rank) of pipeline 0 and its bytes are the stage's parameters at the
compression's bytes per element (OuterSync.bytes_per_element). Memory: every GPU also holds the
global copy and, with momentum, the outer momentum of its shard in fp32 (the runtime keeps them on the
device). Cost: all GPUs for the iteration's time, each island's own egress per step, and the outer
ring's bytes between zones once per H steps at the book's egress prices. `cross_region_bytes_per_token`
is what crosses region boundaries per token trained: each island's data-parallel and pipeline traffic
that does (none when an island keeps to one region) plus the outer ring's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sailor_core.domain import ParallelPlan, Replica
from sailor_core.profiles import ProfileBook
from sailor_core.semisync import IslandPlan
from sailor_core.simulator import constants as C
from sailor_core.simulator.core import place_nodes, simulate
from sailor_core.simulator.model import SimModel, model_for
from sailor_core.simulator.result import SimOptions, SimulationResult, headline_json

OUTER_FP32_BYTES = 4  # the global copy and the momentum are fp32 (runtime/outer_sync.OuterState)


@dataclass(frozen=True, kw_only=True)
class SemiSyncResult:
    """What one simulation of an island plan found (see the module's contract)."""

    iteration_time_s: float
    inner_step_s: float
    outer_sync_s: float  # one outer step (one fragment's, when streaming)
    outer_exposed_s: float  # per iteration: fragments x outer_sync_s / H
    islands: tuple[SimulationResult, ...]
    peak_memory_bytes: int
    fits_memory: bool
    outer_state_bytes: int  # the largest per-GPU global copy + momentum
    throughput_iterations_per_s: float
    samples_per_s: float
    tokens_per_s: float
    usd_per_iteration: float
    usd_per_hour: float
    usd_per_million_tokens: float
    egress_usd_per_iteration: float
    compute_usd_per_iteration: float
    cross_region_bytes_per_token: float
    num_gpus: int
    inner_steps: int

    def to_json(self) -> dict[str, Any]:
        """The keys of SimulationResult.to_json's top level, and the outer loop's own."""
        return {
            **headline_json(self),
            "semi_sync": {
                "inner_steps": self.inner_steps,
                "inner_step_s": self.inner_step_s,
                "outer_sync_s": self.outer_sync_s,
                "outer_exposed_s_per_iteration": self.outer_exposed_s,
                "outer_state_bytes_per_gpu": self.outer_state_bytes,
                "cross_region_bytes_per_token": self.cross_region_bytes_per_token,
            },
            "islands": [r.to_json() for r in self.islands],
        }


def _ring_members(ip: IslandPlan, s: int) -> tuple[list[Replica], list[int]]:
    """Pipeline 0's replica of stage s in every island, and a node id each (islands never share nodes)."""
    return [p.stages[s].replicas[0] for p in ip.islands], list(range(len(ip.islands)))


def _node_share(plan: ParallelPlan, s: int) -> int:
    """How many of pipeline 0's stages share stage s's node (their outer rings then share its link)."""
    nodes = place_nodes(plan)
    return sum(1 for row in nodes if row[0] == nodes[s][0])


def outer_sync_s(ip: IslandPlan, sm: SimModel) -> float:
    """Seconds of one outer step (one fragment's): the slowest shard's ring among the islands, plus the
    slowest island's broadcast of its outer state to its other replicas."""
    plan0, sync = ip.islands[0], ip.sync
    ring = share = 0.0
    for s, st in enumerate(plan0.stages):
        tp = st.replicas[0].tp
        params = sm.stage_params(tp, st.first_layer, st.last_layer) / sync.fragments
        if len(ip.islands) > 1:
            reps, nodes = _ring_members(ip, s)
            t = sm.allreduce_time_s(reps, nodes, [params * sync.bytes_per_element])
            ring = max(ring, t * max(_node_share(p, s) for p in ip.islands))
        banks = 2 if sync.momentum > 0 else 1
        for p in ip.islands:
            reps = list(p.stages[s].replicas)
            if len(reps) > 1:  # a broadcast moves the bytes once; a ring all-reduce twice
                share = max(share, sm.allreduce_time_s(reps, place_nodes(p)[s], params * OUTER_FP32_BYTES * banks) / 2)
    return ring + share


def _outer_egress(ip: IslandPlan, sm: SimModel) -> tuple[float, float]:
    """(egress USD, bytes across regions) of one whole-model outer all-reduce (every fragment once)."""
    usd = cross = 0.0
    n = len(ip.islands)
    if n < 2:
        return 0.0, 0.0
    for s, st in enumerate(ip.islands[0].stages):
        tp = st.replicas[0].tp
        nbytes = sm.stage_params(tp, st.first_layer, st.last_layer) * ip.sync.bytes_per_element * tp
        reps, _ = _ring_members(ip, s)
        order = sorted(range(n), key=lambda i: (reps[i].region, reps[i].zone))
        for k in range(n):
            a, b = reps[order[k]], reps[order[(k + 1) % n]]
            moved = 2 * (n - 1) / n * nbytes
            if a.zone != b.zone:
                usd += moved / C.BYTES_PER_GB * sm.book.egress_usd_per_gb(a.zone, b.zone)
            if a.region != b.region:
                cross += moved
    return usd, cross


def _island_cross_region_bytes(plan: ParallelPlan, sm: SimModel) -> float:
    """Bytes one step of an island moves across regions: its gradient rings' and pipeline messages' hops."""
    out = 0.0
    for s, st in enumerate(plan.stages):
        reps = sorted(st.replicas, key=lambda r: (r.region, r.zone))
        d = len(reps)
        grads = sm.stage_params(reps[0].tp, st.first_layer, st.last_layer) * C.FP32_GRAD_BYTES * reps[0].tp
        for k in range(d if d > 1 else 0):
            if reps[k].region != reps[(k + 1) % d].region:
                out += 2 * (d - 1) / d * grads
        if s + 1 < len(plan.stages):
            for j, pb in enumerate(plan.pipelines):
                a, b = st.replicas[j], plan.stages[s + 1].replicas[j]
                if a.region != b.region:
                    out += 2 * sm.boundary_elems(1, st.last_layer) * pb.samples * C.FP32_BYTES
    return out


def simulate_islands(ip: IslandPlan, book: ProfileBook, *, options: SimOptions | None = None) -> SemiSyncResult:
    """The plan's iteration, memory and cost (see the module's contract)."""
    sm = model_for(book)
    results = tuple(simulate(p, book, options=options) for p in ip.islands)
    inner = max(r.iteration_time_s for r in results)
    outer = outer_sync_s(ip, sm)
    exposed = ip.sync.fragments * outer / ip.sync.inner_steps
    iteration = inner + exposed
    extra, peak, fits = 0, 0, True
    banks = 2 if ip.sync.momentum > 0 else 1
    for p, r in zip(ip.islands, results, strict=True):
        for row in r.per_stage:
            st = p.stages[row.stage]
            held = sm.stage_params(row.tp, st.first_layer, st.last_layer) * OUTER_FP32_BYTES * banks
            extra = max(extra, held)
            peak = max(peak, row.peak_memory_bytes + held)
            fits = fits and row.peak_memory_bytes + held <= row.capacity_bytes
    compute_usd = sum(r.compute_usd_per_iteration / r.iteration_time_s for r in results) * iteration
    outer_usd, outer_cross = _outer_egress(ip, sm)
    egress = sum(r.egress_usd_per_iteration for r in results) + outer_usd / ip.sync.inner_steps
    usd = compute_usd + egress
    samples = ip.global_batch_size
    tokens = samples * book.model.sequence_length
    cross = sum(_island_cross_region_bytes(p, sm) for p in ip.islands) + outer_cross / ip.sync.inner_steps
    return SemiSyncResult(
        iteration_time_s=iteration, inner_step_s=inner, outer_sync_s=outer, outer_exposed_s=exposed, islands=results,
        peak_memory_bytes=peak, fits_memory=fits, outer_state_bytes=extra,
        throughput_iterations_per_s=1.0 / iteration, samples_per_s=samples / iteration, tokens_per_s=tokens / iteration,
        usd_per_iteration=usd, usd_per_hour=usd / iteration * C.SECONDS_PER_HOUR,
        usd_per_million_tokens=usd / tokens * 1e6,
        egress_usd_per_iteration=egress, compute_usd_per_iteration=compute_usd,
        cross_region_bytes_per_token=cross / tokens, num_gpus=ip.num_gpus, inner_steps=ip.sync.inner_steps,
    )


def cross_region_bytes_per_token(plan: ParallelPlan, book: ProfileBook) -> float:
    """What a synchronous plan moves across regions per token (the same count as `simulate_islands`')."""
    return _island_cross_region_bytes(plan, model_for(book)) / (plan.global_batch_size * book.model.sequence_length)
