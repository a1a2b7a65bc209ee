"""The verify step: sketches become plans, plans are simulated, the best is chosen, the frontier drawn.

Contract: pure functions. `materialize` turns a placed sketch into a `ParallelPlan`; `verify`
simulates plans with the full `simulate()` (each on its cheapest markets) and returns a
`Verification`: the plans that meet every limit and fit the pool and memory (`Verified`, with their
objective value), the closest miss, and the links a plan needed that have no network profile (a
value, not a side effect). `choose` takes the best on the objective (the other goal only breaks
exact ties); `frontier_plans` simulates the Pareto set of the search's estimated points and `pareto`
draws the frontier of the simulated plans that meet every limit, so it never shows a plan better on
the objective than the chosen one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from sailor_core.domain import Market, ParallelPlan, ResourcePool, split_batch
from sailor_core.errors import MissingProfileError
from sailor_core.planner.costs import SimCosts
from sailor_core.planner.explain import summarize
from sailor_core.planner.placement import place, stages_of
from sailor_core.planner.request import FrontierPoint, Objective, PlanRequest
from sailor_core.planner.risk import goodput
from sailor_core.planner.scoring import score, secondary
from sailor_core.planner.slots import Slot
from sailor_core.planner.space import Point, Sketch
from sailor_core.profiles import ProfileBook
from sailor_core.simulator import SimOptions, SimulationResult, simulate

# Objective values this close (relative) are one value: the other goal decides (float noise only).
EXACT = 1e-9


@dataclass(frozen=True)
class Verified:
    """A simulated plan that meets every limit, fits memory and the pool, with its objective value."""

    value: float
    plan: ParallelPlan
    result: SimulationResult


@dataclass(frozen=True)
class Miss:
    """A simulated plan that breaks a limit or memory: how far (`Constraints.gap`, or 1 + GiB over) and why."""

    gap: float
    why: str


@dataclass(frozen=True)
class Verification:
    simulated: int
    feasible: tuple[Verified, ...]
    closest: Miss | None
    missing_links: frozenset[str]  # links a plan needed without a network profile (MissingProfileError.what)


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
    """`scoring.secondary` of a simulated plan: the other goal (lower is better)."""
    return secondary(objective, iteration_s=r.iteration_time_s, usd_per_iteration=r.usd_per_iteration)


def choose(objective: Objective, options: Sequence[Verified],
           other: Callable[[ParallelPlan, SimulationResult], float] | None = None) -> Verified | None:
    """The best plan on the objective; of plans equal on it (within `EXACT`), the best on the other goal
    (cheapest under max throughput, fastest under the cost objectives, or `other`), then the first seen."""
    if not options:
        return None
    best = min(o.value for o in options)
    tie = other or (lambda _pl, r: secondary_value(objective, r))
    return min((o for o in options if o.value <= best * (1 + EXACT)), key=lambda o: tie(o.plan, o.result))


def near_alternative(objective: Objective, chosen: Verified, options: Sequence[Verified], tolerance: float
                     ) -> Verified | None:
    """The plan best on the other goal among those within `tolerance` of the chosen one on the objective,
    where it is better on it than the chosen plan by more than the tolerance (what the explanation offers)."""
    near = [o for o in options if o.value <= chosen.value * (1 + tolerance)]
    alt = min(near, key=lambda o: secondary_value(objective, o.result), default=None)
    if alt is None or secondary_value(objective, alt.result) >= secondary_value(objective, chosen.result) * (
            1 - tolerance):
        return None
    return alt


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


def verify(request: PlanRequest, book: ProfileBook, pool: ResourcePool, plans: Sequence[ParallelPlan],
           so: SimOptions, value: Callable[[ParallelPlan, SimulationResult], float], *, both_markets: bool = False
           ) -> Verification:
    """Simulates each plan on its cheapest markets (and as it is, with `both_markets`: under spot risk the
    cheapest market may also be the riskier one): the plans that meet every limit, the closest miss,
    and the links plans needed without a network profile."""
    simulated = 0
    feasible: list[Verified] = []
    closest: Miss | None = None
    missing: set[str] = set()
    variants = [cheapest_markets(p, pool) for p in plans] + (list(plans) if both_markets else [])
    for pl in dict.fromkeys(variants):
        try:
            r = simulate(pl, book, options=so)
        except MissingProfileError as e:  # e.g. a ring mixing two GPU types with no measured link between them
            missing.add(_in_words(e))
            continue
        simulated += 1
        why = problems(request, pool, pl, r)
        if why:
            gap = miss_gap(request, r)
            if closest is None or gap < closest.gap:
                closest = Miss(gap=gap, why=f"{summarize(pl)}: " + "; ".join(why))
            continue
        feasible.append(Verified(value=value(pl, r), plan=pl, result=r))
    return Verification(simulated=simulated, feasible=tuple(feasible), closest=closest,
                        missing_links=frozenset(missing))


def _in_words(e: MissingProfileError) -> str:
    """A missing profile as the planner lists it: a link as its two ends (the words of `link_gaps`),
    whatever group sizes the plan asked for; anything else as the error says it."""
    if e.link is None:
        return e.what
    zone_a, type_a, _, zone_b, type_b, _ = e.link
    a, b = sorted([(type_a, zone_a), (type_b, zone_b)])
    return f"{a[0]} in {a[1]} <-> {b[0]} in {b[1]}"


def problems(request: PlanRequest, pool: ResourcePool, pl: ParallelPlan, r: SimulationResult) -> list[str]:
    """Why a simulated plan cannot be returned: a broken limit, more GPUs than the pool, memory."""
    out = request.constraints.violations(
        usd_per_iteration=r.usd_per_iteration, usd_per_hour=r.usd_per_hour,
        iterations_per_s=r.throughput_iterations_per_s,
    )
    out.extend(_over_pool(pl, pool, request.restrictions.max_gpus))
    lo, hi = request.options.min_stages, request.options.max_stages
    if not lo <= pl.num_stages <= hi:
        out.append(f"has {pl.num_stages} pipeline stages, outside {lo}-{hi}")
    if not r.fits_memory:
        worst = r.oom[0]
        out.append(f"stage {worst.stage} replica {worst.replica} is {worst.bytes_over / 2**30:.2f} GiB over memory")
    return out


def _over_pool(pl: ParallelPlan, pool: ResourcePool, max_gpus: int | None) -> list[str]:
    """A plan may use no more GPUs than the pool offers per (zone, type, market), nor than max_gpus."""
    have = {(e.zone, e.gpu_type, e.market): e.gpus for e in pool.entries}
    out = [f"uses {n} {g} ({mk.value}) in {z} but the pool has {have.get((z, g, mk), 0)}"
           for (z, g, mk), n in pl.gpus_by_place().items() if n > have.get((z, g, mk), 0)]
    if max_gpus is not None and pl.num_gpus > max_gpus:
        out.append(f"uses {pl.num_gpus} GPUs > max_gpus {max_gpus}")
    return out


def miss_gap(request: PlanRequest, r: SimulationResult) -> float:
    """How far a simulated plan is from returnable: past memory (1 + GiB over on its fullest GPU) or
    past the limits (`Constraints.gap`), whichever is further."""
    memory = 0.0 if r.fits_memory else 1.0 + max(x.bytes_over for x in r.per_stage) / 2**30
    return max(memory, request.constraints.gap(usd_per_iteration=r.usd_per_iteration, usd_per_hour=r.usd_per_hour,
                                               iterations_per_s=r.throughput_iterations_per_s))


def goodput_wanted(request: PlanRequest) -> bool:
    """Whether plans are scored by goodput: max-goodput with some spot risk."""
    return request.objective is Objective.MAX_GOODPUT and not request.spot_risk.riskless


def value_of(request: PlanRequest) -> Callable[[ParallelPlan, SimulationResult], float]:
    """The objective value of a simulated plan (its useful fraction counted under max-goodput)."""
    risk = request.spot_risk
    wanted = goodput_wanted(request)

    def value(pl: ParallelPlan, r: SimulationResult) -> float:
        u = goodput(pl, r.iteration_time_s, r.usd_per_iteration, risk).useful_fraction if wanted else 1.0
        return objective_value(request.objective, r, u)

    return value


def expected_time_of(request: PlanRequest) -> Callable[[ParallelPlan, SimulationResult], float] | None:
    """Under max-goodput, the expected seconds per useful iteration of a simulated plan; else None."""
    if not goodput_wanted(request):
        return None
    risk = request.spot_risk

    def expected_time(pl: ParallelPlan, r: SimulationResult) -> float:
        g = goodput(pl, r.iteration_time_s, r.usd_per_iteration, risk)
        return 1.0 / g.expected_iterations_per_s if g.expected_iterations_per_s > 0 else float("inf")

    return expected_time


def frontier_plans(points: Sequence[Point], slots: Sequence[Slot], request: PlanRequest, book: ProfileBook,
                   so: SimOptions, finish: Callable[[ParallelPlan], ParallelPlan] = lambda pl: pl
                   ) -> list[tuple[ParallelPlan, SimulationResult]]:
    """The estimated points' Pareto set (more iterations/s, fewer USD/iteration), thinned to
    `SearchOptions.frontier_points`, made `finish`ed plans (`recomputed_as`) and simulated; those that fit."""
    front: list[Point] = []
    cheapest = float("inf")
    for pt in sorted(points, key=lambda p: (-p.iterations_per_s, p.usd_per_iteration, p.sketch)):
        if pt.usd_per_iteration < cheapest - 1e-12:
            front.append(pt)
            cheapest = pt.usd_per_iteration
    k = request.options.frontier_points
    if len(front) > k:  # keep the ends and evenly spaced points between
        idx = sorted({round(i * (len(front) - 1) / (k - 1)) for i in range(k)})
        front = [front[i] for i in idx]
    out = []
    for pt in front:
        lay = place(slots, pt.sketch)
        if lay is None:
            continue
        pl = finish(materialize(pt.sketch, lay, slots, model=request.model,
                                global_batch_size=request.global_batch_size, precision=request.options.precision,
                                schedule=request.options.schedule))
        try:
            r = simulate(pl, book, options=so)
        except MissingProfileError:
            continue
        if r.fits_memory:
            out.append((pl, r))
    return out


def pareto(options: Sequence[Verified], chosen: Verified | None) -> tuple[FrontierPoint, ...]:
    """The Pareto frontier (more it/s for fewer USD/iteration) of the plans that meet every limit, the
    chosen one marked, fastest first. Every point meets the request's limits and competed for the choice,
    so none is better on the objective than the chosen plan."""
    others = [o for o in options if chosen is None or o.plan != chosen.plan]
    pts = [
        FrontierPoint(
            iterations_per_s=o.result.throughput_iterations_per_s,
            usd_per_iteration=o.result.usd_per_iteration,
            usd_per_hour=o.result.usd_per_hour,
            num_gpus=o.result.num_gpus,
            summary=summarize(o.plan),
            plan=o.plan,
            chosen=chosen is not None and o.plan == chosen.plan,
        )
        for o in ([chosen] if chosen is not None else []) + others
    ]
    # The chosen plan first among equals, so an identical point does not hide it.
    pts.sort(key=lambda f: (-f.iterations_per_s, f.usd_per_iteration, not f.chosen))
    out: list[FrontierPoint] = []
    cheapest = float("inf")
    for f in pts:
        if f.usd_per_iteration < cheapest - 1e-12:
            out.append(f)
            cheapest = f.usd_per_iteration
    return tuple(out)
