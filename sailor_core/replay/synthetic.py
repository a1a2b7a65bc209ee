"""Synthetic availability and price traces, for replaying policies at scale.

Contract: `synthetic_trace(spec, prices, gpus_per_node)` is a pure, seeded function (same spec,
same trace). Every place (zone x GPU type x market) starts with its share of `total_gpus`
(rounded down to whole nodes) and the store's on-demand price (spot: that price times
`1 - spot_discount`). Time advances on a grid of `step_s`; in each step, independently:

- spot preemption waves: a spot place at full capacity loses a uniform 50-100% of it with
  probability `preemptions_per_day * step_s / 1 day`, running VMs included (a job holding GPUs
  there loses them: the point's `taken`); a place below full capacity gets it back with
  probability `step_s / recovery_s` (a geometric wait of mean `recovery_s`);
- regional outages: with probability `stockouts_per_week * step_s / 1 week` a region's on-demand
  capacity drops to 0 for `stockout_s` (a trace's count is what a job may hold, so VMs go too);
- spot price moves: the price of a GPU type in a region (clouds price per region, so its zones
  move together) is multiplied by exp(N(0, price_volatility)) with probability
  `price_changes_per_day * step_s / 1 day`, kept between 10% and 100% of the on-demand price.

Only grid points where something changed become trace points.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from sailor_core.domain import Market, default_region
from sailor_core.errors import SailorError
from sailor_core.replay.trace import Place, PriceLookup, Trace, TracePoint

# The Sailor artifact's five zones: the store has measured links and egress prices between them.
ARTIFACT_ZONES = ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-west1-b")
DAY_S = 86_400.0
WEEK_S = 7 * DAY_S
# Spot VMs cost 60-91% less than on-demand (GCP's published Spot VM discount range); the default
# takes the least discount, the conservative end for a spot-heavy policy.
SPOT_DISCOUNT = 0.60


@dataclass(frozen=True, kw_only=True)
class SyntheticSpec:
    zones: tuple[str, ...] = ARTIFACT_ZONES
    gpu_types: tuple[str, ...] = ("A100-40", "V100-16", "GH-96")
    markets: tuple[Market, ...] = (Market.ON_DEMAND, Market.SPOT)
    total_gpus: int = 2048
    days: float = 14.0
    step_s: float = 3600.0
    preemptions_per_day: float = 0.2
    recovery_s: float = 6 * 3600.0
    stockouts_per_week: float = 0.5
    stockout_s: float = 12 * 3600.0
    price_changes_per_day: float = 0.25
    price_volatility: float = 0.15
    spot_discount: float = SPOT_DISCOUNT
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.zones and self.gpu_types and self.markets):
            raise SailorError("a synthetic trace needs at least one zone, GPU type and market; to fix: name them")
        if self.total_gpus < 1 or self.days <= 0 or self.step_s <= 0:
            raise SailorError(f"synthetic trace: total_gpus ({self.total_gpus}), days ({self.days}) and step_s "
                              f"({self.step_s}) must be > 0; to fix: pass positive values")
        if not 0 <= self.spot_discount < 1:
            raise SailorError(f"synthetic trace: spot_discount must be in [0, 1), got {self.spot_discount}")


def synthetic_trace(spec: SyntheticSpec, prices: PriceLookup, gpus_per_node: Callable[[str], int]) -> Trace:
    rng = random.Random(spec.seed)
    places = tuple(Place(zone=z, gpu_type=g, market=m, region=default_region(z), gpus_per_node=gpus_per_node(g))
                   for z in spec.zones for g in spec.gpu_types for m in spec.markets)
    share = spec.total_gpus // len(places)
    full = [max(p.gpus_per_node, share // p.gpus_per_node * p.gpus_per_node) for p in places]
    on_demand: dict[tuple[str, str], float] = {}
    for z in spec.zones:
        for g in spec.gpu_types:
            od = prices(z, g, Market.ON_DEMAND)
            if od is None:
                raise SailorError(f"synthetic trace: no on-demand price for {g} in {z}; to fix: import prices into "
                                  f"the store (sailor profiles import-prices) or choose other GPU types")
            on_demand[(default_region(z), g)] = float(od)
    spot = {k: v * (1 - spec.spot_discount) for k, v in on_demand.items()}
    counts = list(full)
    out_until: dict[str, float] = {}  # region -> end of its on-demand stockout
    p_preempt = min(1.0, spec.preemptions_per_day * spec.step_s / DAY_S)
    p_recover = min(1.0, spec.step_s / spec.recovery_s) if spec.recovery_s > 0 else 1.0
    p_stockout = min(1.0, spec.stockouts_per_week * spec.step_s / WEEK_S)
    p_price = min(1.0, spec.price_changes_per_day * spec.step_s / DAY_S)
    regions = sorted({p.region for p in places})

    def price_row() -> tuple[float, ...]:
        return tuple(
            round(spot[(p.region, p.gpu_type)] if p.market is Market.SPOT else on_demand[(p.region, p.gpu_type)], 4)
            for p in places
        )

    points = [TracePoint(at_s=0.0, counts=tuple(counts), usd_per_gpu_hour=price_row())]
    steps = int(math.ceil(spec.days * DAY_S / spec.step_s))
    for n in range(1, steps + 1):
        t = n * spec.step_s
        for r in regions:
            if r not in out_until and rng.random() < p_stockout:
                out_until[r] = t + spec.stockout_s
            elif r in out_until and t >= out_until[r]:
                del out_until[r]
        taken = [0] * len(places)
        for k, p in enumerate(places):
            if p.market is Market.SPOT:
                if counts[k] == full[k]:
                    if rng.random() < p_preempt:
                        keep = rng.uniform(0.0, 0.5) * full[k]
                        counts[k] = int(keep) // p.gpus_per_node * p.gpus_per_node
                        taken[k] = full[k] - counts[k]  # running VMs are reclaimed, not only free ones
                elif rng.random() < p_recover:
                    counts[k] = full[k]
            else:
                counts[k] = 0 if p.region in out_until else full[k]
        for key in sorted(spot):
            if rng.random() < p_price:
                moved = spot[key] * math.exp(rng.gauss(0.0, spec.price_volatility))
                spot[key] = min(on_demand[key], max(0.1 * on_demand[key], moved))
        pt = TracePoint(at_s=t, counts=tuple(counts), usd_per_gpu_hour=price_row(),
                        taken=tuple(taken) if any(taken) else ())
        if pt.counts != points[-1].counts or pt.usd_per_gpu_hour != points[-1].usd_per_gpu_hour:
            points.append(pt)
    name = (f"synthetic: {len(spec.zones)} zones x {len(spec.gpu_types)} GPU types x {len(spec.markets)} markets, "
            f"{sum(full)} GPUs, {spec.days:g} days, seed {spec.seed}")
    return Trace(name=name, places=places, points=tuple(points))
