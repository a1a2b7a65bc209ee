"""`plan(request, book)`: the best plan for a pool, its estimate, the frontier and why.

Contract: pure and deterministic (same request and book, same result). The search kernel
(`search.Search`, a pipeline of pure steps: shapes, assign, place, estimate, score) proposes
candidates estimated with the simulator's building blocks; the best ones are materialised (zones,
replicas, microbatches) and scored with the full `simulate()` by the same `scoring.score`; only a
plan that fits in memory and meets every constraint under `simulate()` is returned. When none
does, `PlanResult.plan` is None and `nearest_miss` explains what came closest and what to change.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from sailor_core.catalog import is_cpu_type
from sailor_core.domain import (
    Capacity,
    Market,
    ParallelPlan,
    ResourcePool,
    split_batch,
)
from sailor_core.errors import MissingProfileError, SailorError
from sailor_core.planner.costs import SimCosts, Slot
from sailor_core.planner.groups import group_plans
from sailor_core.planner.mixed import mixed_plans
from sailor_core.planner.placement import place, stages_of
from sailor_core.planner.request import (
    Constraints,
    FrontierPoint,
    Objective,
    PlanRequest,
    PlanResult,
    SearchStats,
)
from sailor_core.planner.risk import Goodput, goodput
from sailor_core.planner.scoring import score, secondary
from sailor_core.planner.search import Search
from sailor_core.planner.shapes import packed_partition, uniform_partition
from sailor_core.planner.space import Candidate, Problem, Sketch
from sailor_core.profiles import ProfileBook
from sailor_core.simulator import SimOptions, SimulationResult, simulate
from sailor_core.units import sig
from sailor_core.units import usd as usd_text


def build_slots(pool: ResourcePool, *, pool_markets: bool = True, pool_regions: bool = False) -> tuple[Slot, ...]:
    """Group pool entries into slots: one GPU type in one region at one node shape, zones pooled.

    Zones of one market at one price are pooled (paper heuristic). With `pool_markets`, the markets
    of a type in a region are pooled too when each market has one price there (prices differ by
    market only): spot and on-demand GPUs of one type in one zone are one kind of hardware, and a
    stage may need more of them than one market offers (68 spot + 60 on-demand GH-96 in a zone run
    one 128-replica stage); the slot then lists each (zone, market) offer and prices the cheapest
    first (`Slot.usd_per_hour`). Otherwise (or with zone prices that differ within a market, or a
    count that is not whole VMs) one slot per market and price, as before.

    With `pool_regions`, one slot holds the type's GPUs of every region of a cloud (zones keep their
    region: `Slot.zone_regions`), so one stage's data-parallel replicas may span regions, which
    per-region slots never allow (a stage's replicas come from one slot). Its zones are priced by
    their own offers (zones of different regions may differ in price within a market). Where markets
    stay apart (`pool_markets=False`) and several are offered, or counts are not whole VMs, the parts
    split by market and price as above, so regions at different prices stay in different slots.
    """
    groups: dict[tuple[str, str, str, int], list[Capacity]] = defaultdict(list)
    for e in pool.entries:
        if e.gpus > 0:
            groups[(e.gpu_type, e.cloud, "" if pool_regions else e.region, e.gpus_per_vm)].append(e)
    made: list[tuple[tuple[object, ...], Slot]] = []
    for (gpu, cloud, region, gpn), entries in groups.items():
        prices = {(e.market, e.usd_per_gpu_hour) for e in entries}
        # whole VMs only: a zone's pooled GPUs then form as many TP groups as its markets do apart
        vms = any(e.gpus % gpn for e in entries)
        if pool_regions:  # offers price each zone exactly: apart only when markets must stay apart or VMs are not whole
            split = len(prices) == 1 or vms or (not pool_markets and len({m for m, _ in prices}) > 1)
        else:
            split = not pool_markets or len(prices) == 1 or len(prices) > len({m for m, _ in prices}) or vms
        parts: dict[tuple[str, float], list[Capacity]] = defaultdict(list)
        for e in entries:
            parts[(e.market.value, e.usd_per_gpu_hour) if split else ("", 0.0)].append(e)
        for part in parts.values():
            total: dict[str, int] = defaultdict(int)
            for e in part:
                total[e.zone] += e.gpus
            zones = tuple(sorted(total.items(), key=lambda zc: (-zc[1], zc[0])))
            rank = {z: i for i, (z, _) in enumerate(zones)}
            offers = tuple(sorted(((e.zone, e.market, e.gpus, e.usd_per_gpu_hour) for e in part),
                                  key=lambda o: (rank[o[0]], o[3], o[1].value)))
            regions = {e.zone: e.region for e in part}
            cheapest = min(part, key=lambda e: (e.usd_per_gpu_hour, e.market.value))
            key = (gpu, cheapest.market.value, cloud, region, gpn, cheapest.usd_per_gpu_hour)
            made.append((key, Slot(index=0, gpu_type=gpu, market=cheapest.market, region=regions[zones[0][0]],
                                   cloud=cloud, gpus_per_node=gpn, usd_per_gpu_hour=cheapest.usd_per_gpu_hour,
                                   zones=zones, offers=() if split else offers,
                                   zone_regions=tuple((z, regions[z]) for z, _ in zones)
                                   if len(set(regions.values())) > 1 else ())))
    made.sort(key=lambda ks: ks[0])
    return tuple(replace(slot, index=i) for i, (_, slot) in enumerate(made))


def spans_regions(pool: ResourcePool) -> bool:
    """Whether some GPU type (of one cloud and node shape) is offered in more than one region."""
    regions: dict[tuple[str, str, int], set[str]] = defaultdict(set)
    for e in pool.entries:
        if e.gpus > 0:
            regions[(e.gpu_type, e.cloud, e.gpus_per_vm)].add(e.region)
    return any(len(r) > 1 for r in regions.values())


def materialize(sk: Sketch, layouts: Sequence[Sequence[tuple[str, int]]], slots: Sequence[Slot], *, model: str,
                global_batch_size: int, precision: str = "fp32", schedule: str = "1f1b") -> ParallelPlan:
    return ParallelPlan(
        model=model,
        global_batch_size=global_batch_size,
        stages=stages_of(slots, sk.bounds, ((sk, layouts),)),
        pipelines=split_batch(global_batch_size, [sk.mbs] * sk.dp),
        schedule=schedule,
        precision=precision,
    )


def sim_options(pool: ResourcePool, precision: str, schedule: str) -> SimOptions:
    prices = {(e.zone, e.gpu_type, e.market): e.usd_per_gpu_hour for e in pool.entries}
    return SimOptions(prices_usd_per_gpu_hour=prices, precision=precision, schedule=schedule)


def objective_value(objective: Objective, r: SimulationResult, useful_fraction: float = 1.0) -> float:
    """`scoring.score` of a simulated plan; lower is better. `useful_fraction`: the plan's expected share
    of time that trains (risk.py)."""
    return score(objective, iteration_s=r.iteration_time_s, usd_per_iteration=r.usd_per_iteration,
                 usd_per_million_tokens=r.usd_per_million_tokens, useful_fraction=useful_fraction)


def secondary_value(objective: Objective, r: SimulationResult) -> float:
    """`scoring.secondary` of a simulated plan: the other goal, deciding among plans within the
    tolerance on the objective (lower is better)."""
    return secondary(objective, iteration_s=r.iteration_time_s, usd_per_iteration=r.usd_per_iteration)


def choose(objective: Objective, options: Sequence[tuple[float, ParallelPlan, SimulationResult]], tolerance: float,
           secondary: Callable[[ParallelPlan, SimulationResult], float] | None = None
           ) -> tuple[float, ParallelPlan, SimulationResult] | None:
    """Lexicographic choice: of the plans whose objective value is within `tolerance` (relative) of
    the best, the one best on the other goal (cheapest under max throughput, fastest under the cost
    objectives, or `secondary`); exact ties on both go to the objective, then to the first seen."""
    if not options:
        return None
    best_v = min(v for v, _, _ in options)
    near = [o for o in options if o[0] <= best_v * (1 + tolerance)]
    other = secondary or (lambda _pl, r: secondary_value(objective, r))
    return min(near, key=lambda o: (other(o[1], o[2]), o[0]))


def cheapest_markets(plan: ParallelPlan, pool: ResourcePool) -> ParallelPlan:
    """The same plan with each replica on the cheapest market that still has room in its zone.

    Spot and on-demand GPUs of one type in one zone are the same hardware, so moving a replica
    between markets changes the cost and not the speed. The search places replicas per market;
    this pass lets a stage mix markets (3 spot + 1 on-demand) where the search kept them apart.
    Replicas are taken in plan order and each TP group stays on one market. If the greedy fill
    cannot place every replica, the plan is returned unchanged.
    """
    room: dict[tuple[str, str], list[tuple[float, Market, int]]] = defaultdict(list)
    for e in pool.entries:
        room[(e.zone, e.gpu_type)].append((e.usd_per_gpu_hour, e.market, e.gpus))
    if all(len(v) == 1 for v in room.values()):
        return plan  # one market per GPU type and zone: nothing to move
    left = {k: sorted(v, key=lambda x: (x[0], x[1].value)) for k, v in room.items()}
    free = {(z, g, mk): n for (z, g), entries in left.items() for _, mk, n in entries}
    stages = []
    for st in plan.stages:
        reps = []
        for r in st.replicas:
            for _, mk, _n in left.get((r.zone, r.gpu_type), ()):
                if free[(r.zone, r.gpu_type, mk)] >= r.tp:
                    free[(r.zone, r.gpu_type, mk)] -= r.tp
                    reps.append(r if r.market is mk else replace(r, market=mk))
                    break
            else:
                return plan
        stages.append(replace(st, replicas=tuple(reps)))
    return replace(plan, stages=tuple(stages))


def summarize(plan: ParallelPlan) -> str:
    """One line: stages, layers, replicas per stage by GPU type/TP/zone, microbatches."""
    parts = []
    for st in plan.stages:
        groups: dict[tuple[str, int, str, str], int] = {}
        for r in st.replicas:
            k = (r.gpu_type, r.tp, r.zone, r.market.value)
            groups[k] = groups.get(k, 0) + 1
        reps = " + ".join(
            f"{n}x{g}(tp{tp}{', spot' if mk == 'spot' else ''})@{z}" for (g, tp, z, mk), n in groups.items()
        )
        parts.append(f"layers {st.first_layer}-{st.last_layer}: {reps}")
    by_size: dict[int, list[int]] = {}
    for p in plan.pipelines:
        by_size.setdefault(p.microbatch_size, []).append(p.num_microbatches)
    if len(by_size) == 1:
        (size, counts), = by_size.items()
        batches = f"microbatch {size} x {max(counts)}"
    else:  # per-pipeline microbatch sizes: one group per size
        batches = "microbatches " + " + ".join(f"{size} x {max(c)} ({len(c)} pipelines)" for size, c in by_size.items())
    return (
        f"{plan.num_stages} stage(s) x {plan.data_parallel} pipeline(s), {plan.num_gpus} GPUs, {batches} | "
        + " | ".join(parts)
    )


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
    slots = build_slots(pool, pool_markets=not _goodput_wanted(request))
    problem = _problem(request, book, slots)
    if costs is None or costs.book is not book or costs.precision != opts.precision or costs.recompute != recompute:
        costs = SimCosts(book, precision=opts.precision, recompute=recompute)
    search = Search(problem, costs)
    cands = search.run() if slots else []
    so = sim_options(pool, opts.precision, opts.schedule)
    value = _value_of(request)
    to_verify = _to_verify(request, search, cands, slots)
    if opts.replicas_across_regions and _crosses_regions(cands[:BASES_ACROSS_REGIONS], slots) and spans_regions(pool):
        to_verify += _across_regions(request, pool, problem, costs, search.state.incumbent)
    finish = partial(recomputed_as, costs=costs)
    to_verify = [finish(p) for p in to_verify]
    simulated, feasible, closest = _verify(request, book, pool, to_verify, so, costs, value)
    if opts.wide_frontier and slots:
        _widen_frontier(request, problem, search, costs)
    front_sims = _frontier_sims(search, slots, request, book, so, finish)
    simulated += len(front_sims)
    # Frontier plans are simulated plans too: one that meets every limit competes for the choice,
    # so the chosen plan is never dominated by a point the frontier shows.
    known = {pl for _, pl, _ in feasible}
    feasible += [(value(pl, r), pl, r) for pl, r in front_sims
                 if pl not in known and not _problems(request, pool, pl, r)]
    best = choose(request.objective, feasible, opts.tolerance, _expected_time_of(request))
    frontier = _pareto(front_sims, best[1:] if best is not None else None)
    stats = SearchStats(
        search_time_s=time.perf_counter() - t0,
        configurations=search.state.counters.configurations,
        assignments=search.state.counters.assignments,
        candidates=search.state.counters.candidates,
        simulated=simulated,
        pruned=search.state.counters.pruned,
    )
    if costs.missing:
        misses.append(
            "plans needing these links were skipped: " + "; ".join(sorted(costs.missing)[:4])
            + " (to fix: sailor profile network between them)"
        )
    if best is None:
        if retry and slots and closest is None and search.state.nearest is None:
            return None
        return _no_plan(request, book, slots, search, closest, misses, frontier, stats)
    _, pl, r = best
    gp = goodput(pl, r.iteration_time_s, r.usd_per_iteration, request.spot_risk)
    return PlanResult(
        plan=pl, estimate=r, frontier=frontier, stats=stats,
        explanation=explain(request, pl, r, slots, frontier, gp) + _recompute_note(pl, recompute),
        nearest_miss="; ".join(misses), goodput=gp,
    )


def recomputed_as(pl: ParallelPlan, costs: SimCosts) -> ParallelPlan:
    """The plan with `Stage.recompute` set as `costs` has its stages recompute (`SimCosts.recomputes`):
    under "auto" a stage recomputes where one of its replicas does not fit in memory without it; a
    stage's memory does not depend on its neighbours', and later 1F1B stages keep fewer microbatches in
    flight, so they often fit without paying the extra forward."""
    p = pl.num_stages
    return replace(pl, stages=tuple(
        replace(st, recompute=any(
            costs.recomputes(r.gpu_type, r.tp, st.first_layer, st.last_layer,
                             mbs=pl.pipelines[j].microbatch_size, in_flight=p - s, first_stage=s == 0,
                             last_stage=s == p - 1)
            for j, r in enumerate(st.replicas)))
        for s, st in enumerate(pl.stages)))


def _recompute_note(pl: ParallelPlan, mode: str) -> str:
    """The explanation's line on activation recomputation, when the plan recomputes."""
    stages = [s for s, st in enumerate(pl.stages) if st.recompute]
    if not stages:
        return ""
    if mode == "always":
        return "\nActivation recomputation on every stage (--recompute always)."
    return (f"\nActivation recomputation on stage(s) {', '.join(map(str, stages))} of {pl.num_stages}: no plan fits "
            f"in memory without it, and these stages fit only with it (--recompute never forbids it).")


def _check_model(request: PlanRequest, book: ProfileBook) -> None:
    """Raises SailorError when the request's model is not the book's."""
    if request.model != book.model.name:
        raise SailorError(
            f"the request is for model {request.model} but the profiles are for {book.model.name}; "
            f"to fix: load the profile book of {request.model}"
        )


def profile_command(model: str, gpu_type: str) -> str:
    """The whole command that measures `model` on `gpu_type`, where that GPU is (its device and the name the
    results are stored under), e.g. `sailor profile model --model OPT-350 --gpu-type H100-80 --device cuda
    on a H100-80 machine`."""
    device = "cpu" if is_cpu_type(gpu_type) else "cuda"
    return f"sailor profile model --model {model} --gpu-type {gpu_type} --device {device} on a {gpu_type} machine"


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


def _problem(request: PlanRequest, book: ProfileBook, slots: tuple[Slot, ...]) -> Problem:
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


def _to_verify(request: PlanRequest, search: Search, cands: Sequence[Candidate],
               slots: Sequence[Slot]) -> list[ParallelPlan]:
    """The plans to simulate: the search's candidates materialised, then plans of mixed pipelines and of
    several pipeline groups built from them where the goal can gain from those."""
    opts = request.options
    to_verify = [
        materialize(cand.sketch, cand.estimate.layouts, slots, model=request.model,
                    global_batch_size=request.global_batch_size, precision=opts.precision, schedule=opts.schedule)
        for cand in cands
    ]
    # A second pipeline group adds GPUs to go faster: worth trying for throughput, or for cost
    # when a minimum throughput must be met; a pure cost objective never gains from more GPUs.
    fastest_wanted = request.objective is Objective.MAX_THROUGHPUT
    wants_speed = fastest_wanted or request.constraints.min_iterations_per_s is not None
    if opts.mixed_pipelines and cands and wants_speed:
        to_verify += mixed_plans(search, cands[: opts.mixed_pipelines], model=request.model,
                                 global_batch_size=request.global_batch_size, precision=opts.precision,
                                 schedule=opts.schedule,
                                 own_microbatch=opts.per_pipeline_microbatches and fastest_wanted)
    # Pipelines of several kinds pay where GPU types differ (the zones and markets of one type in a
    # region share a slot: build_slots). Searched for the highest throughput; a
    # minimum it/s under a cost objective keeps the cheaper leftover search above.
    if opts.max_shapes >= 2 and cands and fastest_wanted and len({s.gpu_type for s in slots}) > 1:
        to_verify += group_plans(search, cands, model=request.model,
                                 global_batch_size=request.global_batch_size, precision=opts.precision,
                                 schedule=opts.schedule, max_groups=opts.max_shapes,
                                 own_microbatch=opts.per_pipeline_microbatches)
    return to_verify


# The best plans checked for pipelines that cross regions (as many as get a second group: mixed_pipelines' default).
BASES_ACROSS_REGIONS = 4


def _crosses_regions(cands: Sequence[Candidate], slots: Sequence[Slot]) -> bool:
    """Whether one of these plans has its pipelines' stages in different regions (each slot is one region)."""
    return any(len({slots[si].region for si, _ in c.sketch.kinds}) > 1 for c in cands)


def _across_regions(request: PlanRequest, pool: ResourcePool, problem: Problem, costs: SimCosts,
                    incumbent: float) -> list[ParallelPlan]:
    """The search again with each GPU type's regions pooled in one slot (`build_slots(pool_regions=True)`):
    plans whose stages hold data-parallel replicas in several regions. A pipeline that fills every GPU
    of two one-GPU regions leaves the per-region search no room for the other shape, data parallelism
    across them, which wins when the ring over the link costs less than the pipeline's sends and bubble.
    Run when one of the best plans crosses regions: a plan inside one region leaves the other regions
    idle, and the second pipeline group (mixed.py) already puts replicas there.
    It starts from the per-region search's best score (`incumbent`), so its bounds prune against that
    from the first sketch on (on 8 + 8 A100-40 in two regions it adds about 0.07 s to a 0.13 s plan)."""
    opts = request.options
    wide = build_slots(pool, pool_markets=not _goodput_wanted(request), pool_regions=True)
    search = Search(replace(problem, slots=wide), costs, incumbent=incumbent)
    return [materialize(c.sketch, c.estimate.layouts, wide, model=request.model,
                        global_batch_size=request.global_batch_size, precision=opts.precision, schedule=opts.schedule)
            for c in search.run()]


def _goodput_wanted(request: PlanRequest) -> bool:
    """Whether plans are scored by goodput: max-goodput with some spot risk."""
    return request.objective is Objective.MAX_GOODPUT and not request.spot_risk.riskless


def _value_of(request: PlanRequest) -> Callable[[ParallelPlan, SimulationResult], float]:
    """The objective value of a simulated plan (its useful fraction counted under max-goodput)."""
    risk = request.spot_risk
    goodput_wanted = _goodput_wanted(request)

    def value(pl: ParallelPlan, r: SimulationResult) -> float:
        u = goodput(pl, r.iteration_time_s, r.usd_per_iteration, risk).useful_fraction if goodput_wanted else 1.0
        return objective_value(request.objective, r, u)

    return value


def _expected_time_of(request: PlanRequest) -> Callable[[ParallelPlan, SimulationResult], float] | None:
    """Under max-goodput, the expected seconds per useful iteration of a simulated plan; else None."""
    if not _goodput_wanted(request):
        return None
    risk = request.spot_risk

    def expected_time(pl: ParallelPlan, r: SimulationResult) -> float:
        g = goodput(pl, r.iteration_time_s, r.usd_per_iteration, risk)
        return 1.0 / g.expected_iterations_per_s if g.expected_iterations_per_s > 0 else float("inf")

    return expected_time


def _verify(
    request: PlanRequest, book: ProfileBook, pool: ResourcePool, to_verify: list[ParallelPlan], so: SimOptions,
    costs: SimCosts, value: Callable[[ParallelPlan, SimulationResult], float],
) -> tuple[int, list[tuple[float, ParallelPlan, SimulationResult]], tuple[float, str] | None]:
    """Simulates each plan (on its cheapest markets): (how many were simulated, (value, plan, result) of
    those that meet every limit, (gap, why) of the closest miss); missing links go to `costs.missing`."""
    simulated = 0
    feasible: list[tuple[float, ParallelPlan, SimulationResult]] = []
    closest: tuple[float, str] | None = None
    # The cheapest market of a replica is the same GPU for less; under spot risk it may also be the
    # riskier one, so both versions are simulated.
    variants = [cheapest_markets(p, pool) for p in to_verify] + (to_verify if _goodput_wanted(request) else [])
    for pl in dict.fromkeys(variants):
        try:
            r = simulate(pl, book, options=so)
        except MissingProfileError as e:
            # e.g. a ring mixing two GPU types with no measured link between them
            costs.missing.add(e.what)
            continue
        simulated += 1
        problems = _problems(request, pool, pl, r)
        if problems:
            gap = _gap(request, r)
            if closest is None or gap < closest[0]:
                closest = (gap, f"{summarize(pl)}: " + "; ".join(problems))
            continue
        feasible.append((value(pl, r), pl, r))
    return simulated, feasible, closest


def _widen_frontier(request: PlanRequest, problem: Problem, search: Search, costs: SimCosts) -> None:
    """Adds to `search.state.points` the points of the other objective's search without limits."""
    # The main search prunes toward its objective; the other objective's search (no limits)
    # fills the far end of the frontier. Both explore the same plan space and placement.
    unconstrained = request.constraints == Constraints()
    for other in (Objective.MAX_THROUGHPUT, Objective.MIN_COST):
        if unconstrained and (other is request.objective or (
                other is Objective.MIN_COST and request.objective is Objective.MIN_COST_PER_TOKEN)):
            continue  # the main search already covers this end
        wide = Search(replace(problem, objective=other, constraints=Constraints()), costs, shared=search)
        wide.run()
        search.state.points.extend(wide.state.points)


def _no_plan(
    request: PlanRequest, book: ProfileBook, slots: Sequence[Slot], search: Search,
    closest: tuple[float, str] | None, misses: list[str], frontier: tuple[FrontierPoint, ...], stats: SearchStats,
) -> PlanResult:
    """The result when no plan is feasible: the nearest miss first, then what was left out, and the fix."""
    c = request.constraints
    relaxed: list[str] = []
    if slots and (c.min_iterations_per_s or c.max_usd_per_iteration or c.max_usd_per_hour):
        relaxed = _relaxed_misses(request, book)
    if relaxed:
        misses[:0] = relaxed
    elif closest is not None:
        misses.insert(0, f"closest plan: {closest[1]}")
    elif search.state.nearest is not None:
        misses.insert(0, f"closest estimate {search.state.nearest[1]}")
    elif slots:
        misses.insert(0, _memory_miss(book, slots, request))
    # The constraint hint only where a constraint is what failed (memory and empty-pool misses
    # carry their own fix).
    hint = _constraint_hint(request) if relaxed or closest is not None or search.state.nearest is not None else ""
    unprofiled = () if slots else tuple(sorted({e.gpu_type for e in request.restrictions.apply(request.pool).entries
                                                if e.gpu_type not in book.gpu_types
                                                or not book.profiled_points(e.gpu_type)}))
    return PlanResult(
        plan=None, estimate=None, frontier=frontier, stats=stats,
        explanation="no feasible plan",
        nearest_miss="; ".join(misses) + (f"; to fix: {hint}" if hint else ""), unprofiled=unprofiled,
    )


def _problems(request: PlanRequest, pool: ResourcePool, pl: ParallelPlan, r: SimulationResult) -> list[str]:
    """Why a simulated plan cannot be returned: a broken limit, more GPUs than the pool, memory."""
    problems = request.constraints.violations(
        usd_per_iteration=r.usd_per_iteration, usd_per_hour=r.usd_per_hour,
        iterations_per_s=r.throughput_iterations_per_s,
    )
    problems.extend(_over_pool(pl, pool, request.restrictions.max_gpus))
    lo, hi = request.options.min_stages, request.options.max_stages
    if not lo <= pl.num_stages <= hi:
        problems.append(f"has {pl.num_stages} pipeline stages, outside {lo}-{hi}")
    if not r.fits_memory:
        worst = r.oom[0]
        problems.append(
            f"stage {worst.stage} replica {worst.replica} is {worst.bytes_over / 2**30:.2f} GiB over memory"
        )
    return problems


def _over_pool(pl: ParallelPlan, pool: ResourcePool, max_gpus: int | None) -> list[str]:
    """A plan may use no more GPUs than the pool offers per (zone, type, market), nor than max_gpus."""
    have = {(e.zone, e.gpu_type, e.market): e.gpus for e in pool.entries}
    out = [f"uses {n} {g} ({mk.value}) in {z} but the pool has {have.get((z, g, mk), 0)}"
           for (z, g, mk), n in pl.gpus_by_place().items() if n > have.get((z, g, mk), 0)]
    if max_gpus is not None and pl.num_gpus > max_gpus:
        out.append(f"uses {pl.num_gpus} GPUs > max_gpus {max_gpus}")
    return out


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


def _gap(request: PlanRequest, r: SimulationResult) -> float:
    """How far a simulated plan is from returnable: past memory (1 + GiB over on its fullest GPU) or
    past the limits (`Constraints.gap`), whichever is further."""
    memory = 0.0 if r.fits_memory else 1.0 + max(x.bytes_over for x in r.per_stage) / 2**30
    return max(memory, request.constraints.gap(usd_per_iteration=r.usd_per_iteration, usd_per_hour=r.usd_per_hour,
                                               iterations_per_s=r.throughput_iterations_per_s))


def _constraint_hint(request: PlanRequest) -> str:
    c = request.constraints
    hints = []
    if c.min_iterations_per_s is not None:
        hints.append("lower --min-iterations-per-s or add faster GPUs")
    if c.max_usd_per_iteration is not None or c.max_usd_per_hour is not None:
        hints.append("raise the budget or add cheaper (spot) GPUs")
    return "; ".join(hints)


def _memory_miss(book: ProfileBook, slots: Sequence[Slot], request: PlanRequest) -> str:
    """No split fits: the smallest pipeline that would fit in memory if the pool had the GPUs, or else
    the GPU, TP, microbatch and stage count within the pool that come closest, and why."""
    judges = {rc: SimCosts(book, precision=request.options.precision, recompute="always" if rc else "never")
              for rc in (False, True)}
    L = book.model.num_layers
    gpus = sum(s.capacity for s in slots)
    gpus = min(gpus, request.restrictions.max_gpus or gpus)
    modes = (False,) if request.options.recompute == "never" else (False, True)
    best: tuple[float, str] | None = None  # closest within the pool's GPUs
    fewest: tuple[int, str] | None = None  # the fewest GPUs of a pipeline that fits, beyond the pool's
    for s in slots:
        cap = book.gpu(s.gpu_type).memory_bytes
        for mbs, tp in book.profiled_points(s.gpu_type):
            if tp > s.gpus_per_node or tp not in book.model.tp_degrees:
                continue
            for p, rc in ((p, rc) for p in range(1, L + 1) for rc in modes):
                shape = f"{s.gpu_type} tp={tp} mbs={mbs} in {p} stage(s){' recomputing activations' if rc else ''}"
                if p * tp > gpus:
                    if (fewest is None or p * tp < fewest[0]) and packed_partition(judges[rc], s.gpu_type, tp, mbs,
                                                                                      p, L) is not None:
                        fewest = (p * tp, shape)
                    continue
                # 1F1B: stage i keeps p - i microbatches in flight; the worst stage sets the peak.
                worst = max(
                    (judges[rc].stage_memory(s.gpu_type, tp, a, b, mbs=mbs, in_flight=p - i, first_stage=i == 0,
                                             last_stage=i == p - 1)
                     for i, (a, b) in enumerate(uniform_partition(L, p))),
                    key=lambda m: m.total_bytes,
                )
                ratio = worst.total_bytes / cap
                if best is None or ratio < best[0]:
                    act = worst.activations_bytes / worst.total_bytes
                    best = (ratio, f"{shape} still needs {worst.total_bytes / 2**30:.1f} GiB on its fullest GPU of "
                                   f"{cap / 2**30:.0f} GiB ({act:.0%} activations of the microbatches in flight)")
    if fewest is not None:
        return (f"nothing fits in memory on the pool's {gpus} GPUs; the smallest pipeline that fits is {fewest[1]} "
                f"({fewest[0]} GPUs); to fix: add GPUs (at least {fewest[0]}) or GPUs with more memory")
    allow = ", allow activation recomputation (--recompute auto)" if request.options.recompute == "never" else ""
    return (f"nothing fits in memory; closest: {best[1] if best else 'no profiled GPU'}; to fix: add GPUs with "
            f"more memory or larger TP groups (profile a larger --tp){allow}, or use a smaller model")


def _frontier_sims(search: Search, slots: Sequence[Slot], request: PlanRequest, book: ProfileBook, so: SimOptions,
                   finish: Callable[[ParallelPlan], ParallelPlan] = lambda pl: pl
                   ) -> list[tuple[ParallelPlan, SimulationResult]]:
    """The estimated points' Pareto set (more iterations/s, fewer USD/iteration), made `finish`ed plans
    (`recomputed_as`) and simulated; those that fit."""
    pts = sorted(search.state.points, key=lambda p: (-p[0], p[1], p[2]))
    front: list[tuple[float, float, Sketch]] = []
    cheapest = float("inf")
    for thr, usd, sk in pts:
        if usd < cheapest - 1e-12:
            front.append((thr, usd, sk))
            cheapest = usd
    k = request.options.frontier_points
    if len(front) > k:  # keep the ends and evenly spaced points between
        idx = sorted({round(i * (len(front) - 1) / (k - 1)) for i in range(k)})
        front = [front[i] for i in idx]
    out = []
    for _, _, sk in front:
        lay = place(slots, sk)
        if lay is None:
            continue
        pl = materialize(sk, lay, slots, model=request.model, global_batch_size=request.global_batch_size,
                         precision=request.options.precision, schedule=request.options.schedule)
        pl = finish(pl)
        try:
            r = simulate(pl, book, options=so)
        except MissingProfileError:
            continue
        if r.fits_memory:
            out.append((pl, r))
    return out


def _pareto(sims: Sequence[tuple[ParallelPlan, SimulationResult]],
            chosen: tuple[ParallelPlan, SimulationResult] | None) -> tuple[FrontierPoint, ...]:
    """Pareto frontier of simulated plans plus the chosen one, fastest first; the chosen plan is marked."""
    pts = [
        FrontierPoint(
            iterations_per_s=r.throughput_iterations_per_s,
            usd_per_iteration=r.usd_per_iteration,
            usd_per_hour=r.usd_per_hour,
            num_gpus=r.num_gpus,
            summary=summarize(pl),
            plan=pl,
            chosen=chosen is not None and pl == chosen[0],
        )
        for pl, r in ([chosen] if chosen is not None else []) + [x for x in sims if chosen is None or x[0] != chosen[0]]
    ]
    # The chosen plan first among equals, so an identical point does not hide it.
    pts.sort(key=lambda f: (-f.iterations_per_s, f.usd_per_iteration, not f.chosen))
    pareto: list[FrontierPoint] = []
    cheapest = float("inf")
    for f in pts:
        if f.usd_per_iteration < cheapest - 1e-12:
            pareto.append(f)
            cheapest = f.usd_per_iteration
    return tuple(pareto)


def explain(request: PlanRequest, pl: ParallelPlan, r: SimulationResult, slots: Sequence[Slot],
            frontier: Sequence[FrontierPoint], gp: Goodput | None = None) -> str:
    """Why these GPUs, why this split: a few plain sentences."""
    goal = {
        Objective.MAX_THROUGHPUT: "the highest throughput",
        Objective.MIN_COST: "the lowest cost per iteration",
        Objective.MIN_COST_PER_TOKEN: "the lowest cost per million tokens",
        Objective.MAX_GOODPUT: "the most useful iterations per dollar with spot preemptions expected",
    }[request.objective]
    lines = [
        f"Chosen for {goal}: {sig(r.throughput_iterations_per_s)} it/s, {usd_text(r.usd_per_iteration)} USD/iteration, "
        f"{usd_text(r.usd_per_hour)} USD/hour on {pl.num_gpus} GPUs.",
        _explain_gpus(pl, slots),
        *_explain_shape(pl),
    ]
    b = r.breakdown
    lines.append(
        f"Iteration {r.iteration_time_s:.3f} s: pipeline compute {b.pipeline_compute_s:.3f} s, "
        f"p2p {b.pipeline_p2p_s:.3f} s, "
        f"exposed gradient sync {b.dp_sync_exposed_s:.3f} s, optimizer {b.optimizer_s:.3f} s."
    )
    if gp is not None and gp.preemptions_per_hour > 0:
        lines.append(_explain_risk(request, gp))
    binding = _explain_constraints(request, r)
    if binding:
        lines.append("Constraints: " + "; ".join(binding) + ".")
    if frontier:
        fastest = frontier[0]
        cheapest = frontier[-1]
        lines.append(
            f"Frontier: {len(frontier)} plans from {sig(fastest.iterations_per_s)} it/s "
            f"at {usd_text(fastest.usd_per_iteration)} USD/iteration "
            f"to {sig(cheapest.iterations_per_s)} it/s at {usd_text(cheapest.usd_per_iteration)} USD/iteration."
        )
    return "\n".join(lines)


def _explain_gpus(pl: ParallelPlan, slots: Sequence[Slot]) -> str:
    """One sentence: how many of the pool's GPUs of each type and market the plan uses."""
    used = pl.gpus_by_place()
    have: dict[tuple[str, str], int] = defaultdict(int)
    for s in slots:
        for _z, mk, n, _usd in s.offers or tuple((z, s.market, n, 0.0) for z, n in s.zones):
            have[(s.gpu_type, mk.value)] += n
    per_type: dict[tuple[str, str], int] = defaultdict(int)
    for (_, g, mk), n in used.items():
        per_type[(g, mk.value)] += n
    parts = [f"{per_type.get(k, 0)} of {n} {k[0]} ({k[1]})" for k, n in sorted(have.items())]
    return "GPUs used: " + ", ".join(parts) + "."


def _explain_shape(pl: ParallelPlan) -> list[str]:
    """Sentences on the split: one stage or how the layers were cut, and why GPU kinds share a stage."""
    lines = []
    kinds_per_stage = [{(x.gpu_type, x.tp) for x in st.replicas} for st in pl.stages]
    mixed = any(len(k) > 1 for k in kinds_per_stage)
    counts = sorted({p.num_microbatches for p in pl.pipelines})
    if pl.num_stages == 1 and not mixed:
        gpu, tp = next(iter(kinds_per_stage[0]))
        lines.append(
            f"One stage: the whole model fits on one {'GPU' if tp == 1 else f'{tp}-GPU TP group'} of {gpu}, "
            f"so every GPU runs data parallel ({pl.data_parallel} replicas) with no pipeline bubble."
        )
    else:
        sizes = [st.last_layer - st.first_layer + 1 for st in pl.stages]
        uniform = max(sizes) - min(sizes) <= 1
        lines.append(
            f"{pl.num_stages} pipeline stage(s) with {sizes} layers "
            f"({'an even split' if uniform else 'split to balance stage times on the chosen GPUs'}), "
            f"{pl.data_parallel} data-parallel pipelines."
        )
    if mixed:
        n_kinds = max(len(k) for k in kinds_per_stage)
        sizes_used = sorted({p.microbatch_size for p in pl.pipelines})
        words = {2: "two", 3: "three", 4: "four"}
        lines.append(
            f"Pipelines of {words.get(n_kinds, str(n_kinds))} GPU kinds share a stage (per-replica GPU type) to use "
            f"GPUs a single shape leaves idle; faster pipelines run more microbatches ({counts[0]} to {counts[-1]} "
            "each) so all finish together"
            + (f", each kind with its own microbatch size ({', '.join(map(str, sizes_used))})."
               if len(sizes_used) > 1 else ".")
        )
    return lines


def _explain_risk(request: PlanRequest, gp: Goodput) -> str:
    """One sentence: the expected preemptions and the share of time that trains."""
    risk = request.spot_risk
    return (
        f"Spot risk: {gp.preemptions_per_hour:.3g} preemptions/hour expected on its spot VMs; with checkpoints "
        f"every {risk.checkpoint_interval_steps} steps and {risk.reconfiguration_s:.0f} s to reconfigure, "
        f"{gp.useful_fraction:.1%} of the time trains: {gp.expected_iterations_per_s:.4f} useful it/s "
        f"(nominal {gp.nominal_iterations_per_s:.4f}), {usd_text(gp.expected_usd_per_useful_iteration)} USD per useful "
        f"iteration."
    )


def _explain_constraints(request: PlanRequest, r: SimulationResult) -> list[str]:
    """Each limit of the request beside what the plan uses of it."""
    c = request.constraints
    binding = []
    if c.max_usd_per_iteration is not None:
        binding.append(f"budget {c.max_usd_per_iteration:g} USD/iteration (uses {usd_text(r.usd_per_iteration)})")
    if c.max_usd_per_hour is not None:
        binding.append(f"budget {c.max_usd_per_hour:g} USD/hour (uses {r.usd_per_hour:.2f})")
    if c.min_iterations_per_s is not None:
        binding.append(f"minimum {c.min_iterations_per_s:g} it/s (runs {r.throughput_iterations_per_s:.4f})")
    return binding
