"""Planning inputs and outputs for the flow: pool from offerings, calibrated book, plan, estimates.

Contract (no Prefect): pure helpers around sailor_core's planner and simulator.
- `pool_from(offerings, held)`: what the planner may use now: the free capacity the provider offers
  plus the VMs this run already holds (a replan may keep them), at current prices.
- `priced_book(book, offerings)`: the book with the provider's current prices.
- `calibrated_book(book, factors)` (from sailor_core.profiles): layer times of each GPU type scaled by its online
  correction (measured / estimated iteration time), so the next plan uses what this machine really does.
- `book_now(book, offerings, factors)`: both, the book every plan of a run is made and priced with.
- `run_planner(request, book)`: the planner's answer (a `PlanResult` with a plan), or `NoPlanError` with its
  nearest miss.
- `chosen_plan(result)`: its plan and the simulator's estimate of it (a `SimulationResult`; the run
  history keeps its `to_json()`).
- `estimate(plan, book)`: the simulator's estimate of a plan on the (priced, calibrated) book.
- `plan_violations(estimate, ...)`: the limits an estimated plan breaks, each said in words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from infra.provider import Vm
from sailor_core.domain import Capacity, GpuPrice, Market, ParallelPlan, ResourcePool
from sailor_core.errors import NoPlanError
from sailor_core.planner import plan as planner_plan
from sailor_core.planner.request import Constraints, PlanRequest, PlanResult
from sailor_core.profiles import ProfileBook, calibrated_book
from sailor_core.simulator import simulate
from sailor_core.simulator.result import SimulationResult

__all__ = [
    "NoPlanError",
    "book_now",
    "calibrated_book",
    "chosen_plan",
    "estimate",
    "plan_violations",
    "pool_from",
    "priced_book",
    "run_planner",
]


def pool_from(offerings: Sequence[Capacity], held: Sequence[Vm] = ()) -> ResourcePool:
    entries: dict[tuple[str, str, Market], Capacity] = {}
    for o in offerings:
        # the pool keeps what the planner reads: not which VM shape, nor when its price was fetched
        e = replace(o, instance_type="", price_fetched_at=None)
        k = (e.zone, e.gpu_type, e.market)
        if k in entries:
            entries[k] = replace(entries[k], gpus=entries[k].gpus + e.gpus)
        else:
            entries[k] = e
    for vm in held:
        k = (vm.zone, vm.gpu_type, vm.market)
        if k in entries:
            entries[k] = replace(entries[k], gpus=entries[k].gpus + vm.gpus)
        else:
            region = next((o.region for o in offerings if o.zone == vm.zone), vm.zone)
            cloud = next((o.cloud for o in offerings if o.zone == vm.zone), "")
            entries[k] = Capacity(zone=vm.zone, region=region, gpu_type=vm.gpu_type, gpus=vm.gpus, market=vm.market,
                                  usd_per_gpu_hour=vm.usd_per_hour / max(vm.gpus, 1), cloud=cloud or "local")
    return ResourcePool(entries=tuple(e for e in entries.values() if e.gpus > 0))


def book_now(book: ProfileBook, offerings: Sequence[Capacity], factors: Mapping[str, float]) -> ProfileBook:
    """The book to plan with now: the offerings' current prices, layer times scaled by the online calibration."""
    return calibrated_book(priced_book(book, offerings), dict(factors))


def priced_book(book: ProfileBook, offerings: Sequence[Capacity]) -> ProfileBook:
    now = {(o.zone, o.gpu_type, o.market): o for o in offerings}
    prices = [p for p in book.prices if (p.zone, p.gpu_type, p.market) not in now]
    prices += [GpuPrice(cloud=o.cloud, zone=o.zone, gpu_type=o.gpu_type, market=o.market,
                        usd_per_gpu_hour=o.usd_per_gpu_hour, fetched_at=o.price_fetched_at) for o in now.values()]
    return replace(book, prices=tuple(prices))


def estimate(plan: ParallelPlan, book: ProfileBook) -> SimulationResult:

    return simulate(plan, book)


def run_planner(request: PlanRequest, book: ProfileBook) -> PlanResult:
    """The planner's answer to the request; NoPlanError (with the nearest miss) when nothing fits."""

    result = planner_plan(request, book)
    if result.plan is None or result.estimate is None:
        pool = request.pool
        raise NoPlanError(
            f"no plan fits the request with what can be rented now ({len(pool.entries)} pool entries, "
            f"{sum(e.gpus for e in pool.entries)} GPUs): {result.nearest_miss or result.explanation}; "
            f"to fix: relax the limits, allow more GPU types/markets, or wait for capacity"
        )
    return result


def chosen_plan(result: PlanResult) -> tuple[ParallelPlan, SimulationResult]:
    """The plan of an answer `run_planner` returned, and the simulator's estimate of it."""
    if result.plan is None or result.estimate is None:
        raise NoPlanError(f"the planner found no plan: {result.nearest_miss or result.explanation}")
    return result.plan, result.estimate


def plan_violations(est: SimulationResult, *, max_usd_per_iteration: float | None,
                    max_usd_per_hour: float | None, min_iterations_per_s: float | None) -> list[str]:

    c = Constraints(max_usd_per_iteration=max_usd_per_iteration, max_usd_per_hour=max_usd_per_hour,
                    min_iterations_per_s=min_iterations_per_s)
    return c.violations(usd_per_iteration=est.usd_per_iteration, usd_per_hour=est.usd_per_hour,
                        iterations_per_s=est.throughput_iterations_per_s)
