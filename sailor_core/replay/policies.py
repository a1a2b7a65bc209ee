"""Reaction policies: what a job does when availability or prices change. Each is a small pure
function of the `View` the engine shows it, returning an `Action` (stay, switch to a plan, wait).

- `sailor`: the flow's own loop (flows/replan.py), through the same decision core
  (`sailor_core.decisions.assess` and `choose`, which the replan subflow calls). At every change it
  re-plans against what can be rented now and switches when the gain over the remaining work pays
  for the reconfiguration and the steps redone; a plan that
  lost GPUs is always left, for whichever of the best plan on the GPUs it still holds, the best
  on everything available and its own shape moved to where it fits now finishes the remaining
  work soonest (or cheapest: `best_replacement`, ties to the plan on the GPUs still held), each
  charged its own start: one that needs new VMs also waits for them and for its state. With
  `weigh_replacements` off it shrinks first, as the replan subflow did before it weighed them (the
  best on the GPUs still held if there is one, else the best on everything).
- `relaunch_same`: what SkyPilot managed jobs do. Keep the first plan's shape (the same GPU types
  and counts, the same stages); when it loses GPUs, relaunch that shape wherever it fits now, each
  group of GPUs on the cheapest (zone, market) with room for it; if it fits nowhere, wait. Prices
  are never a reason to move.
- `static`: the first plan, on its own GPUs; when they go, wait until they are all back.
- `periodic`: the deployment's cost-aware rerun. Between scheduled runs (every `period_s`) nothing
  is re-planned and a plan that lost GPUs waits; at each scheduled run it re-plans and switches as
  `sailor` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from sailor_core.decisions import Option, choose, within_limits
from sailor_core.domain import Market, ParallelPlan, ResourcePool
from sailor_core.errors import MissingProfileError, SailorError
from sailor_core.replay.engine import Action, Policy, View, counts_of, missing_gpus

POLICIES = ("sailor", "relaunch-same", "static", "periodic")


def _first(v: View) -> Action:
    cand = v.planner.best(v.pool)
    if cand is None:
        return Action(kind="wait", reason="no feasible plan with the GPUs available now")
    return Action(kind="switch", plan=cand.plan, reason="best plan for the request")


def sailor(v: View) -> Action:
    if v.initial is None:
        return _first(v)
    a = v.assessment
    verdict = choose(a, _options(v), objective=v.job.objective, times=v.startup, min_gain=v.job.min_gain)
    return Action(kind=verdict.kind, plan=verdict.option.plan if verdict.option is not None else None,
                  reason=verdict.reason, decision=verdict.decision)


def _options(v: View) -> list[Option]:
    """The plans the assessment asks for (the best on the GPUs still held after a loss, the best on
    everything) and, after a loss, the lost plan's own shape moved to where it fits now. With
    `weigh_replacements` off, the flow's former rule: shrink onto the GPUs still held when a plan fits
    them (it starts in seconds; capacity elsewhere is weighed at the next change)."""
    a = v.assessment
    found: list[Option] = []
    for kind, req in a.requests:
        cand = v.planner.best(req.pool)
        if cand is not None:
            found.append(Option(kind=kind, plan=cand.plan, replacement=v.replacement(cand.plan, cand.cost)))
    if a.lost and not v.job.weigh_replacements:
        return found[:1]
    if a.move_current and v.current is not None:
        limits = a.requests[-1][1]
        moved = relocate(v.current, limits.restrictions.apply(v.pool), limits.restrictions.markets, _priceable(v))
        if moved is not None and all(moved != o.plan for o in found):
            cost = v.planner.cost(moved, v.pool)
            if within_limits(limits, cost):
                found.append(Option(kind="moved", plan=moved, replacement=v.replacement(moved, cost)))
    return found


def relocate(plan: ParallelPlan, pool: ResourcePool, markets: tuple[Market, ...] = (),
             usable: Callable[[ParallelPlan], bool] = lambda p: True) -> ParallelPlan | None:
    """The same plan moved to where it fits now, cheapest first; None if it fits nowhere.

    SkyPilot relaunches a job's cluster in one zone: the whole plan moves to the cheapest zone that
    has room for all of its GPUs (its own zone first at equal price); a plan that spanned zones
    and fits in no single one keeps its zones' grouping, each group moved greedily to the
    cheapest zone with room. Inside a zone each replica takes the cheapest market with room for
    its TP group. `usable` rejects a move the simulator cannot price (no network profile there).
    """
    free0 = counts_of(pool)
    price = {(e.zone, e.gpu_type, e.market): e.usd_per_gpu_hour for e in pool.entries}
    region = {e.zone: e.region for e in pool.entries}
    zones = sorted({e.zone for e in pool.entries})
    own = sorted({r.zone for st in plan.stages for r in st.replicas})

    def place(reps_by_zone: dict[str, str]) -> ParallelPlan | None:
        free = dict(free0)
        stages = []
        for st in plan.stages:
            reps = []
            for r in st.replicas:
                z = reps_by_zone[r.zone]
                opts = sorted((price[k], k[2] != r.market, k[2].value, k) for k, c in free.items()
                              if k[0] == z and k[1] == r.gpu_type and c >= r.tp and (not markets or k[2] in markets))
                if not opts:
                    return None
                k = opts[0][3]
                free[k] -= r.tp
                reps.append(replace(r, zone=z, market=k[2], region=region.get(z, r.region)))
            stages.append(replace(st, replicas=tuple(reps)))
        return replace(plan, stages=tuple(stages))

    tried = []
    for z in zones:
        moved = place({o: z for o in own})
        if moved is not None:
            tried.append((_hourly(moved, price), z not in own, z, moved))
    if len(own) > 1:
        mapping: dict[str, str] = {}
        for o in own:
            for z in sorted(zones, key=lambda z: (z != o, z)):
                trial = place({**mapping, o: z, **{x: x for x in own if x not in mapping and x != o}})
                if trial is not None:
                    mapping[o] = z
                    break
        spread = place({o: mapping.get(o, o) for o in own})
        if spread is not None:
            tried.append((_hourly(spread, price), True, "~", spread))
    for _, _, _, cand in sorted(tried, key=lambda t: t[:3]):
        if cand == plan or usable(cand):
            return cand
    return None


def _hourly(plan: ParallelPlan, price: dict[tuple[str, str, Market], float]) -> float:
    return sum(n * price.get(k, 0.0) for k, n in plan.gpus_by_place().items())


def _priceable(v: View) -> Callable[[ParallelPlan], bool]:
    def ok(plan: ParallelPlan) -> bool:
        try:
            v.planner.cost(plan, v.pool)
        except MissingProfileError:
            return False
        return True
    return ok


def relaunch_same(v: View) -> Action:
    if v.initial is None:
        return _first(v)
    if v.current is not None and not v.lost:
        return Action(kind="stay", reason="the plan still has its GPUs", record=False)
    moved = relocate(v.initial, v.pool, v.job.restrictions.markets, _priceable(v))
    if moved is None:
        return Action(kind="wait", reason=f"the first plan's {v.initial.num_gpus} GPUs fit nowhere now; waiting")
    where = ", ".join(sorted(f"{n}x {g} {m.value} @{z}" for (z, g, m), n in moved.gpus_by_place().items()))
    return Action(kind="switch", plan=moved, reason=f"relaunched the same shape on {where}")


def static(v: View) -> Action:
    if v.initial is None:
        return _first(v)
    if v.current is not None and not v.lost:
        return Action(kind="stay", reason="the plan still has its GPUs", record=False)
    if missing_gpus(v.initial, v.pool):
        return Action(kind="wait", reason="waiting for the first plan's GPUs to come back")
    return Action(kind="switch", plan=v.initial, reason="the first plan's GPUs are back")


def periodic(v: View) -> Action:
    if v.initial is None:
        return _first(v)
    if "tick" in v.trigger:
        return sailor(v)
    if v.current is None or v.lost:
        return Action(kind="wait", reason="GPUs lost; waiting for the next scheduled run")
    return Action(kind="stay", reason="changes wait for the next scheduled run", record=False)


def policy_named(name: str) -> Policy:
    table: dict[str, Policy] = {"sailor": sailor, "relaunch-same": relaunch_same, "static": static,
                                "periodic": periodic}
    try:
        return table[name]
    except KeyError:
        raise SailorError(f"unknown policy {name!r}; to fix: use one of {', '.join(POLICIES)} or all") from None

