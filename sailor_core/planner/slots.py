"""Slots: the units of rentable capacity the search reasons about, grouped from a pool.

Contract: `Slot` is GPUs of one type in one region at one node shape and price (zones of a region
pooled, paper heuristic; the zones stay listed in fill order so a stage that spans zones is priced
and timed on the real cross-zone link), `Offer` one market's GPUs in a zone of a slot that pools
markets, `Layout` a stage's replicas zone by zone. `build_slots` groups a pool's entries into slots
(markets pooled where each has one price there; with `pool_regions`, one slot per GPU type across its
regions), numbered in a fixed order, so the same pool always gives the same slots; `spans_regions` says
whether the search across regions has anything to pool. Pure functions of a `ResourcePool`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import NamedTuple

from sailor_core.domain import Capacity, Market, Replica, ResourcePool


class Offer(NamedTuple):
    """One market's GPUs in one zone of a slot that pools markets."""

    zone: str
    market: Market
    gpus: int
    usd_per_gpu_hour: float


@dataclass(frozen=True, kw_only=True)
class Slot:
    """GPUs of one type in one region, zones in fill order.

    With `zone_regions` the slot spans regions (`core.build_slots(pool_regions=True)`): the same GPU
    type and node shape in every region of a cloud, so a stage's data-parallel replicas may sit in
    several regions; each zone keeps its own region (`region_of`), and `region` is the first zone's.

    Without `offers`: one market at one price (`market`, `usd_per_gpu_hour`). With `offers` (see
    `core.build_slots`), the markets of the type in each zone pooled: spot and on-demand GPUs of one
    type in one zone are the same hardware on the same links, so a stage's replicas may use both;
    `market` and `usd_per_gpu_hour` are then the cheapest offer's (a lower bound for the search's
    bounds and its DP), and `usd_per_hour` prices a placement exactly, each zone's cheapest market first.
    """

    index: int
    gpu_type: str
    market: Market
    region: str
    cloud: str
    gpus_per_node: int
    usd_per_gpu_hour: float
    zones: tuple[tuple[str, int], ...]  # (zone, GPUs), fill order: most GPUs first, then by name
    offers: tuple[Offer, ...] = ()  # pooled markets, cheapest first within each zone
    zone_regions: tuple[tuple[str, str], ...] = ()  # (zone, region) where the slot spans regions

    @property
    def capacity(self) -> int:
        return sum(n for _, n in self.zones)

    def region_of(self, zone: str) -> str:
        """The region of one of the slot's zones."""
        for z, r in self.zone_regions:
            if z == zone:
                return r
        return self.region

    def usd_per_hour(self, used: dict[str, int]) -> float:
        """USD per hour of `used` GPUs per zone: each zone's cheapest market first."""
        if not self.offers:
            return self.usd_per_gpu_hour * sum(used.values())
        total = 0.0
        for zone, n in used.items():
            dearest = self.usd_per_gpu_hour
            for z, _mk, count, price in self.offers:
                if z == zone and n > 0:
                    take = min(n, count)
                    total += take * price
                    n -= take
                    dearest = price
            total += n * dearest  # more than the zone offers: the search's layouts never ask for it
        return total

    def markets_of(self, zone: str, tp: int, k: int, free: dict[tuple[str, Market], int]) -> list[Market]:
        """The market of each of k tp-wide replicas in `zone`: the cheapest with room for a whole TP
        group (`free`: GPUs left per (zone, market), updated); the slot's market where none has room."""
        out = []
        for _ in range(k):
            for z, mk, count, _price in self.offers:
                if z == zone and free.setdefault((z, mk), count) >= tp:
                    free[(z, mk)] -= tp
                    out.append(mk)
                    break
            else:
                out.append(self.market)
        return out

    def replicas(self, zone: str, tp: int, k: int, free: dict[tuple[str, Market], int]) -> list[Replica]:
        """k tp-wide replicas in `zone`, each on its market (`markets_of`; one market without offers)."""
        markets = self.markets_of(zone, tp, k, free) if self.offers else [self.market] * k
        return [Replica(gpu_type=self.gpu_type, zone=zone, tp=tp, gpus_per_node=self.gpus_per_node, market=mk,
                        region=self.region_of(zone)) for mk in markets]

    def minus(self, used: dict[str, int]) -> Slot:
        """The slot less `used` GPUs per zone (taken from each zone's cheapest market first)."""
        offers = []
        left = dict(used)
        for z, mk, count, price in self.offers:
            take = min(count, left.get(z, 0))
            left[z] = left.get(z, 0) - take
            offers.append(Offer(z, mk, count - take, price))
        return replace(self, zones=tuple((z, n - used.get(z, 0)) for z, n in self.zones), offers=tuple(offers))

    def usable(self, gpus: int, tp: int) -> int:
        """GPUs of `gpus` that tp-wide groups can use: TP stays inside a node."""
        full, rest = divmod(gpus, self.gpus_per_node)
        return full * (self.gpus_per_node // tp) * tp + (rest // tp) * tp

    def label(self) -> str:
        zs = ",".join(z for z, _ in self.zones)
        markets = "+".join(dict.fromkeys(mk.value for _, mk, _, _ in self.offers)) or self.market.value
        regions = "+".join(dict.fromkeys(self.region_of(z) for z, _ in self.zones)) or self.region
        return f"{self.gpu_type} {markets} @ {regions} [{zs}]"


# A stage's replicas of one slot, zone by zone: ((zone, replicas), ...) in pipeline order.
Layout = tuple[tuple[str, int], ...]



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
