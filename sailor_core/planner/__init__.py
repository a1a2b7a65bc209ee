"""The planner: which GPUs to rent, where, and how to split the model, under throughput and cost goals.

Contract: `plan(request, book) -> PlanResult` is a pure, deterministic search over (resource
allocation x parallel plan) scored by the simulator's own building blocks and verified with the
full `simulate()`; it never returns a plan that does not fit in memory or breaks a constraint,
and explains the nearest miss when nothing is feasible. Pool files and what-if variations are
parsed by `pool`. See docs/planner.md.
"""

from sailor_core.errors import PoolFileError
from sailor_core.planner.core import plan
from sailor_core.planner.explain import summarize
from sailor_core.planner.pool import apply_what_if, load_pool_file, parse_pool, pool_to_dict
from sailor_core.planner.request import (
    Constraints,
    FrontierPoint,
    Objective,
    PlanRequest,
    PlanResult,
    Restrictions,
    SearchOptions,
    SearchStats,
)
from sailor_core.planner.slots import build_slots
from sailor_core.planner.verify import materialize

__all__ = [
    "Constraints",
    "FrontierPoint",
    "Objective",
    "PlanRequest",
    "PlanResult",
    "PoolFileError",
    "Restrictions",
    "SearchOptions",
    "SearchStats",
    "apply_what_if",
    "build_slots",
    "load_pool_file",
    "materialize",
    "parse_pool",
    "plan",
    "pool_to_dict",
    "summarize",
]
