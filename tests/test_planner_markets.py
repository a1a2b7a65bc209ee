"""Spot and on-demand GPUs of one type in one zone are one kind of hardware: a stage may use both.

The trace replay (docs/replay.md) found the planner missing a plan 1.9x faster on a pool like the
one below: 68 spot + 68 on-demand GH-96 in one zone hold a 128-replica, one-stage plan, but each
market was a separate slot and a stage's replicas had to stay in one slot, so no single-shape plan
held more than 68 of them and the mixed-pipeline passes started from other shapes.
"""

from __future__ import annotations

import pytest

from sailor_core.domain import Capacity, Market, ParallelPlan, PipelineBatch, Replica, ResourcePool, Stage
from sailor_core.planner import PlanRequest, SearchOptions, build_slots, plan
from sailor_core.planner.estimate import usd_per_hour
from sailor_core.planner.placement import place
from sailor_core.planner.space import Sketch
from sailor_core.planner.verify import materialize, sim_options
from sailor_core.simulator import simulate
from tests.test_planner import seed_book

GH = "GH-96"
ZONE, REGION = "us-west1-b", "us-west1"
SPOT_USD, ON_DEMAND_USD = 3.6464, 11.06
# The replay's narrowed search (sailor_core.replay.FAST_SEARCH), spelled out: the planner must find it there too.
FAST = SearchOptions(patience=1, mixed_pipelines=4, max_shapes=1, rescore_top=4, exhaustive_partitions_up_to=8)


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    return seed_book("OPT-350", tmp_path_factory.mktemp("store"))


def _pool(spot: int, on_demand: int) -> ResourcePool:
    return ResourcePool(entries=(
        Capacity(zone=ZONE, region=REGION, gpu_type=GH, gpus=spot, market=Market.SPOT, gpus_per_vm=4,
                  usd_per_gpu_hour=SPOT_USD),
        Capacity(zone=ZONE, region=REGION, gpu_type=GH, gpus=on_demand, market=Market.ON_DEMAND,
                  gpus_per_vm=4, usd_per_gpu_hour=ON_DEMAND_USD),
    ))


def _one_stage(spot: int, on_demand: int, num_layers: int) -> ParallelPlan:
    reps = [Replica(gpu_type=GH, zone=ZONE, tp=1, gpus_per_node=4, market=Market.SPOT, region=REGION)] * spot
    reps += [Replica(gpu_type=GH, zone=ZONE, tp=1, gpus_per_node=4, market=Market.ON_DEMAND, region=REGION)] * on_demand
    d = spot + on_demand
    return ParallelPlan(model="OPT-350", global_batch_size=1024,
                        stages=(Stage(first_layer=0, last_layer=num_layers - 1, replicas=tuple(reps)),),
                        pipelines=tuple(PipelineBatch(microbatch_size=8, num_microbatches=1024 // 8 // d)
                                        for _ in range(d)))


@pytest.mark.parametrize("options", [SearchOptions(), FAST], ids=["full", "fast"])
def test_a_stage_uses_both_markets_of_a_zone(book, options: SearchOptions) -> None:
    pool = _pool(68, 68)
    known = simulate(_one_stage(68, 60, book.model.num_layers), book, options=sim_options(pool, "fp32", "1f1b"))
    assert known.fits_memory
    res = plan(PlanRequest(model="OPT-350", global_batch_size=1024, pool=pool, options=options), book)
    assert res.plan is not None and res.estimate is not None
    # before: 2 stages x 16 pipelines (tp4), 1.43 s/step against this plan's 0.75
    assert res.estimate.iteration_time_s <= known.iteration_time_s * (1 + options.tolerance)
    assert any({r.market for r in st.replicas} == {Market.SPOT, Market.ON_DEMAND} for st in res.plan.stages)
    # cheapest first: every spot GPU before any on-demand one
    assert res.plan.gpus_by_place().get((ZONE, GH, Market.SPOT)) == 68


def test_pooled_slot_prices_cheapest_market_first_and_materialises_within_each_market(book) -> None:
    pool = _pool(8, 8)
    (slot,) = build_slots(pool)
    assert slot.capacity == 16 and slot.market is Market.SPOT and slot.usd_per_gpu_hour == SPOT_USD
    assert slot.usd_per_hour({ZONE: 12}) == pytest.approx(8 * SPOT_USD + 4 * ON_DEMAND_USD)
    sk = Sketch(mbs=2, bounds=((0, 1), (2, book.model.num_layers - 1)), kinds=((0, 2), (0, 4)), dp=2)
    lay = place((slot,), sk)
    assert lay is not None
    assert usd_per_hour((slot,), sk, lay) == pytest.approx(8 * SPOT_USD + 4 * ON_DEMAND_USD)
    pl = materialize(sk, lay, (slot,), model="OPT-350", global_batch_size=64)
    assert pl.gpus_by_place() == {(ZONE, GH, Market.SPOT): 8, (ZONE, GH, Market.ON_DEMAND): 4}


def test_markets_stay_apart_for_goodput_for_zone_prices_and_for_part_vms() -> None:
    pool = _pool(8, 8)
    assert len(build_slots(pool, pool_markets=False)) == 2
    # zones of one market at different prices keep the old split (a slot has one price per market)
    other = Capacity(zone="us-west1-a", region=REGION, gpu_type=GH, gpus=8, market=Market.SPOT, gpus_per_vm=4,
                      usd_per_gpu_hour=SPOT_USD * 2)
    assert len(build_slots(ResourcePool(entries=pool.entries + (other,)))) == 3
    # a count that is not whole VMs (6 GPUs of 4-GPU VMs) keeps them apart: pooled, 6 spot + 6 on-demand
    # would look like 3 tp=4 groups where the markets hold 2
    assert len(build_slots(_pool(6, 6))) == 2



def test_regions_pooled_one_slot_per_gpu_type_with_each_zone_in_its_region_and_priced_by_its_offers() -> None:
    a = Capacity(zone="us-central1-a", region="us-central1", gpu_type=GH, gpus=8, gpus_per_vm=4,
                 usd_per_gpu_hour=ON_DEMAND_USD)
    b = Capacity(zone="us-west1-b", region="us-west1", gpu_type=GH, gpus=4, gpus_per_vm=4,
                 usd_per_gpu_hour=ON_DEMAND_USD * 1.5)
    pool = ResourcePool(entries=(a, b))
    assert len(build_slots(pool)) == 2  # per region
    (slot,) = build_slots(pool, pool_regions=True)
    assert slot.capacity == 12 and slot.zones == (("us-central1-a", 8), ("us-west1-b", 4))
    assert slot.region_of("us-west1-b") == "us-west1" and slot.region_of("us-central1-a") == "us-central1"
    assert slot.usd_per_hour({"us-central1-a": 8, "us-west1-b": 4}) == pytest.approx(
        8 * ON_DEMAND_USD + 4 * ON_DEMAND_USD * 1.5)
    # a stage of 3 tp=4 replicas fills both regions, and each replica names its own region
    sk = Sketch(mbs=2, bounds=((0, 25),), kinds=((0, 4),), dp=3)
    lay = place((slot,), sk)
    assert lay == ((("us-central1-a", 2), ("us-west1-b", 1)),)
    pl = materialize(sk, lay, (slot,), model="OPT-350", global_batch_size=12)
    assert [r.region for r in pl.stages[0].replicas] == ["us-central1", "us-central1", "us-west1"]
