"""The semi-synchronous planner (planner/islands.py) and simulator (simulator/semisync.py), on a small
synthetic world of two regions (tests/planner_fixtures.py): no store, no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sailor_cli.plan_sync import to_json
from sailor_core.domain import Capacity, ResourcePool
from sailor_core.errors import ValidationError
from sailor_core.planner import PlanRequest, SearchOptions, plan
from sailor_core.planner.islands import (
    AUTO_MARGIN,
    EXPOSED_SHARE,
    MAX_INNER_STEPS,
    MIN_INNER_STEPS,
    SyncMode,
    choose_inner_steps,
    plan_with_sync,
)
from sailor_core.semisync import OuterSync, shape_of
from sailor_core.simulator import simulate
from sailor_core.simulator.model import model_for
from sailor_core.simulator.semisync import outer_sync_s, simulate_islands
from tests.planner_fixtures import MODEL, tiny_book

ZONES = ("r1-a", "r2-a")


@pytest.fixture(scope="module")
def world() -> tuple:
    book = tiny_book(3, zones=ZONES)
    pool = ResourcePool(entries=tuple(Capacity(zone=z, region=z[:2], gpu_type="fast", gpus=4, gpus_per_vm=2,
                                               usd_per_gpu_hour=3.0) for z in ZONES))
    return book, PlanRequest(model=MODEL, global_batch_size=16, pool=pool, options=SearchOptions(max_stages=3))


@pytest.fixture(scope="module")
def semi(world: tuple) -> object:
    book, request = world
    return plan_with_sync(request, book, SyncMode.parse("semi"))


def test_every_step_is_the_synchronous_planners_answer(world: tuple) -> None:
    book, request = world
    r = plan_with_sync(request, book, SyncMode.parse("every-step"))
    assert r.chosen is None and not r.candidates
    assert r.synchronous.plan == plan(request, book).plan


def test_semi_plans_one_island_per_region_of_one_shape(semi: object, world: tuple) -> None:
    book, request = world
    c = semi.chosen  # type: ignore[attr-defined]
    assert c is not None and c.plan is not None and c.estimate is not None
    assert c.estimate.fits_memory  # this world's first plans leave no room for the outer state: planned again
    ip = c.plan
    assert sorted(p.stages[0].replicas[0].region for p in ip.islands) == ["r1", "r2"]
    assert all(r.region == p.stages[0].replicas[0].region for p in ip.islands for st in p.stages for r in st.replicas)
    assert len({shape_of(p) for p in ip.islands}) == 1
    assert ip.global_batch_size == request.global_batch_size
    inner = max(simulate(p, book).iteration_time_s for p in ip.islands)
    outer = outer_sync_s(ip, model_for(book))
    assert c.estimate.iteration_time_s == pytest.approx(inner + outer / ip.sync.inner_steps)
    assert ip.sync.inner_steps == choose_inner_steps(inner, outer)


def test_the_rule_for_h_is_the_smallest_with_at_most_its_share_exposed() -> None:
    h = choose_inner_steps(1.0, 1.3)
    assert 1.3 / h <= EXPOSED_SHARE * 1.0 < 1.3 / (h - 1)
    assert choose_inner_steps(1.0, 1e-6) == MIN_INNER_STEPS
    assert choose_inner_steps(1e-3, 100.0) == MAX_INNER_STEPS
    assert choose_inner_steps(1.0, 1.3, fragments=4) % 4 == 0


def test_islands_hold_their_outer_state_pay_their_outer_ring_per_h_and_compression_shrinks_it(
        semi: object, world: tuple) -> None:
    book, _ = world
    ip = semi.chosen.plan  # type: ignore[attr-defined]
    base = simulate_islands(replace(ip, sync=OuterSync(inner_steps=10, momentum=0.9)), book)
    plain = simulate_islands(replace(ip, sync=OuterSync(inner_steps=10, momentum=0.0)), book)
    assert base.outer_state_bytes == 2 * plain.outer_state_bytes > 0  # global copy + momentum, fp32
    assert base.peak_memory_bytes - plain.peak_memory_bytes == plain.outer_state_bytes
    longer = simulate_islands(replace(ip, sync=OuterSync(inner_steps=100, momentum=0.9)), book)
    own = sum(r.egress_usd_per_iteration for r in base.islands)
    assert longer.egress_usd_per_iteration - own == pytest.approx((base.egress_usd_per_iteration - own) / 10)
    assert longer.cross_region_bytes_per_token == pytest.approx(base.cross_region_bytes_per_token / 10)
    times = [outer_sync_s(replace(ip, sync=OuterSync(inner_steps=10, compression=c)), model_for(book))
             for c in ("none", "bf16", "int8")]
    assert times[0] > times[1] > times[2] > 0


def test_auto_takes_islands_only_when_they_win_by_the_margin(world: tuple) -> None:
    book, request = world
    r = plan_with_sync(request, book, SyncMode.parse("auto"))
    s = r.synchronous.estimate
    assert s is not None
    best = max((c.estimate.throughput_iterations_per_s for c in r.candidates
                if c.plan is not None and c.estimate is not None), default=0.0)
    if r.chosen is not None and r.chosen.estimate is not None:
        assert r.chosen.estimate.throughput_iterations_per_s >= AUTO_MARGIN * s.throughput_iterations_per_s
    else:
        assert best < AUTO_MARGIN * s.throughput_iterations_per_s
    assert {row["sync"].split(":")[0] for row in r.frontier()} == {"every-step", "semi"}
    assert "Traded" in r.explanation or "kept every-step" in r.explanation


def test_the_json_answer_has_the_estimate_keys_and_an_island_plan(semi: object) -> None:
    d = to_json(semi, 0.1)  # type: ignore[arg-type]
    assert d["sync"].startswith("semi:") and d["plan"]["format"] == "sailor-islands"
    for key in ("throughput_iterations_per_s", "egress_usd_per_iteration", "usd_per_million_tokens", "semi_sync"):
        assert key in d["estimate"]
    assert d["synchronous"]["estimate"]["throughput_iterations_per_s"] > 0


@pytest.mark.parametrize("spec", ["sometimes", "auto:5", "semi:x", "semi:0"])
def test_a_bad_sync_mode_is_refused_with_the_fix(spec: str) -> None:
    with pytest.raises(ValidationError, match="to fix"):
        SyncMode.parse(spec)


def test_one_region_gives_no_islands_and_says_why(world: tuple) -> None:
    book, request = world
    one = replace(request, pool=ResourcePool(entries=request.pool.entries[:1]))
    r = plan_with_sync(one, book, SyncMode.parse("semi:20"))
    assert r.chosen is None and "at least two regions" in r.explanation
