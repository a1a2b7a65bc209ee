"""The simulator: iteration time, peak memory and cost of a heterogeneous, geo-distributed plan.

Contract: `simulate(plan, book, options=None) -> SimulationResult` is a pure function. The planner
calls the same stage-level building blocks through `model_for(book)` (a memoised `SimModel`), so
every estimate in the project comes from one model. See docs/simulator.md.
"""

from sailor_core.errors import PlanInvalidError
from sailor_core.simulator.core import (
    dp_sync_end_s,
    pipeline_time_s,
    place_nodes,
    simulate,
    simulate_valid,
)
from sailor_core.simulator.model import SimModel, StageCompute, StageMemory, model_for
from sailor_core.simulator.result import Breakdown, ReplicaResult, ReplicaRow, SimOptions, SimulationResult

__all__ = [
    "Breakdown",
    "PlanInvalidError",
    "ReplicaResult",
    "ReplicaRow",
    "SimModel",
    "SimOptions",
    "SimulationResult",
    "StageCompute",
    "StageMemory",
    "dp_sync_end_s",
    "model_for",
    "pipeline_time_s",
    "place_nodes",
    "simulate",
    "simulate_valid",
]
