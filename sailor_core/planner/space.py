"""The plan space the search walks: the problem it is asked, a plan before placement, and its estimate.

Contract: frozen value types only, no logic beyond derived properties. A `Problem` is one search's
input (the pool as slots, the profiled microbatch sizes and TPs, the goal, the knobs); a `Sketch`
is a plan before zones and nodes (microbatch size, stage bounds, per stage one (slot, TP) kind,
D pipelines, and how its replicas fill the zones); an `Estimate` is what the cost step says of a
placed sketch; a `Candidate` is a sketch with its estimate and score. Each step of the search
(shapes, assign, placement, estimate, scoring) takes and returns these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from sailor_core.planner.request import Constraints, Objective
from sailor_core.planner.risk import SpotRisk
from sailor_core.planner.slots import Layout, Slot

# How a sketch's replicas fill its slots' zones (`Sketch.placement`).
# STAGE_MAJOR: each stage fills its slot's zones in order on its own (a pipeline may cross zones);
# PIPELINE_MAJOR: zone by zone, as many whole pipelines as fit first (no cross-zone sends), the
# rest stage-major.
STAGE_MAJOR = 0
PIPELINE_MAJOR = 1


@dataclass(frozen=True, kw_only=True)
class Problem:
    num_layers: int
    global_batch_size: int
    tokens_per_sample: int
    slots: tuple[Slot, ...]
    mbs_values: tuple[int, ...]
    tp_values: tuple[int, ...]
    objective: Objective = Objective.MAX_THROUGHPUT
    constraints: Constraints = field(default_factory=Constraints)
    max_gpus: int | None = None
    max_stages: int = 26
    min_stages: int = 1
    exhaustive_partitions_up_to: int = 64
    keep: int = 24  # best candidates returned
    patience: int = 4  # stop adding stages after this many stage counts without a near-best plan (0: never)
    tp_options: int = 2  # per stage and slot, the DP tries the smallest TPs that meet tau, this many
    tau_step: float = 0.01  # bottleneck thresholds closer than this (relative) are swept as one
    # Lexicographic objectives: scores within this (relative) of the best are equally good, and the
    # other goal decides among them (cost under max throughput, speed under the cost objectives).
    tolerance: float = 0.005
    risk: SpotRisk | None = None  # spot preemptions: scores max-goodput, and every estimate's useful fraction

    @property
    def tokens_per_iteration(self) -> int:
        return self.global_batch_size * self.tokens_per_sample


@dataclass(frozen=True, order=True)
class Sketch:
    """A plan before zones and nodes: b, stage bounds, per-stage (slot index, tp), D."""

    mbs: int
    bounds: tuple[tuple[int, int], ...]
    kinds: tuple[tuple[int, int], ...]
    dp: int
    zone_rot: tuple[int, ...] = ()  # per slot: which of its zones is filled first (default: the largest)
    placement: int = STAGE_MAJOR  # STAGE_MAJOR or PIPELINE_MAJOR (see above)

    @property
    def num_stages(self) -> int:
        return len(self.bounds)


@dataclass(frozen=True, kw_only=True)
class Estimate:
    iteration_s: float
    usd_per_iteration: float
    usd_per_hour: float
    num_gpus: int
    layouts: tuple[Layout, ...]
    useful_fraction: float = 1.0  # expected share of wall time that trains, given spot preemptions (risk.py)

    @property
    def iterations_per_s(self) -> float:
        return 1.0 / self.iteration_s


class Point(NamedTuple):
    """An estimated plan's place on the throughput/cost plane (the frontier's raw material)."""

    iterations_per_s: float
    usd_per_iteration: float
    sketch: Sketch


@dataclass(frozen=True, kw_only=True)
class Candidate:
    sketch: Sketch
    estimate: Estimate
    score: float  # lower is better for the request's objective
