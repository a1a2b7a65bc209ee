"""Brute force over the planner's plan space, scored with the full simulator: the optimality yardstick.

Contract: `exhaustive_best(request, book, max_stages)` enumerates every sketch the planner's space
holds for small pools (every microbatch size, stage count up to `max_stages`, every contiguous
partition, every (slot, TP) per stage, every data-parallel degree that fits, every zone fill
start, stage-major or whole pipelines per zone first), materialises each, runs `simulate()` and
returns the best plan that fits in memory and meets the constraints, with its result and the
number of plans simulated. On pools of several zones and regions that includes every pipeline
that crosses zones or regions the planner's placement (`placement.place`, the public step both
use) can make: each stage on any slot of any region, each slot's zones filled from any of them,
stage by stage (a pipeline's stages in different zones) or whole pipelines per zone first; and,
where a GPU type is offered in several regions, the same over slots that pool its regions
(`build_slots(pool_regions=True)`), whose stages hold data-parallel replicas in several regions.
Activation recomputation is the planner's space too (`SearchOptions.recompute`): "never", plans as
they are; "always", every stage recomputing; "auto", the plans as they are when any of them fits in
memory, and otherwise each plan with its stages recomputing exactly where they do not fit without
(`verify.recomputed_as`), as the planner's second pass searches.
No pruning, no bounds: slow by design, for tests and benchmarks on pools of a few GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from itertools import combinations, product

from sailor_core.domain import ParallelPlan, PipelineBatch
from sailor_core.planner.costs import SimCosts
from sailor_core.planner.placement import place, place_in_turn, stages_of
from sailor_core.planner.request import PlanRequest
from sailor_core.planner.shapes import bounds_from_cuts
from sailor_core.planner.slots import Slot, build_slots, spans_regions
from sailor_core.planner.space import PIPELINE_MAJOR, STAGE_MAJOR, Sketch
from sailor_core.planner.verify import materialize, objective_value, recomputed_as, sim_options
from sailor_core.profiles import ProfileBook
from sailor_core.simulator import SimOptions, SimulationResult, simulate

Best = tuple[float, ParallelPlan, SimulationResult] | None


class _Judge:
    """Simulates plans as the planner's recompute mode has them and keeps the best (see the module):
    the best plan as it is, whether any plan as it is fits in memory, and (under "auto") the best plan
    recomputing where it must; `seen` is called with every plan simulated."""

    def __init__(self, request: PlanRequest, book: ProfileBook, so: SimOptions,
                 seen: Callable[[ParallelPlan, SimulationResult], None] | None = None) -> None:
        self.request, self.book, self.so, self.seen = request, book, so, seen
        self.mode = request.options.recompute
        self.auto = (SimCosts(book, precision=request.options.precision, recompute="auto")
                     if self.mode == "auto" else None)
        self.simulated = 0
        self.plain: Best = None
        self.plain_fits = False
        self.recomputing: Best = None

    def run(self, plan: ParallelPlan) -> SimulationResult:
        r = simulate(plan, self.book, options=self.so)
        self.simulated += 1
        if self.seen is not None:
            self.seen(plan, r)
        return r

    def __call__(self, plan: ParallelPlan) -> None:
        if self.mode == "always":
            plan = replace(plan, stages=tuple(replace(st, recompute=True) for st in plan.stages))
        r = self.run(plan)
        self.plain = _keep_best(self.plain, self.request, plan, r)
        self.plain_fits |= r.fits_memory
        if self.auto is None or self.plain_fits:
            return
        again = recomputed_as(plan, self.auto)
        if again != plan:
            self.recomputing = _keep_best(self.recomputing, self.request, again, self.run(again))

    def answer(self) -> tuple[ParallelPlan | None, SimulationResult | None, int]:
        """(the best plan, its result, how many plans were simulated)."""
        best = self.plain if self.plain_fits or self.mode != "auto" else self.recomputing
        if best is None:
            return None, None, self.simulated
        return best[1], best[2], self.simulated


def exhaustive_best(
    request: PlanRequest, book: ProfileBook, *, max_stages: int,
    seen: Callable[[ParallelPlan, SimulationResult], None] | None = None,
) -> tuple[ParallelPlan | None, SimulationResult | None, int]:
    """(the best plan, its result, how many plans were simulated); `seen` is called with every one."""
    pool = request.restrictions.apply(request.pool)
    judge = _Judge(request, book, sim_options(pool, request.options.precision, request.options.schedule), seen)
    # per-region slots, and (where a GPU type is in several regions) its regions pooled: the stages
    # whose data-parallel replicas span regions
    views = [build_slots(pool)] + ([build_slots(pool, pool_regions=True)] if spans_regions(pool) else [])
    for slots in views:
        _enumerate(request, book, slots, judge, max_stages=max_stages)
    return judge.answer()


def _enumerate(request: PlanRequest, book: ProfileBook, slots: tuple[Slot, ...], judge: _Judge, *,
               max_stages: int) -> None:
    """Every sketch over these slots, materialised and handed to `judge`."""
    L = book.model.num_layers
    gbs = request.global_batch_size
    caps = [s.capacity for s in slots]
    rotations = list(product(*[range(len(s.zones)) for s in slots]))

    for mbs in sorted({m for s in slots for m, _ in book.profiled_points(s.gpu_type)}):
        if gbs % mbs:
            continue
        n = gbs // mbs
        kinds_all = [
            (s.index, tp)
            for s in slots
            for m, tp in book.profiled_points(s.gpu_type)
            if m == mbs and tp <= s.gpus_per_node
        ]
        for p in range(1, min(max_stages, L) + 1):
            for cuts in combinations(range(1, L), p - 1):
                bounds = bounds_from_cuts(cuts, L)
                for kinds in product(kinds_all, repeat=p):
                    per_pipe = [0] * len(slots)
                    for si, tp in kinds:
                        per_pipe[si] += tp
                    d_max = min((caps[i] // u for i, u in enumerate(per_pipe) if u), default=0)
                    if request.restrictions.max_gpus is not None:
                        d_max = min(d_max, request.restrictions.max_gpus // sum(per_pipe))
                    for d in range(1, min(d_max, n) + 1):
                        placed: set[object] = set()
                        for rot, placement in product(rotations, (STAGE_MAJOR, PIPELINE_MAJOR)):
                            sk = Sketch(mbs=mbs, bounds=bounds, kinds=tuple(kinds), dp=d, zone_rot=tuple(rot),
                                        placement=placement)
                            lay = place(slots, sk)  # the planner's own placement rule
                            if lay is None or lay in placed:
                                continue
                            placed.add(lay)
                            judge(materialize(sk, lay, slots, model=request.model, global_batch_size=gbs,
                                              precision=request.options.precision,
                                              schedule=request.options.schedule))


def _keep_best(best: Best, request: PlanRequest, plan: ParallelPlan, r: SimulationResult) -> Best:
    """The better of `best` and this simulated plan: it must fit in memory and meet the constraints."""
    if not r.fits_memory or request.constraints.violations(
        usd_per_iteration=r.usd_per_iteration, usd_per_hour=r.usd_per_hour,
        iterations_per_s=r.throughput_iterations_per_s,
    ):
        return best
    v = objective_value(request.objective, r)
    return (v, plan, r) if best is None or v < best[0] else best


def exhaustive_groups_best(
    request: PlanRequest, book: ProfileBook, *, max_stages: int, max_groups: int = 3
) -> tuple[ParallelPlan | None, SimulationResult | None, int]:
    """Brute force over plans whose pipelines come in up to `max_groups` kinds (groups.py's space).

    A kind is a microbatch size and one (slot, TP) per stage over a shared layer split; every
    combination of distinct kinds with pipeline counts that fit the pool together is placed kind
    by kind (each on what the earlier left, stage-major fill), and every way to share the global
    batch between the kinds is simulated (pipelines of one kind split their kind's microbatches
    evenly: identical pipelines gain nothing from an uneven split). Single-kind plans are
    included, so the answer is the optimum of the per-pipeline-microbatch, any-shape space.
    Objective: the request's, without the tolerance (the pure optimum). Activation recomputation as
    `exhaustive_best` follows `SearchOptions.recompute`.
    """
    pool = request.restrictions.apply(request.pool)
    slots = build_slots(pool)
    L = book.model.num_layers
    gbs = request.global_batch_size
    judge = _Judge(request, book, sim_options(pool, request.options.precision, request.options.schedule))
    caps = [s.capacity for s in slots]
    max_gpus = request.restrictions.max_gpus
    mbs_all = sorted({m for s in slots for m, _ in book.profiled_points(s.gpu_type)})
    for p in range(1, min(max_stages, L) + 1):
        for cuts in combinations(range(1, L), p - 1):
            bounds = bounds_from_cuts(cuts, L)
            kinds_of = {
                mbs: [(s.index, tp) for s in slots for m, tp in book.profiled_points(s.gpu_type)
                      if m == mbs and tp <= s.gpus_per_node]
                for mbs in mbs_all
            }
            types = [(mbs, kinds) for mbs in mbs_all for kinds in product(kinds_of[mbs], repeat=p)]
            uses = []
            for _mbs, kinds in types:
                use = [0] * len(slots)
                for si, tp in kinds:
                    use[si] += tp
                uses.append(use)
            for combo, counts in _selections(uses, caps, max_gpus, max_groups):
                for split in _batch_splits(gbs, [types[i][0] for i in combo], counts):
                    plan = _group_plan(request, slots, bounds, [types[i] for i in combo], counts, split)
                    if plan is not None:
                        judge(plan)
    return judge.answer()


def _selections(uses: list[list[int]], caps: list[int], max_gpus: int | None, max_groups: int
                ) -> list[tuple[list[int], list[int]]]:
    """Every set of up to max_groups distinct kinds with pipeline counts (each >= 1) that fit the pool together."""
    out: list[tuple[list[int], list[int]]] = []

    def rec(start: int, left: list[int], gpus: int, kinds: list[int], counts: list[int]) -> None:
        if kinds:
            out.append((list(kinds), list(counts)))
        if len(kinds) == max_groups:
            return
        for i in range(start, len(uses)):
            x = 1
            while True:
                need = [u * x for u in uses[i]]
                g = gpus + sum(need)
                if any(n > c for n, c in zip(need, left, strict=True)) or (max_gpus is not None and g > max_gpus):
                    break
                rec(i + 1, [c - n for c, n in zip(left, need, strict=True)], g, kinds + [i], counts + [x])
                x += 1

    rec(0, list(caps), 0, [], [])
    return out


def _batch_splits(gbs: int, sizes: list[int], counts: list[int]) -> list[list[int]]:
    """Microbatches per kind (at least one per pipeline) whose samples add up to gbs."""
    out: list[list[int]] = []

    def rec(i: int, left: int, acc: list[int]) -> None:
        if i == len(sizes) - 1:
            if left % sizes[i] == 0 and left // sizes[i] >= counts[i]:
                out.append(acc + [left // sizes[i]])
            return
        reserve = sum(c * b for c, b in zip(counts[i + 1:], sizes[i + 1:], strict=True))
        n = counts[i]
        while n * sizes[i] <= left - reserve:
            rec(i + 1, left - n * sizes[i], acc + [n])
            n += 1

    rec(0, gbs, [])
    return out


def _group_plan(request: PlanRequest, slots: tuple[Slot, ...], bounds: tuple[tuple[int, int], ...],
                types: list[tuple[int, tuple[tuple[int, int], ...]]], counts: list[int], split: list[int]
                ) -> ParallelPlan | None:
    """Place each kind's pipelines on what earlier kinds left (the planner's fill); share its microbatches evenly."""
    placed = place_in_turn(slots, [Sketch(mbs=mbs, bounds=bounds, kinds=kinds, dp=x)
                                   for (mbs, kinds), x in zip(types, counts, strict=True)])
    if placed is None:
        return None
    stages = stages_of(slots, bounds, placed)
    pipes: list[PipelineBatch] = []
    for (mbs, _), x, n in zip(types, counts, split, strict=True):
        base, extra = divmod(n, x)
        pipes += [PipelineBatch(microbatch_size=mbs, num_microbatches=base + (1 if j < extra else 0)) for j in range(x)]
    return ParallelPlan(model=request.model, global_batch_size=request.global_batch_size, stages=stages,
                        pipelines=tuple(pipes), schedule=request.options.schedule, precision=request.options.precision)
