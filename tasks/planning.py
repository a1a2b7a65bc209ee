"""Planning inputs and outputs for the flow: pool from offerings, calibrated book, plan, estimates.

Contract (no Prefect): pure helpers around sailor_core's planner and simulator.
- `pool_from(offerings, held)`: what the planner may use now: the free capacity the provider offers
  plus the VMs this run already holds (a replan may keep them), at current prices.
- `priced_book(book, offerings)`: the book with the provider's current prices.
- `calibrated_book(book, factors)` (from sailor_core.profiles): layer times of each GPU type scaled by its online correction
  (measured / estimated iteration time), so the next plan uses what this machine really does.
- `run_planner(...)`: the planner's best plan and frontier, or `NoPlanError` with its nearest miss.
- `estimate(plan, book)`: the simulator's estimate as a JSON dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from infra.provider import Offering, Vm
from sailor_core.domain import GpuPrice, Market, ParallelPlan, PoolEntry, ResourcePool, SailorError
from sailor_core.profiles import ProfileBook, calibrated_book

__all__ = ["NoPlanError", "calibrated_book", "estimate", "plan_violations", "pool_from", "priced_book", "run_planner"]


class NoPlanError(SailorError):
    """No plan satisfies the request with what can be rented now."""


def pool_from(offerings: Sequence[Offering], held: Sequence[Vm] = ()) -> ResourcePool:
    entries: dict[tuple[str, str, Market], PoolEntry] = {}
    for o in offerings:
        e = o.as_pool_entry()
        k = (e.zone, e.gpu_type, e.market)
        if k in entries:
            entries[k] = replace(entries[k], count=entries[k].count + e.count)
        else:
            entries[k] = e
    for vm in held:
        k = (vm.zone, vm.gpu_type, vm.market)
        if k in entries:
            entries[k] = replace(entries[k], count=entries[k].count + vm.gpus)
        else:
            region = next((o.region for o in offerings if o.zone == vm.zone), vm.zone)
            cloud = next((o.cloud for o in offerings if o.zone == vm.zone), "")
            entries[k] = PoolEntry(zone=vm.zone, region=region, gpu_type=vm.gpu_type, count=vm.gpus, market=vm.market,
                                   usd_per_gpu_hour=vm.usd_per_hour / max(vm.gpus, 1), cloud=cloud or "local")
    return ResourcePool(entries=tuple(e for e in entries.values() if e.count > 0))


def priced_book(book: ProfileBook, offerings: Sequence[Offering]) -> ProfileBook:
    now = {(o.zone, o.gpu_type, o.market): o for o in offerings}
    prices = [p for p in book.prices if (p.zone, p.gpu_type, p.market) not in now]
    prices += [GpuPrice(cloud=o.cloud, zone=o.zone, gpu_type=o.gpu_type, market=o.market,
                        usd_per_gpu_hour=o.usd_per_gpu_hour, fetched_at=o.price_fetched_at) for o in now.values()]
    return replace(book, prices=tuple(prices))


def estimate(plan: ParallelPlan, book: ProfileBook) -> dict[str, Any]:
    from sailor_core.simulator import simulate

    return dict(simulate(plan, book).to_json())


def run_planner(*, model: str, global_batch_size: int, pool: ResourcePool, book: ProfileBook, objective: str,
                max_usd_per_iteration: float | None, max_usd_per_hour: float | None,
                min_iterations_per_s: float | None, clouds: Sequence[str] | None, regions: Sequence[str] | None,
                gpu_types: Sequence[str] | None, markets: Sequence[str] | None, max_gpus: int | None,
                max_stages: int | None = None) -> Any:
    from sailor_core.planner import plan as planner_plan
    from sailor_core.planner.request import Constraints, PlanRequest, Restrictions, SearchOptions

    req = PlanRequest(
        model=model, global_batch_size=global_batch_size, pool=pool, objective=objective,
        constraints=Constraints(max_usd_per_iteration=max_usd_per_iteration, max_usd_per_hour=max_usd_per_hour,
                                min_iterations_per_s=min_iterations_per_s),
        restrictions=Restrictions(clouds=tuple(clouds or ()), regions=tuple(regions or ()),
                                  gpu_types=tuple(gpu_types or ()), markets=tuple(markets or ()), max_gpus=max_gpus),
        options=SearchOptions(max_stages=max_stages) if max_stages else SearchOptions(),
    )
    result = planner_plan(req, book)
    if result.plan is None:
        raise NoPlanError(
            f"no plan fits the request with what can be rented now ({len(pool.entries)} pool entries, "
            f"{sum(e.count for e in pool.entries)} GPUs): {result.nearest_miss or result.explanation}; "
            f"to fix: relax the limits, allow more GPU types/markets, or wait for capacity"
        )
    return result


def plan_violations(estimate_json: Mapping[str, Any], *, max_usd_per_iteration: float | None,
                    max_usd_per_hour: float | None, min_iterations_per_s: float | None) -> list[str]:
    from sailor_core.planner.request import Constraints

    c = Constraints(max_usd_per_iteration=max_usd_per_iteration, max_usd_per_hour=max_usd_per_hour,
                    min_iterations_per_s=min_iterations_per_s)
    return c.violations(usd_per_iteration=float(estimate_json["usd_per_iteration"]),
                        usd_per_hour=float(estimate_json["usd_per_hour"]),
                        iterations_per_s=float(estimate_json["throughput_iterations_per_s"]))
