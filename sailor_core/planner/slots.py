"""Slots: the units of rentable capacity the search reasons about, grouped from a pool.

Contract: pure functions of a `ResourcePool`. `build_slots` groups the pool's entries into `Slot`s
(one GPU type in one region at one node shape, its zones pooled; markets pooled where each has one
price there; with `pool_regions`, one slot per GPU type across its regions), numbered in a fixed
order, so the same pool always gives the same slots. `spans_regions` says whether the search across
regions has anything to pool.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from sailor_core.domain import Capacity, ResourcePool
from sailor_core.planner.costs import Offer, Slot


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
        parts, pooled = _parts(entries, gpn, pool_markets=pool_markets, pool_regions=pool_regions)
        made += [_slot(gpu, cloud, region, gpn, part, pooled=pooled) for part in parts]
    made.sort(key=lambda ks: ks[0])
    return tuple(replace(slot, index=i) for i, (_, slot) in enumerate(made))


def _parts(entries: list[Capacity], gpn: int, *, pool_markets: bool, pool_regions: bool
           ) -> tuple[list[list[Capacity]], bool]:
    """(the entries of one (GPU type, cloud, region, node shape) that share a slot, whether markets pool):
    all of them when their markets pool (one price per market), else one part per (market, price)."""
    prices = {(e.market, e.usd_per_gpu_hour) for e in entries}
    # whole VMs only: a zone's pooled GPUs then form as many TP groups as its markets do apart
    vms = any(e.gpus % gpn for e in entries)
    if pool_regions:  # offers price each zone exactly: apart only when markets must stay apart or VMs are not whole
        split = len(prices) == 1 or vms or (not pool_markets and len({m for m, _ in prices}) > 1)
    else:
        split = not pool_markets or len(prices) == 1 or len(prices) > len({m for m, _ in prices}) or vms
    if not split:
        return [entries], True
    parts: dict[tuple[str, float], list[Capacity]] = defaultdict(list)
    for e in entries:
        parts[(e.market.value, e.usd_per_gpu_hour)].append(e)
    return list(parts.values()), False


def _slot(gpu: str, cloud: str, region: str, gpn: int, part: list[Capacity], *, pooled: bool
          ) -> tuple[tuple[object, ...], Slot]:
    """(sort key, slot) of one part: zones by GPUs (most first, then name), its offers when markets pool."""
    total: dict[str, int] = defaultdict(int)
    for e in part:
        total[e.zone] += e.gpus
    zones = tuple(sorted(total.items(), key=lambda zc: (-zc[1], zc[0])))
    rank = {z: i for i, (z, _) in enumerate(zones)}
    offers = tuple(sorted((Offer(e.zone, e.market, e.gpus, e.usd_per_gpu_hour) for e in part),
                          key=lambda o: (rank[o.zone], o.usd_per_gpu_hour, o.market.value))) if pooled else ()
    regions = {e.zone: e.region for e in part}
    cheapest = min(part, key=lambda e: (e.usd_per_gpu_hour, e.market.value))
    key = (gpu, cheapest.market.value, cloud, region, gpn, cheapest.usd_per_gpu_hour)
    return key, Slot(index=0, gpu_type=gpu, market=cheapest.market, region=regions[zones[0][0]], cloud=cloud,
                     gpus_per_node=gpn, usd_per_gpu_hour=cheapest.usd_per_gpu_hour, zones=zones, offers=offers,
                     zone_regions=tuple((z, regions[z]) for z, _ in zones) if len(set(regions.values())) > 1 else ())


def spans_regions(pool: ResourcePool) -> bool:
    """Whether some GPU type (of one cloud and node shape) is offered in more than one region."""
    regions: dict[tuple[str, str, int], set[str]] = defaultdict(set)
    for e in pool.entries:
        if e.gpus > 0:
            regions[(e.gpu_type, e.cloud, e.gpus_per_vm)].add(e.region)
    return any(len(r) > 1 for r in regions.values())
