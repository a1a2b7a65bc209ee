"""`plan(request, book)`: the best plan for a pool, its estimate, the frontier, why, and how complete the search was.

Contract: pure and deterministic without a time budget (same request and book, same result). The
single-kind search (`search.Search`, a pipeline of pure steps: shapes, assign, place, estimate,
score) proposes candidates estimated with the simulator's building blocks; the table of passes
(`passes.PASSES`) adds plans of several pipeline kinds and across regions; the best are
materialised (zones, replicas, microbatches) and scored with the full `simulate()` by the same
`scoring.score` (`verify.py`); only a plan that fits in memory and meets every limit under
`simulate()` is returned, the best on the objective. When none does, `PlanResult.plan` is None and
`nearest_miss` explains what came closest and what to change. With `SearchOptions.max_search_s` the
search stops at that budget and `SearchStats.gap` bounds how much better a plan of the unsearched
space could be (0: the whole space was searched or ruled out by its bounds).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from functools import partial

from sailor_core.domain import ResourcePool
from sailor_core.errors import SailorError
from sailor_core.planner.costs import SimCosts, link_gaps
from sailor_core.planner.explain import (
    constraint_hint,
    explain,
    memory_miss,
    profile_command,
    recompute_note,
    summarize,
)
from sailor_core.planner.passes import Context, Passes, run_passes
from sailor_core.planner.request import (
    Constraints,
    FrontierPoint,
    Objective,
    PlanRequest,
    PlanResult,
    SearchStats,
)
from sailor_core.planner.risk import goodput
from sailor_core.planner.search import Search
from sailor_core.planner.slots import Slot, build_slots
from sailor_core.planner.space import Problem
from sailor_core.planner.verify import (
    Miss,
    Verification,
    Verified,
    choose,
    expected_time_of,
    frontier_plans,
    goodput_wanted,
    near_alternative,
    pareto,
    problems,
    recomputed_as,
    sim_options,
    value_of,
    verify,
)
from sailor_core.profiles import ProfileBook

# Of a time budget, what the verification keeps for itself (simulating the best plans): this share, at most
# this many seconds (algorithmic choice: simulating 20-40 plans takes 0.1-0.3 s on these machines).
VERIFY_SHARE, VERIFY_MAX_S = 0.2, 1.0


def plan(request: PlanRequest, book: ProfileBook, *, costs: SimCosts | None = None) -> PlanResult:
    """The best plan for `request` on `book`'s profiles, its estimate, the frontier and why (see the module).

    `costs`: a `SimCosts` of this book and precision kept across calls (the trace replay plans many
    pools of one book): its memoised link, ring and memory answers are reused; the plans are the same.
    Activation recomputation (`SearchOptions.recompute`): under "auto", when nothing fits in memory
    without it, the plan space is searched again with each stage recomputing exactly where it does not
    fit without it (`SimCosts.recomputes`): a long-sequence model whose first 1F1B stages keep too many
    microbatches in flight for any split.
    """
    t0 = time.perf_counter()
    _check_model(request, book)
    mode = request.options.recompute
    res = _plan_pass(request, book, costs, t0, "never" if mode == "auto" else mode, retry=mode == "auto")
    if res is not None:
        return res
    again = _plan_pass(request, book, None, t0, "auto", retry=False)
    assert again is not None
    if again.plan is None:
        return replace(again, nearest_miss=again.nearest_miss + "; recomputing activations, nothing fits either")
    return again


def _deadlines(request: PlanRequest, t0: float) -> float:
    """When the search stops (perf_counter seconds): the budget less what the verification keeps."""
    budget = request.options.max_search_s
    if budget is None:
        return math.inf
    return t0 + budget - min(VERIFY_SHARE * budget, VERIFY_MAX_S)


def _plan_pass(request: PlanRequest, book: ProfileBook, costs: SimCosts | None, t0: float, recompute: str, *,
               retry: bool) -> PlanResult | None:
    """The plan of one search whose stages recompute activations as `recompute` says (`SimCosts`);
    None, with `retry`, when nothing at all fits in memory (the caller searches again, so the
    no-plan explanation is not worked out here)."""
    opts = request.options
    pool, misses = _usable_pool(request, book)
    if opts.min_stages > book.model.num_layers:
        misses.append(f"{book.model.name} has {book.model.num_layers} layers, fewer than the {opts.min_stages} "
                      f"pipeline stages asked for; to fix: ask for at most {book.model.num_layers} stages")
    # Under max-goodput a spot GPU is not an on-demand one (it carries the preemption risk): markets stay apart.
    slots = build_slots(pool, pool_markets=not goodput_wanted(request))
    if costs is None or costs.book is not book or costs.precision != opts.precision or costs.recompute != recompute:
        costs = SimCosts(book, precision=opts.precision, recompute=recompute)
    search = Search(problem_of(request, book, slots), costs, deadline=_deadlines(request, t0))
    cands = tuple(search.run()) if slots else ()
    ctx = Context(request=request, pool=pool, slots=slots, costs=costs, search=search, candidates=cands,
                  deadline=search.deadline)
    passes = run_passes(ctx)
    finish = partial(recomputed_as, costs=costs)
    so, value = sim_options(pool, opts.precision, opts.schedule), value_of(request)
    checked = verify(request, book, pool, [finish(p) for p in ctx.plans_of(cands, slots) + passes.plans], so, value,
                     both_markets=goodput_wanted(request))
    fronts = frontier_plans(search.state.points + passes.points, slots, request, book, so, finish)
    # Frontier plans are simulated plans too: one that meets every limit competes for the choice, and the
    # frontier shows only those, so it never shows a plan better on the objective than the chosen one.
    known = {v.plan for v in checked.feasible}
    feasible = list(checked.feasible) + [Verified(value=value(pl, r), plan=pl, result=r) for pl, r in fronts
                                         if pl not in known and not problems(request, pool, pl, r)]
    best = choose(request.objective, feasible, expected_time_of(request))
    stats = _stats(search, passes, checked.simulated + len(fronts), best, t0)
    misses += _link_misses(slots, costs, checked)
    if best is None:
        if retry and slots and checked.closest is None and search.state.nearest is None:
            return None
        return _no_plan(request, book, slots, search, checked.closest, misses, pareto(feasible, None), stats)
    gp = goodput(best.plan, best.result.iteration_time_s, best.result.usd_per_iteration, request.spot_risk)
    alt = near_alternative(request.objective, best, feasible, opts.tolerance) if not goodput_wanted(request) else None
    text = explain(request, best.plan, best.result, slots, pareto(feasible, best), gp,
                   completeness=_completeness(stats, passes),
                   alternative=(alt.plan, alt.result) if alt is not None else None)
    return PlanResult(plan=best.plan, estimate=best.result, frontier=pareto(feasible, best), stats=stats,
                      explanation=text + recompute_note(best.plan, recompute), nearest_miss="; ".join(misses),
                      goodput=gp)


def _stats(search: Search, passes: Passes, simulated: int, best: Verified | None, t0: float) -> SearchStats:
    """The search's counters, what ran, and the proven gap: how much better on the objective a one-kind
    plan of what the budget left unsearched (stage counts, splits' thresholds) could be than the chosen.
    Passes the budget skipped are listed, not bounded (their plans mix pipeline kinds, which the
    single-kind floors do not bound); `SearchStats.optimal` is then False."""
    c = search.state.counters
    floor = search.unsearched
    gap: float | None = 0.0
    if math.isfinite(floor):
        gap = None if best is None else max(0.0, best.value / floor - 1.0) if floor > 0 else None
    return SearchStats(search_time_s=time.perf_counter() - t0, configurations=c.configurations,
                       assignments=c.assignments, candidates=c.candidates, simulated=simulated, pruned=c.pruned,
                       gap=gap, passes=passes.ran, skipped=passes.skipped)


def _completeness(stats: SearchStats, passes: Passes) -> str:
    """One sentence: whether the search covered its plan space, or how far the budget left it."""
    ran = f" and {', '.join(passes.ran)}" if passes.ran else ""
    left = f"; not searched: {', '.join(passes.skipped)} (the budget ended)" if passes.skipped else ""
    if stats.gap == 0.0:
        return (f"Search: every plan of the searched space covered or ruled out by its bound (one pipeline "
                f"kind{ran}){left}.")
    gap = "unknown" if stats.gap is None else f"at most {stats.gap:.1%}"
    return (f"Search: stopped at its {stats.search_time_s:.1f} s budget; a one-kind plan of what it left "
            f"unsearched is {gap} better (its lower bound){left}.")


def _link_misses(slots: tuple[Slot, ...], costs: SimCosts, checked: Verification) -> list[str]:
    """A line on the links between the pool's GPUs without a network profile, which rule out the plans
    that need them (and only those)."""
    gaps = sorted(set(link_gaps(slots, costs)) | checked.missing_links)
    if not gaps:
        return []
    more = f" and {len(gaps) - 4} more" if len(gaps) > 4 else ""
    return [f"plans needing these links were left out: {'; '.join(gaps[:4])}{more} "
            f"(to fix: sailor profile network between them)"]


def _check_model(request: PlanRequest, book: ProfileBook) -> None:
    """Raises SailorError when the request's model is not the book's."""
    if request.model != book.model.name:
        raise SailorError(
            f"the request is for model {request.model} but the profiles are for {book.model.name}; "
            f"to fix: load the profile book of {request.model}"
        )


def _usable_pool(request: PlanRequest, book: ProfileBook) -> tuple[ResourcePool, list[str]]:
    """(the restricted pool less the GPU types the book cannot time, a line for each thing left out)."""
    pool = request.restrictions.apply(request.pool)
    misses: list[str] = []
    if not pool.entries:
        misses.append(
            "the pool has no GPUs left after the restrictions; to fix: add GPUs to the pool file or relax "
            "--cloud/--region/--zone/--gpu-type/--market"
        )
    # GPU types the store cannot time for this model are left out, and said so.
    usable = []
    for e in pool.entries:
        if e.gpu_type not in book.gpu_types or not book.profiled_points(e.gpu_type):
            misses.append(f"{e.gpu_type} has no profile for {book.model.name}; to fix: "
                          f"{profile_command(book.model.name, e.gpu_type)}")
            continue
        usable.append(e)
    return ResourcePool(entries=tuple(usable)), misses


def problem_of(request: PlanRequest, book: ProfileBook, slots: tuple[Slot, ...]) -> Problem:
    """The search kernel's problem: the slots, the profiled microbatch sizes and TPs, the goal and options."""
    opts = request.options
    mbs_values = sorted({m for s in slots for m, _ in book.profiled_points(s.gpu_type)})
    tp_values = sorted({t for s in slots for _, t in book.profiled_points(s.gpu_type)})
    return Problem(
        num_layers=book.model.num_layers,
        global_batch_size=request.global_batch_size,
        tokens_per_sample=book.model.sequence_length,
        slots=slots,
        mbs_values=tuple(mbs_values),
        tp_values=tuple(tp_values),
        objective=request.objective,
        constraints=request.constraints,
        max_gpus=request.restrictions.max_gpus,
        max_stages=opts.max_stages,
        min_stages=opts.min_stages,
        exhaustive_partitions_up_to=opts.exhaustive_partitions_up_to,
        keep=opts.rescore_top,
        patience=opts.patience,
        tolerance=opts.tolerance,
        risk=request.spot_risk,
    )




def _no_plan(
    request: PlanRequest, book: ProfileBook, slots: tuple[Slot, ...], search: Search, closest: Miss | None,
    misses: list[str], frontier: tuple[FrontierPoint, ...], stats: SearchStats,
) -> PlanResult:
    """The result when no plan is feasible: the nearest miss first, then what was left out, and the fix."""
    c = request.constraints
    relaxed: list[str] = []
    if slots and (c.min_iterations_per_s or c.max_usd_per_iteration or c.max_usd_per_hour):
        relaxed = _relaxed_misses(request, book)
    if relaxed:
        misses[:0] = relaxed
    elif closest is not None:
        misses.insert(0, f"closest plan: {closest.why}")
    elif search.state.nearest is not None:
        misses.insert(0, f"closest estimate {search.state.nearest[1]}")
    elif slots:
        misses.insert(0, memory_miss(book, slots, request))
    # The constraint hint only where a constraint is what failed (memory and empty-pool misses
    # carry their own fix).
    hint = constraint_hint(request) if relaxed or closest is not None or search.state.nearest is not None else ""
    unprofiled = () if slots else tuple(sorted({e.gpu_type for e in request.restrictions.apply(request.pool).entries
                                                if e.gpu_type not in book.gpu_types
                                                or not book.profiled_points(e.gpu_type)}))
    return PlanResult(
        plan=None, estimate=None, frontier=frontier, stats=stats,
        explanation="no feasible plan",
        nearest_miss="; ".join(misses) + (f"; to fix: {hint}" if hint else ""), unprofiled=unprofiled,
    )


def _relaxed_misses(request: PlanRequest, book: ProfileBook) -> list[str]:
    """Without the constraints: how close do the fastest and the cheapest plans come to them?"""
    c = request.constraints
    out = []
    goals = []
    if c.min_iterations_per_s is not None:
        goals.append((Objective.MAX_THROUGHPUT, "the fastest plan"))
    if c.max_usd_per_iteration is not None or c.max_usd_per_hour is not None:
        goals.append((Objective.MIN_COST, "the cheapest plan"))
    for obj, label in goals:
        r = plan(replace(request, objective=obj, constraints=Constraints()), book)
        if r.plan is None or r.estimate is None:
            return []  # nothing fits at all: the memory explanation is the answer
        e = r.estimate
        broken = c.violations(usd_per_iteration=e.usd_per_iteration, usd_per_hour=e.usd_per_hour,
                              iterations_per_s=e.throughput_iterations_per_s)
        out.append(f"{label} ({summarize(r.plan)}) " + ("; ".join(broken) if broken else "meets each limit alone"))
    return out
