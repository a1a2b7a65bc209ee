"""The score step: what "better" means for a request, in one place.

Contract: pure functions of numbers. `score` is the objective's value of a plan (lower is
better) and `secondary` the other goal that decides among plans within the tolerance; the search
(on estimates), the verification (on simulated results, `core.objective_value`) and the
brute-force oracle all call these two. The constraint gap (how far past the limits) is
`Constraints.gap` (request.py), beside the limits it measures. `Goal` binds them to one
request for the search: the score and gap of an `Estimate`, the tolerance cutoff, and the score
floor its bounds compare against that cutoff.

Where a new objective goes: a member of `request.Objective`, a branch in `score` and in
`secondary`, and, if it is neither time nor money, a floor in `Goal.floor` that never exceeds
`score` of anything the bound covers (the bounds prune on it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sailor_core.planner.request import Constraints, Objective
from sailor_core.planner.space import Estimate, Problem

SECONDS_PER_HOUR = 3600.0


def score(objective: Objective, *, iteration_s: float, usd_per_iteration: float, usd_per_million_tokens: float,
          useful_fraction: float = 1.0) -> float:
    """The objective's value of a plan; lower is better. `useful_fraction`: the expected share of wall
    time that trains (risk.py), which max-goodput divides the cost by."""
    if objective is Objective.MAX_THROUGHPUT:
        return iteration_s
    if objective is Objective.MIN_COST:
        return usd_per_iteration
    if objective is Objective.MAX_GOODPUT:
        return usd_per_iteration / useful_fraction if useful_fraction > 0 else math.inf
    return usd_per_million_tokens


def secondary(objective: Objective, *, iteration_s: float, usd_per_iteration: float,
              useful_fraction: float = 1.0) -> float:
    """The other goal, deciding among plans whose scores are within the tolerance: cost under max
    throughput, time under the cost objectives (expected time per useful iteration under goodput)."""
    if objective is Objective.MAX_THROUGHPUT:
        return usd_per_iteration
    if objective is Objective.MAX_GOODPUT:
        return iteration_s / useful_fraction if useful_fraction > 0 else math.inf
    return iteration_s


@dataclass(frozen=True)
class Goal:
    """One request's objective, limits and tolerance, as the search applies them to estimates."""

    objective: Objective
    constraints: Constraints
    tolerance: float
    tokens_per_iteration: int

    @classmethod
    def of_problem(cls, pb: Problem) -> Goal:
        return cls(pb.objective, pb.constraints, pb.tolerance, pb.tokens_per_iteration)

    @property
    def speed_first(self) -> bool:
        """Whether the objective is time (else money): the DP's and the front's primary key."""
        return self.objective is Objective.MAX_THROUGHPUT

    @property
    def coupled(self) -> bool:
        """A limit that couples time and money (a budget under max throughput, a minimum speed under a
        cost objective): the answer may sit between the two keys' optima."""
        c = self.constraints
        if self.speed_first:
            return c.max_usd_per_iteration is not None or c.max_usd_per_hour is not None
        return c.min_iterations_per_s is not None

    def of(self, e: Estimate) -> float:
        return score(self.objective, iteration_s=e.iteration_s, usd_per_iteration=e.usd_per_iteration,
                     usd_per_million_tokens=e.usd_per_iteration / self.tokens_per_iteration * 1e6,
                     useful_fraction=e.useful_fraction)

    def other(self, e: Estimate) -> float:
        return secondary(self.objective, iteration_s=e.iteration_s, usd_per_iteration=e.usd_per_iteration,
                         useful_fraction=e.useful_fraction)

    def gap(self, e: Estimate) -> float:
        """How far the estimate is past the limits (relative; 0 when within)."""
        return self.constraints.gap(usd_per_iteration=e.usd_per_iteration, usd_per_hour=e.usd_per_hour,
                                    iterations_per_s=e.iterations_per_s)

    def why_not(self, e: Estimate) -> str:
        """The limits the estimate breaks, in words."""
        return "; ".join(self.constraints.violations(usd_per_iteration=e.usd_per_iteration,
                                                     usd_per_hour=e.usd_per_hour, iterations_per_s=e.iterations_per_s))

    def usd_within(self, cutoff: float) -> float:
        """Cost objectives: the USD per iteration below which a plan's score may be under `cutoff` (a score
        is at least its USD per iteration, or per million tokens: max-goodput divides by at most 1)."""
        if self.objective is Objective.MIN_COST_PER_TOKEN:
            return cutoff * self.tokens_per_iteration / 1e6
        return cutoff

    def cutoff(self, incumbent: float) -> float:
        """Scores at or above this cannot be chosen: worse than the incumbent by more than the tolerance."""
        return incumbent * (1 + self.tolerance)

    def floor(self, t: float, d: int, usd_per_pipeline_hour: float, *, budget: bool, work_usd: float = 0.0) -> float:
        """The score floor of an iteration of at least t seconds on D pipelines that cost at least this
        per hour each, and at least `work_usd` in all (max-goodput: its cost, the useful fraction being
        at most 1); infinite when it is too slow for the minimum speed (2% slack: t is a bound, the
        estimate's time is not) or, with `budget`, dearer than the per-iteration budget (2% slack too)."""
        cons = self.constraints
        if cons.min_iterations_per_s is not None and 1.0 / t < cons.min_iterations_per_s * 0.98:
            return math.inf
        if self.objective is Objective.MAX_THROUGHPUT:
            return t
        usd = max(t * d * usd_per_pipeline_hour / SECONDS_PER_HOUR, work_usd)
        if budget and cons.max_usd_per_iteration is not None and usd > cons.max_usd_per_iteration * 1.02:
            return math.inf
        return score(self.objective, iteration_s=t, usd_per_iteration=usd,
                     usd_per_million_tokens=usd / self.tokens_per_iteration * 1e6)
