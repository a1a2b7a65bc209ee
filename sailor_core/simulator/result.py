"""Options and results of one simulation.

Contract: frozen dataclasses; `SimulationResult.to_json()` returns a JSON-compatible dict with the
keys the CLI documents (iteration_time_s, throughput_iterations_per_s, tokens_per_s,
peak_memory_bytes, fits_memory, usd_per_iteration, breakdown, per_stage, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from sailor_core.domain import Market, Replica
from sailor_core.simulator.model import StageCompute, StageMemory


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    """Knobs of one simulation. `None` means: take it from the plan.

    `prices_usd_per_gpu_hour` overrides the book's prices per (zone, gpu_type, market); the planner
    passes its pool's prices here. `overlap_dp_sync`: a stage starts its gradient all-reduce as
    soon as its own last backward is done (DeepSpeed/Megatron reduce per stage group), so later
    stages' reductions hide behind earlier stages' backward tail; False serialises them after the
    whole pipeline. `runtime`: whose communication the plan runs with (docs/simulator.md):
    "sailor" (this project's runtime, sailor_core/runtime/engine.py: batched point-to-point
    exchanges of one message in slices per receiving TP rank, gradient buckets of 25 MiB launched
    during the last backward) or "deepspeed" (the Sailor artifact's framework that ran the published
    runs: blocking sends of one slice per TP rank, 5e8-byte buckets reduced after the stage's backward).
    """

    schedule: str | None = None
    precision: str | None = None
    zero1: bool | None = None
    prices_usd_per_gpu_hour: Mapping[tuple[str, str, Market], float] | None = None
    overlap_dp_sync: bool = True
    runtime: str = "sailor"


@dataclass(frozen=True, kw_only=True)
class ReplicaResult:
    """One (stage, replica) of the plan: its compute and its peak memory per GPU."""

    stage: int
    replica: int
    gpu_type: str
    zone: str
    tp: int
    microbatch_size: int
    num_microbatches: int
    forward_s: float  # per microbatch
    backward_s: float  # per microbatch
    compute_s: float  # all microbatches of this iteration
    optimizer_s: float
    dp_sync_s: float  # all-reduce of this stage's gradients (the stage's ring, shared by its replicas)
    in_flight_microbatches: int
    memory: StageMemory
    peak_memory_bytes: int
    capacity_bytes: int
    fits: bool
    bytes_over: int


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    """Where the iteration's seconds go; the four top terms add up to the iteration time.

    pipeline_compute_s and pipeline_p2p_s are the compute and send/receive on the critical path
    of the slowest pipeline (bubbles included); dp_sync_exposed_s is the part of the data-parallel
    gradient reduction not hidden behind the pipeline; optimizer_s the step.
    """

    pipeline_compute_s: float
    pipeline_p2p_s: float
    dp_sync_exposed_s: float
    optimizer_s: float
    dp_sync_per_stage_s: tuple[float, ...]
    pipeline_time_per_pipeline_s: tuple[float, ...]
    bubble_s: float
    slowest_pipeline: int


# Compact per-(stage, replica) record the simulator fills in; `SimulationResult.per_stage` expands
# it into ReplicaResult objects on first use (a planner scoring thousands of plans never pays for it):
# (stage, replica, Replica, mbs, microbatches, StageCompute, optimizer_s, dp_sync_s, in_flight,
#  StageMemory, capacity_bytes)
ReplicaRow = tuple[int, int, Replica, int, int, StageCompute, float, float, int, StageMemory, int]


@dataclass(frozen=True, kw_only=True)
class SimulationResult:
    """Everything one simulation found. `per_stage` has one entry per (stage, replica)."""

    iteration_time_s: float
    breakdown: Breakdown
    rows: tuple[ReplicaRow, ...] = field(repr=False, compare=False)
    peak_memory_bytes: int
    fits_memory: bool
    throughput_iterations_per_s: float
    samples_per_s: float
    tokens_per_s: float
    usd_per_iteration: float
    usd_per_hour: float
    usd_per_million_tokens: float
    egress_usd_per_iteration: float
    compute_usd_per_iteration: float
    num_gpus: int
    schedule: str
    precision: str
    zero1: bool
    unpriced: tuple[tuple[str, str, str], ...] = field(default=())

    @property
    def per_stage(self) -> tuple[ReplicaResult, ...]:
        cached = self.__dict__.get("_per_stage")
        if cached is None:
            cached = tuple(
                ReplicaResult(
                    stage=s, replica=j, gpu_type=r.gpu_type, zone=r.zone, tp=r.tp,
                    microbatch_size=mbs, num_microbatches=m, forward_s=c.forward_s, backward_s=c.backward_s,
                    compute_s=c.total_s * m, optimizer_s=opt, dp_sync_s=ar, in_flight_microbatches=inf,
                    memory=mem, peak_memory_bytes=mem.total_bytes, capacity_bytes=cap,
                    fits=mem.total_bytes <= cap, bytes_over=max(0, mem.total_bytes - cap),
                )
                for (s, j, r, mbs, m, c, opt, ar, inf, mem, cap) in self.rows
            )
            object.__setattr__(self, "_per_stage", cached)
        return cached

    @property
    def oom(self) -> tuple[ReplicaResult, ...]:
        """The (stage, replica) entries that do not fit, worst first."""
        return tuple(sorted((r for r in self.per_stage if not r.fits), key=lambda r: -r.bytes_over))

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            **headline_json(self),
            "schedule": self.schedule,
            "precision": self.precision,
            "zero1": self.zero1,
            "unpriced": [list(u) for u in self.unpriced],
            "breakdown": {
                **{k: v for k, v in asdict(self.breakdown).items() if not isinstance(v, tuple)},
                "dp_sync_per_stage_s": list(self.breakdown.dp_sync_per_stage_s),
                "pipeline_time_per_pipeline_s": list(self.breakdown.pipeline_time_per_pipeline_s),
            },
            "per_stage": [],
            "oom": [
                {"stage": r.stage, "replica": r.replica, "bytes_over": r.bytes_over} for r in self.oom
            ],
        }
        for r in self.per_stage:
            row = {k: v for k, v in asdict(r).items() if k != "memory"}
            row["memory"] = {**asdict(r.memory), "total_bytes": r.memory.total_bytes}
            d["per_stage"].append(row)
        return d


# The top-level keys every simulation answer writes first (SimulationResult and the islands' SemiSyncResult)
HEADLINE_KEYS = (
    "iteration_time_s", "throughput_iterations_per_s", "samples_per_s", "tokens_per_s", "peak_memory_bytes",
    "fits_memory", "usd_per_iteration", "usd_per_hour", "usd_per_million_tokens", "egress_usd_per_iteration",
    "compute_usd_per_iteration", "num_gpus",
)


def headline_json(result: object) -> dict[str, Any]:
    """`HEADLINE_KEYS` of a simulation answer, in that order."""
    return {k: getattr(result, k) for k in HEADLINE_KEYS}
