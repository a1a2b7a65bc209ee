"""The table of passes one request runs after the single-kind search, each with when it runs and what it adds.

Contract: `PASSES` is the ordered table; `run_passes(ctx)` runs, in order, every pass whose condition
holds for the request, while the search's time budget lasts, and returns what they found as values
(`Found`: plans to verify, estimated points for the frontier) with the names of the passes run and of
those the budget left out. No pass mutates another's state: each reads the `Context` (the request,
the pool's slots, the single-kind search and its candidates) and returns its own findings.

    pass                      runs when                                            adds
    second pipeline group     max throughput, or a minimum it/s                    plans with a second pipeline
                                                                                   kind on the GPUs the best
                                                                                   plans leave idle (mixed.py)
    pipeline kinds            max throughput and several GPU types                 plans of up to max_shapes
                                                                                   pipeline kinds chosen
                                                                                   together (groups.py)
    replicas across regions   a GPU type in several regions and one of the best    plans whose stages hold
                              plans' pipelines crosses regions                     replicas in several regions
    frontier ends             --wide-frontier (or --frontier-png)                  the unconstrained fastest
                                                                                   and cheapest points

The whole table runs again with activation recomputation when nothing fits in memory without it
(`core.plan`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from sailor_core.domain import ParallelPlan, ResourcePool
from sailor_core.planner.costs import SimCosts
from sailor_core.planner.groups import group_plans
from sailor_core.planner.mixed import mixed_plans
from sailor_core.planner.request import Constraints, Objective, PlanRequest
from sailor_core.planner.search import Search
from sailor_core.planner.slots import Slot, build_slots, spans_regions
from sailor_core.planner.space import Candidate, Point
from sailor_core.planner.verify import goodput_wanted, materialize

# The best plans checked for pipelines that cross regions (as many as get a second group: mixed_pipelines' default).
BASES_ACROSS_REGIONS = 4


@dataclass(frozen=True)
class Context:
    """What every pass reads: the request, its usable pool and slots, the single-kind search and its
    candidates (best first), and when the search's time budget ends (perf_counter seconds; inf: never)."""

    request: PlanRequest
    pool: ResourcePool
    slots: tuple[Slot, ...]
    costs: SimCosts
    search: Search
    candidates: tuple[Candidate, ...]
    deadline: float = math.inf

    @property
    def fastest_wanted(self) -> bool:
        return self.request.objective is Objective.MAX_THROUGHPUT

    def plans_of(self, cands: Sequence[Candidate], slots: Sequence[Slot]) -> list[ParallelPlan]:
        opts = self.request.options
        return [materialize(c.sketch, c.estimate.layouts, slots, model=self.request.model,
                            global_batch_size=self.request.global_batch_size, precision=opts.precision,
                            schedule=opts.schedule) for c in cands]


@dataclass(frozen=True)
class Found:
    """What a pass adds: plans for the verification, estimated points for the frontier."""

    plans: tuple[ParallelPlan, ...] = ()
    points: tuple[Point, ...] = ()


@dataclass(frozen=True)
class Pass:
    name: str
    when: Callable[[Context], bool]
    run: Callable[[Context], Found]


def _bases(ctx: Context) -> list[Candidate]:
    """The plans a second group joins: the `mixed_pipelines` best, then the best of each set of GPU types
    among the candidates (GPUs added to a pool must not push out of the bases the plans that never used
    them: a new type's plans would take every place)."""
    n = ctx.request.options.mixed_pipelines
    out = list(ctx.candidates[:n])
    types = {c: frozenset(ctx.slots[si].gpu_type for si, _ in c.sketch.kinds) for c in ctx.candidates}
    for t in dict.fromkeys(types.values()):
        room = n - sum(types[c] == t for c in out)
        out += [c for c in ctx.candidates if types[c] == t and c not in out][: max(0, room)]
    return out


def _second_group(ctx: Context) -> Found:
    """A second pipeline group on the GPUs each of the best plans leaves idle."""
    r, opts = ctx.request, ctx.request.options
    return Found(plans=tuple(mixed_plans(
        ctx.search, _bases(ctx), model=r.model, global_batch_size=r.global_batch_size,
        precision=opts.precision, schedule=opts.schedule,
        own_microbatch=opts.per_pipeline_microbatches and ctx.fastest_wanted)))


def _pipeline_kinds(ctx: Context) -> Found:
    """Pipelines of several kinds chosen together on the whole pool."""
    r, opts = ctx.request, ctx.request.options
    return Found(plans=tuple(group_plans(
        ctx.search, ctx.candidates, model=r.model, global_batch_size=r.global_batch_size, precision=opts.precision,
        schedule=opts.schedule, max_groups=opts.max_shapes, own_microbatch=opts.per_pipeline_microbatches)))


def _across_regions(ctx: Context) -> Found:
    """The search again with each GPU type's regions pooled in one slot (`build_slots(pool_regions=True)`):
    plans whose stages hold data-parallel replicas in several regions. A pipeline that fills every GPU of
    two one-GPU regions leaves the per-region search no room for the other shape, data parallelism across
    them, which wins when the ring over the link costs less than the pipeline's sends and bubble. It starts
    from the per-region search's best score, so its bounds prune against that from the first sketch on
    (on 8 + 8 A100-40 in two regions it adds about 0.07 s to a 0.13 s plan)."""
    wide = build_slots(ctx.pool, pool_markets=not goodput_wanted(ctx.request), pool_regions=True)
    search = Search(replace(ctx.search.problem, slots=wide), ctx.costs, incumbent=ctx.search.state.incumbent,
                    deadline=ctx.deadline)
    return Found(plans=tuple(ctx.plans_of(search.run(), wide)))


def _crosses_regions(ctx: Context) -> bool:
    """Whether one of the best plans has its pipelines' stages in different regions (each slot is one region)."""
    return any(len({ctx.slots[si].region for si, _ in c.sketch.kinds}) > 1
               for c in ctx.candidates[:BASES_ACROSS_REGIONS])


def _frontier_ends(ctx: Context) -> Found:
    """The other objective's search without limits: the frontier's far end (both ends when limited)."""
    r = ctx.request
    unconstrained = r.constraints == Constraints()
    points: list[Point] = []
    for other in (Objective.MAX_THROUGHPUT, Objective.MIN_COST):
        if unconstrained and (other is r.objective or (
                other is Objective.MIN_COST and r.objective is Objective.MIN_COST_PER_TOKEN)):
            continue  # the main search already covers this end
        wide = Search(replace(ctx.search.problem, objective=other, constraints=Constraints()), ctx.costs,
                      shared=ctx.search, deadline=ctx.deadline)
        wide.run()
        points += wide.state.points
    return Found(points=tuple(points))


PASSES: tuple[Pass, ...] = (
    Pass("second pipeline group",
         lambda c: bool(c.request.options.mixed_pipelines and c.candidates
                        and (c.fastest_wanted or c.request.constraints.min_iterations_per_s is not None)),
         _second_group),
    Pass("pipeline kinds",
         lambda c: bool(c.request.options.max_shapes >= 2 and c.candidates and c.fastest_wanted
                        and len({s.gpu_type for s in c.slots}) > 1),
         _pipeline_kinds),
    Pass("replicas across regions",
         lambda c: bool(c.request.options.replicas_across_regions and _crosses_regions(c) and spans_regions(c.pool)),
         _across_regions),
    Pass("frontier ends", lambda c: bool(c.request.options.wide_frontier and c.slots), _frontier_ends),
)


@dataclass(frozen=True)
class Passes:
    """What the passes found, which ran and which the time budget left out."""

    found: tuple[Found, ...]
    ran: tuple[str, ...]
    skipped: tuple[str, ...]

    @property
    def plans(self) -> list[ParallelPlan]:
        return [p for f in self.found for p in f.plans]

    @property
    def points(self) -> list[Point]:
        return [p for f in self.found for p in f.points]


def run_passes(ctx: Context, passes: Sequence[Pass] = PASSES) -> Passes:
    """Every pass whose condition holds, in order, while the budget lasts."""
    found, ran, skipped = [], [], []
    for p in passes:
        if not p.when(ctx):
            continue
        if time.perf_counter() >= ctx.deadline:
            skipped.append(p.name)
            continue
        found.append(p.run(ctx))
        ran.append(p.name)
    return Passes(found=tuple(found), ran=tuple(ran), skipped=tuple(skipped))
