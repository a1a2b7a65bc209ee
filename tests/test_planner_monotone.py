"""More capacity never gives a worse plan (docs/planner.md, "Monotone in the pool").

A pool and the same pool grown by GPUs of an entry, a zone, a GPU type or a cheaper market, planned
with the same objective: the larger pool's chosen plan is at least as good on the objective, within
the planner's tolerance. The worlds have partial links (the third GPU type reaches the others only
inside its zone), as a user's store often has them: links that are missing rule out only the
plans that need them. The issue's own pools (four zones of A100-40 and V100-16, then GH-96 added,
whose links across zones the seed store has only in part) are planned on the shipped seed.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from profiles_store.store import open_store
from sailor_core.domain import Capacity, Market, ResourcePool
from sailor_core.planner import Objective, PlanRequest, SearchOptions, plan
from sailor_core.planner.verify import objective_value
from sailor_core.profiles import ProfileBook
from tests.planner_fixtures import MODEL, ZONES_2R, tiny_book

GPUS = ("fast", "slow", "mid")
OBJECTIVES = (Objective.MAX_THROUGHPUT, Objective.MIN_COST, Objective.MAX_THROUGHPUT)


def _book(seed: int) -> ProfileBook:
    """Three GPU types in four zones of two regions; "mid" has links only inside its own zone."""
    book = tiny_book(seed, gpus=GPUS, zones=ZONES_2R, memory_gib=(6.0, 3.0, 4.0))
    links = tuple(lk for lk in book.links
                  if "mid" not in (lk.sender_gpu, lk.receiver_gpu) or lk.sender_zone == lk.receiver_zone)
    return replace(book, links=links)


def _entry(book: ProfileBook, zone: str, gpu: str, n: int, market: Market = Market.ON_DEMAND,
           discount: float = 1.0) -> Capacity:
    base = book.price_usd_per_gpu_hour(zone, gpu, Market.ON_DEMAND) or 3.0
    return Capacity(zone=zone, region=zone[:2], gpu_type=gpu, gpus=n, gpus_per_vm=2, market=market,
                    usd_per_gpu_hour=round(base * discount, 4))


def _pools(seed: int, book: ProfileBook) -> tuple[ResourcePool, ResourcePool, str]:
    """A random pool and the same pool grown one way (seeded)."""
    rng = random.Random(seed)
    zones = rng.sample(ZONES_2R, rng.choice((1, 2)))
    small = [_entry(book, z, g, rng.choice((2, 4))) for z in zones for g in rng.sample(GPUS, rng.choice((1, 2)))]
    how = rng.choice(("gpus", "zone", "type", "market"))
    if how == "gpus":
        i = rng.randrange(len(small))
        grown = small[:i] + [replace(small[i], gpus=small[i].gpus + 2)] + small[i + 1:]
    elif how == "zone":
        z = rng.choice([z for z in ZONES_2R if z not in zones] or ZONES_2R)
        grown = small + [_entry(book, z, rng.choice(GPUS), rng.choice((2, 4)))]
    elif how == "type":
        have = {(e.zone, e.gpu_type) for e in small}
        new = rng.choice(GPUS)
        grown = small + [_entry(book, z, new, 2) for z in zones if (z, new) not in have]
    else:
        e = rng.choice(small)
        grown = small + [_entry(book, e.zone, e.gpu_type, 2, Market.SPOT, discount=0.4)]
    return ResourcePool(entries=tuple(small)), ResourcePool(entries=tuple(grown)), how


@pytest.mark.parametrize("seed", range(24))
def test_a_larger_pool_never_gets_a_worse_plan(seed: int) -> None:
    book = _book(seed)
    small, large, how = _pools(seed, book)
    objective = OBJECTIVES[seed % len(OBJECTIVES)]
    opts = SearchOptions(max_stages=3)
    got = [plan(PlanRequest(model=MODEL, global_batch_size=16, pool=p, objective=objective, options=opts), book)
           for p in (small, large)]
    if got[0].estimate is None:
        return  # nothing fits the smaller pool: any answer of the larger one is no worse
    assert got[1].estimate is not None, (how, got[1].nearest_miss)
    a, b = (objective_value(objective, r.estimate) for r in got)
    assert b <= a * (1 + opts.tolerance), f"seed {seed} (+{how}): {b:.6g} after, {a:.6g} before ({objective.value})"


def _zones_pool(book: ProfileBook, types: dict[str, int]) -> ResourcePool:
    zones = ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f")
    return ResourcePool(entries=tuple(
        Capacity(zone=z, region="us-central1", gpu_type=g, gpus=n, gpus_per_vm=book.gpu_types[g].gpus_per_node,
                 usd_per_gpu_hour=book.price_usd_per_gpu_hour(z, g, Market.ON_DEMAND))
        for z in zones for g, n in types.items()))


def test_gh96_added_to_four_zones_keeps_the_plan_without_it(tmp_path: Path) -> None:
    """The issue's pools: 0.523 it/s on A100-40 x32 + V100-16 x64 per zone, 0.4918 once GH-96 x16 per zone
    (links across zones only in part) was added."""
    book = open_store(str(tmp_path / "store")).profile_book("OPT-350")
    small = _zones_pool(book, {"A100-40": 32, "V100-16": 64})
    large = _zones_pool(book, {"A100-40": 32, "V100-16": 64, "GH-96": 16})
    its = [plan(PlanRequest(model="OPT-350", global_batch_size=1024, pool=p), book).estimate for p in (small, large)]
    assert its[0] is not None and its[1] is not None
    assert its[1].throughput_iterations_per_s >= its[0].throughput_iterations_per_s * 0.999, its
