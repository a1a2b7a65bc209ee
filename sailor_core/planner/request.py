"""What a planning request asks for, and what the planner answers.

Contract: frozen, keyword-only dataclasses validated on construction. `PlanRequest` names the
model, the global batch, the resource pool, one objective and any constraints and restrictions.
`PlanResult` always comes back (never an exception for an infeasible request): `plan` is None
exactly when nothing feasible exists, and then `nearest_miss` says what came closest and why it
failed. No I/O here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from sailor_core.domain import Capacity, Market, ParallelPlan, ResourcePool
from sailor_core.errors import ValidationError
from sailor_core.planner.risk import Goodput, SpotRisk
from sailor_core.simulator.result import SimulationResult


class Objective(enum.StrEnum):
    MAX_THROUGHPUT = "max-throughput"
    MIN_COST = "min-cost"  # USD per iteration
    MIN_COST_PER_TOKEN = "min-cost-per-token"  # USD per million tokens
    MAX_GOODPUT = "max-goodput"  # expected useful iterations per USD, spot preemptions priced in (risk.py)

    @classmethod
    def parse(cls, value: str | Objective) -> Objective:
        try:
            return cls(str(value).lower().replace("_", "-"))
        except ValueError:
            raise ValidationError(
                f"unknown objective {value!r}; to fix: use one of {', '.join(o.value for o in cls)}"
            ) from None


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """Limits every returned plan must meet under the simulator (None: no limit)."""

    max_usd_per_iteration: float | None = None
    max_usd_per_hour: float | None = None
    min_iterations_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_usd_per_iteration", "max_usd_per_hour", "min_iterations_per_s"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValidationError(f"constraint {name} must be a positive number, got {v!r}")

    def _limits(self, usd_per_iteration: float, usd_per_hour: float, iterations_per_s: float
                ) -> list[tuple[float, float, bool, str]]:
        """(what the plan uses, the limit, whether the limit is a minimum, how to say it broken) of each
        limit set: the one table `gap` and `violations` read, so they never disagree on what a limit is."""
        out = []
        if self.max_usd_per_iteration is not None:
            out.append((usd_per_iteration, self.max_usd_per_iteration, False,
                        "costs {used:.4f} USD/iteration > limit {limit:g}"))
        if self.max_usd_per_hour is not None:
            out.append((usd_per_hour, self.max_usd_per_hour, False, "costs {used:.2f} USD/hour > limit {limit:g}"))
        if self.min_iterations_per_s is not None:
            out.append((iterations_per_s, self.min_iterations_per_s, True,
                        "runs {used:.4f} iterations/s < minimum {limit:g}"))
        return out

    def gap(self, *, usd_per_iteration: float, usd_per_hour: float, iterations_per_s: float) -> float:
        """How far past the limits a plan is: the largest relative excess (0 when within every one).
        The one measure of "how close" that the search's pruning, its nearest miss and the verification use."""
        g = 0.0
        for used, limit, minimum, _ in self._limits(usd_per_iteration, usd_per_hour, iterations_per_s):
            g = max(g, limit / used - 1 if minimum else used / limit - 1)
        return g

    def violations(self, *, usd_per_iteration: float, usd_per_hour: float, iterations_per_s: float) -> list[str]:
        """One line per limit the plan breaks (beyond rounding), in the order the limits are listed."""
        return [
            why.format(used=used, limit=limit)
            for used, limit, minimum, why in self._limits(usd_per_iteration, usd_per_hour, iterations_per_s)
            if (used < limit * (1 - 1e-9) if minimum else used > limit * (1 + 1e-9))
        ]


@dataclass(frozen=True, kw_only=True)
class Restrictions:
    """Which parts of the pool the plan may use (empty tuple: no restriction)."""

    clouds: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()
    zones: tuple[str, ...] = ()
    gpu_types: tuple[str, ...] = ()
    markets: tuple[Market, ...] = ()
    max_gpus: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "markets", tuple(Market.parse(m) for m in self.markets))
        if self.max_gpus is not None and self.max_gpus < 1:
            raise ValidationError(f"max_gpus must be >= 1, got {self.max_gpus}")

    def allows(self, e: Capacity) -> bool:
        return (
            (not self.clouds or e.cloud in self.clouds)
            and (not self.regions or e.region in self.regions)
            and (not self.zones or e.zone in self.zones)
            and (not self.gpu_types or e.gpu_type in self.gpu_types)
            and (not self.markets or e.market in self.markets)
        )

    def apply(self, pool: ResourcePool) -> ResourcePool:
        return ResourcePool(entries=tuple(e for e in pool.entries if self.allows(e) and e.gpus > 0))


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """Knobs of the search (defaults are what the benchmarks measured)."""

    max_stages: int = 26  # capped by the model's layer count
    # Fewest pipeline stages a plan may have (`sailor plan --stages 2-4`: 2 and 4; equal: exactly that many).
    min_stages: int = 1
    # Enumerate every contiguous partition when a stage count has at most this many (exact on
    # small models); beyond it, uniform and profile-balanced partitions only.
    exhaustive_partitions_up_to: int = 64
    # Candidates re-scored with the full simulator before the final choice.
    rescore_top: int = 24
    # Stop adding pipeline stages after this many stage counts in a row whose best plan is more
    # than 5% worse than the best so far (0: search every stage count).
    patience: int = 4
    # Best single-shape plans that get a second pipeline group on their idle GPUs (0: off).
    mixed_pipelines: int = 4
    # A second pipeline group may run its own microbatch size (False: the first group's size only).
    per_pipeline_microbatches: bool = True
    # Pipeline kinds per plan chosen jointly on the whole pool (groups.py): up to this many replica
    # shapes per stage (1: off; 2: the two-shape space).
    max_shapes: int = 4
    # Where one GPU type is offered in several regions, also search with its regions pooled, so a
    # stage's data-parallel replicas may span regions (per-region slots keep each stage in one region).
    replicas_across_regions: bool = True
    # Also search the other objective (unconstrained) so the frontier spans cheapest to fastest;
    # about doubles the search time. The CLI turns it on for --frontier-png and --wide-frontier.
    wide_frontier: bool = False
    frontier_points: int = 24
    # The search keeps candidates within this (relative) of its best estimate for the simulator to decide
    # between; the plan returned is the best on the objective, and the explanation names a plan within this
    # of it that is better on the other goal (cheaper under max throughput, faster under the cost objectives).
    tolerance: float = 0.005
    precision: str = "fp32"
    schedule: str = "1f1b"
    # Activation recomputation (a stage's blocks keep only their input and run their forward again in
    # backward): "auto" only when no plan fits in memory without it, and then on the stages that do not
    # fit without it; "never"; "always" (every stage).
    recompute: str = "auto"
    # Time budget of one plan (seconds; None: none). The search stops when it ends, keeps what it found
    # and proves a gap (`SearchStats.gap`); the flow's replans set one so recovery never waits on a search.
    max_search_s: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_stages <= self.max_stages:
            raise ValidationError(f"pipeline stages must satisfy 1 <= min_stages <= max_stages, got "
                                  f"min_stages {self.min_stages}, max_stages {self.max_stages}")
        if self.max_search_s is not None and not (0 < self.max_search_s <= MAX_SEARCH_S):
            raise ValidationError(f"max_search_s must be from 0 to {MAX_SEARCH_S:g} seconds, got "
                                  f"{self.max_search_s!r}; to fix: pass e.g. --max-search-s 5")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValidationError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}; "
                                  f"to fix: pass --recompute auto, never or always")


RECOMPUTE_MODES = ("auto", "never", "always")
MAX_SEARCH_S = 3600.0  # the longest time budget a plan may ask for


def stage_range(spec: str) -> tuple[int, int]:
    """(min, max) pipeline stages of a `--stages` value: `N` (exactly N) or `A-B` (A to B stages)."""
    lo, sep, hi = spec.strip().partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValidationError(f"--stages must be a number of pipeline stages or a range like 2-4, got {spec!r}; "
                              f"to fix: pass e.g. --stages 2 or --stages 2-4") from None
    if not 1 <= a <= b:
        raise ValidationError(f"--stages {spec!r} is not a range of at least 1 stage; to fix: pass e.g. --stages 2 "
                              f"or --stages 2-4 (low end first)")
    return a, b


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: str
    global_batch_size: int
    pool: ResourcePool
    objective: Objective = Objective.MAX_THROUGHPUT
    constraints: Constraints = field(default_factory=Constraints)
    restrictions: Restrictions = field(default_factory=Restrictions)
    options: SearchOptions = field(default_factory=SearchOptions)
    # Preemption rates, reconfiguration time and checkpoint interval: what max-goodput optimises, and
    # what every answer's expected throughput is computed with (rates 0: expected = nominal).
    spot_risk: SpotRisk = field(default_factory=SpotRisk)

    def __post_init__(self) -> None:
        object.__setattr__(self, "objective", Objective.parse(self.objective))
        if self.global_batch_size < 1:
            raise ValidationError(f"global_batch_size must be >= 1, got {self.global_batch_size}")


@dataclass(frozen=True, kw_only=True)
class FrontierPoint:
    """One plan on the throughput/cost Pareto frontier, as scored by the simulator."""

    iterations_per_s: float
    usd_per_iteration: float
    usd_per_hour: float
    num_gpus: int
    summary: str
    plan: ParallelPlan
    chosen: bool = False  # the plan the planner returned

    def to_json(self) -> dict[str, Any]:
        return {
            "iterations_per_s": self.iterations_per_s,
            "usd_per_iteration": self.usd_per_iteration,
            "usd_per_hour": self.usd_per_hour,
            "num_gpus": self.num_gpus,
            "summary": self.summary,
            "chosen": self.chosen,
        }


@dataclass(frozen=True, kw_only=True)
class SearchStats:
    search_time_s: float
    configurations: int  # (mbs, stages, partition) combinations considered
    assignments: int  # stage-to-GPU assignments solved
    candidates: int  # complete plans estimated
    simulated: int  # plans scored with the full simulator
    pruned: int  # configurations skipped by a bound
    # How much better on the objective a one-kind plan of what the time budget left unsearched could be than
    # the one returned (relative, proven by lower bounds): 0.0 when the whole single-kind space was covered or
    # ruled out; None when no plan was found to compare with. Passes the budget skipped are in `skipped`.
    gap: float | None = 0.0
    passes: tuple[str, ...] = ()  # the passes of `passes.PASSES` that ran after the single-kind search
    skipped: tuple[str, ...] = ()  # those the time budget left out

    @property
    def optimal(self) -> bool:
        """Whether every plan of the searched space was covered or ruled out by its bound."""
        return self.gap == 0.0 and not self.skipped

    def to_json(self) -> dict[str, Any]:
        return {
            "search_time_s": self.search_time_s,
            "configurations": self.configurations,
            "assignments": self.assignments,
            "candidates": self.candidates,
            "simulated": self.simulated,
            "pruned": self.pruned,
            "gap": self.gap,
            "optimal": self.optimal,
            "passes": list(self.passes),
            "skipped": list(self.skipped),
        }


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    plan: ParallelPlan | None
    estimate: SimulationResult | None  # the simulator's answer for `plan` (None when infeasible)
    frontier: tuple[FrontierPoint, ...]
    stats: SearchStats
    explanation: str
    nearest_miss: str = ""
    goodput: Goodput | None = None  # the plan's nominal and expected throughput under the request's spot risk
    # no plan because no GPU type of the pool has a profile for the model: these need one (input to fix,
    # not an infeasible request; nearest_miss names the command for each)
    unprofiled: tuple[str, ...] = ()

    @property
    def feasible(self) -> bool:
        return self.plan is not None
