"""Planner: pool files, what-ifs, partitions, the ring shortcut, plans verified by the simulator, CLI."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sailor_core.domain import Capacity, Market, ResourcePool
from sailor_core.errors import SailorError
from sailor_core.planner import (
    Constraints,
    Objective,
    PlanRequest,
    PoolFileError,
    Restrictions,
    SearchOptions,
    apply_what_if,
    load_pool_file,
    parse_pool,
    plan,
)
from sailor_core.planner.core import problem_of as core_problem
from sailor_core.planner.costs import SimCosts
from sailor_core.planner.shapes import balanced_partition, uniform_partition
from sailor_core.planner.slots import Slot
from sailor_core.planner.verify import sim_options
from sailor_core.simulator import simulate
from sailor_core.simulator.model import model_for
from tests.planner_fixtures import MODEL, tiny_book

A, V = "A100-40", "V100-16"


def seed_book(model: str, tmp: Path):
    """The published profiles as a fresh install has them: the store's shipped seed."""
    from profiles_store.store import open_store

    return open_store(str(tmp)).profile_book(model)


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    return seed_book("OPT-350", tmp_path_factory.mktemp("store"))


ISSUE_POOL = """
zones:
  us-central1-a:
    gpus:
      A100-40: {count: 128}
      V100-16: {count: 384, market: spot, usd_per_gpu_hour: 0.9}
  us-west1-b:
    region: us-west1
    gpus:
      A100-40:
        - {count: 32, gpus_per_node: 4, market: on-demand}
        - {count: 64, market: spot, usd_per_gpu_hour: 1.4}
"""


def test_pool_file_shape_of_the_issue_with_defaults_from_the_store(tmp_path: Path, book) -> None:
    f = tmp_path / "pool.yaml"
    f.write_text(ISSUE_POOL)
    pool = load_pool_file(f, book)
    by = {(e.zone, e.gpu_type, e.market): e for e in pool.entries}
    a = by[("us-central1-a", A, Market.ON_DEMAND)]
    assert (a.gpus, a.gpus_per_vm, a.usd_per_gpu_hour, a.region) == (128, 4, 3.673385, "us-central1")
    v = by[("us-central1-a", V, Market.SPOT)]
    assert (v.gpus, v.usd_per_gpu_hour) == (384, 0.9)
    w = by[("us-west1-b", A, Market.SPOT)]
    assert (w.gpus, w.region, w.usd_per_gpu_hour) == (64, "us-west1", 1.4)
    assert by[("us-west1-b", A, Market.ON_DEMAND)].usd_per_gpu_hour == 3.673385
    # JSON is read too
    j = tmp_path / "pool.json"
    j.write_text(json.dumps({"zones": {"us-central1-b": {"gpus": {A: {"count": 8}}}}}))
    assert load_pool_file(j, book).entries[0].gpus == 8


def test_pool_file_reads_gpus_per_vm_and_its_older_name_and_writes_the_new_one(book) -> None:
    from sailor_core.planner.pool import pool_to_dict

    new = parse_pool({"zones": {"us-central1-a": {"gpus": {A: {"count": 8, "gpus_per_vm": 2}}}}}, book)
    old = parse_pool({"zones": {"us-central1-a": {"gpus": {A: {"count": 8, "gpus_per_node": 2}}}}}, book)
    assert new == old and (new.entries[0].gpus, new.entries[0].gpus_per_vm, new.entries[0].vms) == (8, 2, 4)
    written = pool_to_dict(new)
    assert written["zones"]["us-central1-a"]["gpus"][A][0]["gpus_per_vm"] == 2
    assert parse_pool(written, book) == new
    with pytest.raises(PoolFileError, match="give gpus_per_vm or gpus_per_node"):
        parse_pool({"zones": {"us-central1-a": {"gpus": {A: {"count": 8, "gpus_per_vm": 2, "gpus_per_node": 2}}}}},
                   book)


def test_pool_file_lists_every_problem_with_a_fix(book) -> None:
    bad = {
        "zones": {
            "us-central1-a": {"gpus": {A: {"count": -1}, "B200": {"count": 8}, V: {"count": 8, "market": "spot"}}},
            "us-central1-b": {"gpus": {A: [{"count": 4}, {"count": 4}]}},
        }
    }
    with pytest.raises(PoolFileError) as e:
        parse_pool(bad, book)
    msg = str(e.value)
    assert "zones.us-central1-a.gpus.A100-40.count" in msg
    assert "'B200' is not in the store" in msg
    assert "no spot price for V100-16" in msg and "usd_per_gpu_hour" in msg
    assert "listed twice" in msg
    with pytest.raises(PoolFileError, match="zones"):
        parse_pool({"gpus": {}}, book)


def test_what_if_variations(book) -> None:
    pool = parse_pool({"zones": {"us-central1-a": {"gpus": {A: {"count": 8}}}}}, book)
    more = apply_what_if(pool, "+16 V100-16 in us-west1-b", book)
    added = [e for e in more.entries if e.zone == "us-west1-b"]
    assert added[0].gpus == 16 and added[0].gpu_type == V and added[0].usd_per_gpu_hour == 2.859998
    assert apply_what_if(pool, "-4 A100-40 in us-central1-a", book).entries[0].gpus == 4
    assert apply_what_if(pool, "+4 A100-40 in us-central1-a", book).entries[0].gpus == 12
    dearer = apply_what_if(pool, "A100-40 price +30%", book)
    assert dearer.entries[0].usd_per_gpu_hour == pytest.approx(3.673385 * 1.3)
    family = apply_what_if(pool, "A100 on-demand price -10% in us-central1-a", book)
    assert family.entries[0].usd_per_gpu_hour == pytest.approx(3.673385 * 0.9)
    with pytest.raises(SailorError, match="no pool entry"):
        apply_what_if(pool, "A100-40 spot price +30%", book)
    with pytest.raises(SailorError, match="to fix"):
        apply_what_if(pool, "double the A100s", book)


def test_partitions() -> None:
    assert uniform_partition(26, 4) == ((0, 6), (7, 13), (14, 19), (20, 25))
    rng = random.Random(3)
    for _ in range(30):
        times = [rng.uniform(0.1, 2.0) for _ in range(rng.randint(3, 8))]
        p = rng.randint(1, len(times))
        got = balanced_partition(times, p)
        assert got is not None and got[0][0] == 0 and got[-1][1] == len(times) - 1 and len(got) == p
        worst = max(sum(times[a : b + 1]) for a, b in got)
        # brute force over every split
        from itertools import combinations

        best = min(
            max(sum(times[a:b]) for a, b in zip((0, *cuts), (*cuts, len(times)), strict=True))
            for cuts in combinations(range(1, len(times)), p - 1)
        )
        assert worst == pytest.approx(best)


def test_ring_shortcut_equals_the_simulator(book) -> None:
    costs = SimCosts(book)
    rng = random.Random(1)
    zones = ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"]
    for _ in range(60):
        g, tp = rng.choice([A, V]), rng.choice([1, 2, 4])
        zs = rng.sample(zones, rng.randint(1, 4))
        lay = tuple((z, rng.randint(1, 12)) for z in zs)
        slot = Slot(index=0, gpu_type=g, market=Market.ON_DEMAND, region="us-central1", cloud="gcp", gpus_per_node=4,
                    usd_per_gpu_hour=1.0, zones=tuple((z, 999) for z in zs))
        gb = rng.choice([1e6, 3e8, 1.4e9])
        assert costs.allreduce_s(slot, tp, lay, gb) == pytest.approx(costs.allreduce_reference_s(slot, tp, lay, gb),
                                                                     rel=1e-12)


def test_ring_shortcut_takes_the_measured_node_all_reduce_like_the_simulator(book) -> None:
    from sailor_core.domain import NodeAllReduce

    measured = NodeAllReduce(gpu_type=A, workers=2, fit=book.intra_node_link(A, 2).fit)
    costs = SimCosts(replace(book, node_allreduce=(measured,)))
    slot = Slot(index=0, gpu_type=A, market=Market.ON_DEMAND, region="us-central1", cloud="gcp", gpus_per_node=4,
                usd_per_gpu_hour=1.0, zones=(("us-central1-a", 999), ("us-central1-b", 999)))
    one_node = (("us-central1-a", 2),)
    for lay, tp in ((one_node, 1), (one_node, 2), ((("us-central1-a", 1), ("us-central1-b", 1)), 1)):
        got = costs.allreduce_s(slot, tp, lay, 3e8)
        assert got == pytest.approx(costs.allreduce_reference_s(slot, tp, lay, 3e8), rel=1e-12)
    # the measured collective (x / bw(x), bucket by bucket) replaces the two ring hops of x/2 on the same fit
    from sailor_core.simulator.model import allreduce_buckets

    assert costs.allreduce_s(slot, 1, one_node, 3e8) == pytest.approx(
        sum(measured.fit.transfer_time_s(b) for b in allreduce_buckets(3e8)))


def _pool(book, zones: dict[str, dict[str, int]]) -> ResourcePool:
    return parse_pool(
        {"zones": {z: {"gpus": {g: {"count": n} for g, n in gs.items()}} for z, gs in zones.items()}}, book
    )


def _assert_estimate_adds_up_by_hand(pl, est, book, usd_per_gpu_hour: dict[str, float]) -> None:
    """The planner's estimate of a one-zone fp32 1F1B plan against the pool's prices, the model's
    published layer sizes and the product's own 1F1B walk (checked by hand in the test below)."""
    from sailor_core.simulator.schedule import run_1f1b

    # rent: every GPU of the plan at the price the pool gives it; one zone, so no egress
    gpus = [(r.gpu_type, r.tp) for st in pl.stages for r in st.replicas]
    assert est.num_gpus == sum(tp for _, tp in gpus)
    assert est.usd_per_hour == pytest.approx(sum(tp * usd_per_gpu_hour[g] for g, tp in gpus), rel=1e-9)
    assert est.egress_usd_per_iteration == 0.0
    # the four top terms of the breakdown are the iteration (docs/simulator.md)
    b = est.breakdown
    assert est.iteration_time_s == pytest.approx(
        b.pipeline_compute_s + b.pipeline_p2p_s + b.dp_sync_exposed_s + b.optimizer_s, rel=1e-9)
    # the compute part is the 1F1B schedule of the stages' per-microbatch times over free links
    m, p = pl.pipelines[0].num_microbatches, pl.num_stages
    rows = [next(r for r in est.per_stage if r.stage == s) for s in range(p)]
    free = [0.0] * (p - 1)
    walked = run_1f1b([r.forward_s for r in rows], [r.backward_s for r in rows], free, free, m)[0]
    assert b.pipeline_compute_s == pytest.approx(walked, rel=1e-9)
    assert 0.0 <= b.bubble_s < b.pipeline_compute_s
    # memory: fp32 weights are 4 B per parameter the stage holds at its TP degree, gradients 4 B,
    # Adam's two moments 8 B; the total fits the GPU type's memory
    for row in est.per_stage:
        st = pl.stages[row.stage]
        params = sum(ly.params for ly in book.model.layers
                     if ly.tp == row.tp and st.first_layer <= ly.index <= st.last_layer)
        assert (row.memory.weights_bytes, row.memory.gradients_bytes, row.memory.optimizer_bytes) == (
            4 * params, 4 * params, 8 * params)
        assert row.peak_memory_bytes <= book.gpu_types[row.gpu_type].memory_bytes
    assert est.fits_memory


def test_the_1f1b_walk_matches_a_schedule_counted_by_hand() -> None:
    from sailor_core.simulator.schedule import run_1f1b

    # two stages, 4 microbatches, free links. Slow stage last (F 1+2 s, B 2+4 s): stage 0's first
    # forward (1 s), then the slow stage's 4 x (2 + 4) s, then stage 0's last backward (2 s).
    assert run_1f1b([1.0, 2.0], [2.0, 4.0], [0.0], [0.0], 4)[0] == 27.0
    # slow stage first (F 2 s, B 4 s; then F 1 s, B 2 s): stage 0 runs F1 0-2, F2 2-4, then waits for
    # each backward from stage 1: B1 5-9, F3 9-11, B2 11-15, F4 15-17, B3 17-21, B4 21-25
    assert run_1f1b([2.0, 1.0], [4.0, 2.0], [0.0], [0.0], 4)[0] == 25.0
    # one stage: 5 x (1 + 2) s, no bubble
    assert run_1f1b([1.0], [2.0], [], [], 5)[0] == 15.0


def test_plan_is_verified_by_the_simulator_and_deterministic(book) -> None:
    pool = _pool(book, {"us-central1-a": {A: 16, V: 16}})
    req = PlanRequest(model="OPT-350", global_batch_size=256, pool=pool)
    r1 = plan(req, book)
    r2 = plan(req, book)
    assert r1.plan is not None and r1.plan == r2.plan
    assert r1.estimate.to_json() == r2.estimate.to_json()
    _assert_estimate_adds_up_by_hand(r1.plan, r1.estimate, book, {A: 3.673385, V: 2.859998})
    used = r1.plan.gpus_by_place()
    for e in pool.entries:
        assert used.get((e.zone, e.gpu_type, e.market), 0) <= e.gpus
    # the frontier is Pareto: faster points cost more
    f = r1.frontier
    assert f and all(f[i].iterations_per_s > f[i + 1].iterations_per_s for i in range(len(f) - 1))
    assert all(f[i].usd_per_iteration > f[i + 1].usd_per_iteration for i in range(len(f) - 1))
    assert "Chosen for the highest throughput" in r1.explanation


def test_constraints_are_never_broken_and_misses_are_explained(book) -> None:
    pool = _pool(book, {"us-central1-a": {A: 32}})
    fast = plan(PlanRequest(model="OPT-350", global_batch_size=256, pool=pool), book)
    # (with the gradient all-reduce overlapping the last backward, wider data parallelism costs little
    # per iteration: the cheapest plans are ~10 % below the fastest here, not 30 %)
    budget = fast.estimate.usd_per_iteration * 0.95
    r = plan(PlanRequest(model="OPT-350", global_batch_size=256, pool=pool,
                         constraints=Constraints(max_usd_per_iteration=budget)), book)
    assert r.plan is not None and r.estimate.usd_per_iteration <= budget
    hour = plan(PlanRequest(model="OPT-350", global_batch_size=256, pool=pool, objective=Objective.MIN_COST,
                            constraints=Constraints(max_usd_per_hour=40.0, min_iterations_per_s=0.05)), book)
    assert hour.plan is not None and hour.estimate.usd_per_hour <= 40.0
    assert hour.estimate.throughput_iterations_per_s >= 0.05
    miss = plan(PlanRequest(model="OPT-350", global_batch_size=256, pool=pool,
                            constraints=Constraints(min_iterations_per_s=1000.0)), book)
    assert miss.plan is None and miss.estimate is None
    assert "iterations/s" in miss.nearest_miss and "to fix" in miss.nearest_miss


def test_the_constraint_gap_and_the_broken_limits_agree() -> None:
    """One table of limits: the gap is the largest relative excess, and a limit is reported broken
    exactly where it adds to the gap (beyond rounding)."""
    c = Constraints(max_usd_per_iteration=2.0, max_usd_per_hour=100.0, min_iterations_per_s=0.5)
    within = dict(usd_per_iteration=1.0, usd_per_hour=100.0, iterations_per_s=0.5)
    assert c.gap(**within) == 0.0 and c.violations(**within) == []
    over = dict(usd_per_iteration=3.0, usd_per_hour=110.0, iterations_per_s=0.25)
    assert c.gap(**over) == pytest.approx(1.0)  # the speed is 2x short, the budget 1.5x over
    assert c.violations(**over) == ["costs 3.0000 USD/iteration > limit 2", "costs 110.00 USD/hour > limit 100",
                                    "runs 0.2500 iterations/s < minimum 0.5"]
    assert Constraints().gap(**over) == 0.0 and Constraints().violations(**over) == []


def test_restrictions_and_unprofiled_gpus(book) -> None:
    pool = _pool(book, {"us-central1-a": {A: 8, V: 8}, "us-central1-b": {A: 8}})
    r = plan(PlanRequest(model="OPT-350", global_batch_size=64, pool=pool,
                         restrictions=Restrictions(gpu_types=(V,), max_gpus=6)), book)
    assert r.plan is not None
    assert {g for (_, g, _) in r.plan.gpus_by_place()} == {V} and r.plan.num_gpus <= 6
    with_unknown = ResourcePool(entries=pool.entries + (
        Capacity(zone="us-central1-a", region="us-central1", gpu_type="Titan-RTX", gpus=8, gpus_per_vm=8,
                  usd_per_gpu_hour=1.0),
    ))
    lone = plan(PlanRequest(model="OPT-350", global_batch_size=64, pool=replace(with_unknown),
                            restrictions=Restrictions(gpu_types=("Titan-RTX", A))), book)
    assert lone.plan is not None  # Titan-RTX is profiled for OPT-350 in the published data


def test_model_that_fits_nowhere_gets_the_nearest_miss() -> None:
    b = tiny_book(7, memory_gib=(1.2, 1.1))  # framework overhead alone is 1 GiB
    pool = ResourcePool(entries=(Capacity(zone="r1-a", region="r1", gpu_type="fast", gpus=4, gpus_per_vm=2,
                                           usd_per_gpu_hour=2.0),))
    r = plan(PlanRequest(model=MODEL, global_batch_size=16, pool=pool), b)
    assert r.plan is None
    assert "memory" in r.nearest_miss and "to fix" in r.nearest_miss


def test_min_cost_returns_multi_stage_plans_when_they_are_cheaper() -> None:
    # One GPU cannot hold the model (tp=1 only), so every feasible plan is a pipeline; the
    # published planner only ever returned single-stage plans when minimising cost.
    b = tiny_book(11, memory_gib=(3.0, 2.0), tps=(1,))
    pool = ResourcePool(entries=tuple(
        Capacity(zone="r1-a", region="r1", gpu_type=g, gpus=8, gpus_per_vm=2, usd_per_gpu_hour=p)
        for g, p in (("fast", 3.0), ("slow", 1.0))
    ))
    for obj in (Objective.MIN_COST, Objective.MIN_COST_PER_TOKEN):
        r = plan(PlanRequest(model=MODEL, global_batch_size=16, pool=pool, objective=obj), b)
        assert r.plan is not None and r.plan.num_stages >= 2 and r.estimate.fits_memory


def test_cli_plan_json_matches_sailor_simulate(tmp_path: Path, capsys) -> None:
    from sailor_cli.main import main

    pool = tmp_path / "pool.yaml"
    pool.write_text("zones:\n  us-central1-a:\n    gpus:\n      A100-40: {count: 16}\n")
    out = tmp_path / "plan.json"
    png = tmp_path / "front.png"
    rc = main(["plan", "--pool", str(pool), "--model", "OPT-350", "--global-batch-size", "128", "--out", str(out),
               "--json", "--what-if", "+16 V100-16 in us-central1-a", "--frontier-png", str(png)])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    assert {"plan", "estimate", "search_time_s", "frontier", "what_if"} <= set(got)
    assert (
        got["what_if"][0]["change"] == "+16 V100-16 in us-central1-a" and "delta_iterations_per_s" in got["what_if"][0]
    )
    assert png.stat().st_size > 0
    rc = main(["simulate", str(out), "--json"])
    assert rc == 0
    sim = json.loads(capsys.readouterr().out)
    for k in ("iteration_time_s", "throughput_iterations_per_s", "usd_per_iteration", "peak_memory_bytes"):
        assert sim[k] == pytest.approx(got["estimate"][k])
    # an infeasible request is an answer with a reason (exit 1), a bad objective a user error (exit 2)
    rc = main(["plan", "--pool", str(pool), "--model", "OPT-350", "--global-batch-size", "128",
               "--min-iterations-per-s", "1000"])
    assert rc == 1 and "no feasible plan" in capsys.readouterr().out
    rc = main(["plan", "--pool", str(pool), "--model", "OPT-350", "--global-batch-size", "128", "--objective", "fast"])
    assert rc == 2 and "unknown objective" in capsys.readouterr().err


def test_spot_and_on_demand_are_distinct_resources(book) -> None:
    pool = parse_pool({"zones": {"us-central1-a": {"gpus": {A: [
        {"count": 8, "market": "on-demand"}, {"count": 8, "market": "spot", "usd_per_gpu_hour": 1.1}]}}}}, book)
    cheap = plan(PlanRequest(model="OPT-350", global_batch_size=64, pool=pool, objective=Objective.MIN_COST), book)
    assert cheap.plan is not None and {mk for (_, _, mk) in cheap.plan.gpus_by_place()} == {Market.SPOT}
    fast = plan(PlanRequest(model="OPT-350", global_batch_size=64, pool=pool), book)
    assert fast.plan is not None and fast.plan.num_gpus > 8  # needs both markets
    assert {mk for (_, _, mk) in fast.plan.gpus_by_place()} == {Market.SPOT, Market.ON_DEMAND}


def test_mixed_pipelines_use_idle_gpus_and_balance_microbatches(book) -> None:
    pool = _pool(book, {"us-central1-a": {A: 32, V: 96}})
    # tolerance 0: the fastest plan (mixed) is what this test is about; with the default 0.5% a
    # single-shape plan 0.46% slower and 22% cheaper wins (tested below).
    req = PlanRequest(model="OPT-350", global_batch_size=1024, pool=pool, options=SearchOptions(tolerance=0.0))
    mixed = plan(req, book)
    single = plan(replace(req, options=replace(req.options, mixed_pipelines=0)), book)
    assert mixed.plan is not None and single.plan is not None
    assert mixed.estimate.throughput_iterations_per_s >= single.estimate.throughput_iterations_per_s
    kinds = [{(r.gpu_type, r.tp) for r in st.replicas} for st in mixed.plan.stages]
    assert any(len(k) > 1 for k in kinds), "expected a stage with replicas of two GPU kinds"
    assert sum(p.samples for p in mixed.plan.pipelines) == 1024
    assert mixed.estimate.fits_memory and "two GPU kinds" in mixed.explanation


def test_a_stage_spanning_zones_pays_the_cross_zone_link_and_egress(book) -> None:
    pool = _pool(book, {"us-central1-a": {A: 4}, "us-central1-b": {A: 4}})
    r = plan(PlanRequest(model="OPT-350", global_batch_size=64, pool=pool), book)
    assert r.plan is not None and r.plan.num_gpus == 8
    zones = {z for (z, _, _) in r.plan.gpus_by_place()}
    assert zones == {"us-central1-a", "us-central1-b"}
    assert r.estimate.egress_usd_per_iteration > 0  # 0.01 USD/GB between us-central1 zones
    one_zone = plan(PlanRequest(model="OPT-350", global_batch_size=64, pool=pool,
                                restrictions=Restrictions(zones=("us-central1-a",))), book)
    assert one_zone.estimate.egress_usd_per_iteration == 0


def test_an_empty_pool_after_restrictions_names_the_flags(book) -> None:
    pool = _pool(book, {"us-central1-a": {A: 8}})
    r = plan(PlanRequest(model="OPT-350", global_batch_size=64, pool=pool,
                         restrictions=Restrictions(regions=("nowhere",))), book)
    assert r.plan is None and "--region" in r.nearest_miss and r.nearest_miss.count("to fix") == 1


def test_a_model_too_big_for_any_split_names_the_closest_gpu(tmp_path: Path) -> None:
    llama = seed_book("LLAMA-3-8", tmp_path)
    pool = parse_pool({"zones": {"us-central1-a": {"gpus": {V: {"count": 64}}}}}, llama)
    r = plan(PlanRequest(model="LLAMA-3-8", global_batch_size=64, pool=pool,
                         options=SearchOptions(recompute="never")), llama)
    # fp32 1F1B at 8,192 tokens: the in-flight activations exceed 16 GiB for every split
    assert r.plan is None
    assert "closest: V100-16" in r.nearest_miss and "in flight" in r.nearest_miss and "to fix" in r.nearest_miss
    assert "--recompute auto" in r.nearest_miss


def test_a_pool_too_small_for_the_model_names_the_gpus_that_would_fit_it(tmp_path: Path) -> None:
    opt30 = seed_book("OPT-30", tmp_path)

    def on(n: int):
        pool = parse_pool({"zones": {"us-central1-a": {"gpus": {A: {"count": n}}}}}, opt30)
        return plan(PlanRequest(model="OPT-30", global_batch_size=256, pool=pool), opt30)

    short = on(16)
    assert short.plan is None
    assert "on the pool's 16 GPUs; the smallest pipeline that fits is" in short.nearest_miss
    need = int(short.nearest_miss.split("add GPUs (at least ")[1].split(")")[0])
    assert need > 16 and on(need).plan is not None  # the message is judged as the search judges memory


def test_a_split_packed_to_memory_is_searched_where_the_even_ones_do_not_fit(tmp_path: Path) -> None:
    # OPT-30 on 64 V100-16: the uniform and time-balanced 16-stage splits put too many layers on the
    # first stages, which keep the most microbatches in flight
    opt30 = seed_book("OPT-30", tmp_path)
    pool = parse_pool({"zones": {"us-central1-a": {"gpus": {V: {"count": 64}}}}}, opt30)
    r = plan(PlanRequest(model="OPT-30", global_batch_size=256, pool=pool), opt30)
    assert r.plan is not None and r.estimate is not None and r.estimate.fits_memory
    sizes = [st.last_layer - st.first_layer + 1 for st in r.plan.stages]
    assert sizes[0] < max(sizes)  # the first stage holds fewer layers than the fullest


def test_activation_recomputation_is_planned_when_nothing_fits_without_it(tmp_path: Path) -> None:
    # Llama-3-8B at 8192 tokens on 40 GB GPUs: 1F1B's first stage holds a whole model's layers of
    # activations at any stage count, so only recomputation (each block keeps its input) fits.
    llama = seed_book("LLAMA-3-8", tmp_path)
    pool = parse_pool({"zones": {"us-central1-a": {"gpus": {A: {"count": 32}}}}}, llama)
    req = PlanRequest(model="LLAMA-3-8", global_batch_size=64, pool=pool)
    r = plan(req, llama)
    assert r.plan is not None and r.estimate is not None
    assert all(st.recompute for st in r.plan.stages)
    assert r.estimate.fits_memory and "Activation recomputation on stage(s) 0, 1 of 2: no plan fits" in r.explanation
    so = sim_options(pool, "fp32", "1f1b")
    assert simulate(r.plan, llama, options=so).to_json() == r.estimate.to_json()
    kept = replace(r.plan, stages=tuple(replace(st, recompute=False) for st in r.plan.stages))
    assert not simulate(kept, llama, options=so).fits_memory  # the same plan without it does not fit
    assert plan(replace(req, options=SearchOptions(recompute="always")), llama).plan == r.plan


def test_recomputation_stays_off_the_stages_that_fit_without_it(tmp_path: Path) -> None:
    # OPT-30 on 16 GB GPUs: the early stages of its pipeline keep many microbatches in flight and must
    # recompute; the last ones keep few and are spared the extra forward.
    opt30 = seed_book("OPT-30", tmp_path)
    pool = parse_pool({"zones": {"us-central1-a": {"gpus": {V: {"count": 128}}}}}, opt30)
    r = plan(PlanRequest(model="OPT-30", global_batch_size=256, pool=pool), opt30)
    assert r.plan is not None and r.estimate is not None and r.estimate.fits_memory
    flags = [st.recompute for st in r.plan.stages]
    assert any(flags) and not all(flags)
    so = sim_options(pool, "fp32", "1f1b")
    bare = simulate(replace(r.plan, stages=tuple(replace(st, recompute=False) for st in r.plan.stages)), opt30,
                    options=so)
    assert {x.stage for x in bare.per_stage if not x.fits} == {i for i, f in enumerate(flags) if f}
    every = simulate(replace(r.plan, stages=tuple(replace(st, recompute=True) for st in r.plan.stages)), opt30,
                     options=so)
    assert every.iteration_time_s > r.estimate.iteration_time_s


def test_the_search_estimates_recomputing_plans_as_the_simulator_runs_them(tmp_path: Path) -> None:
    from sailor_core.planner.search import Search
    from sailor_core.planner.slots import build_slots
    from sailor_core.planner.verify import materialize, recomputed_as

    opt30 = seed_book("OPT-30", tmp_path)
    pool = parse_pool({"zones": {"us-central1-a": {"gpus": {V: {"count": 128}}}}}, opt30)
    req = PlanRequest(model="OPT-30", global_batch_size=256, pool=pool)
    slots = build_slots(pool)
    costs = SimCosts(opt30, recompute="auto")
    cands = Search(core_problem(req, opt30, slots), costs).run()
    plans = [recomputed_as(materialize(c.sketch, c.estimate.layouts, slots, model="OPT-30", global_batch_size=256),
                           costs) for c in cands]
    assert any(p.data_parallel > 1 and any(st.recompute for st in p.stages) for p in plans)
    so = sim_options(pool, "fp32", "1f1b")
    for c, p in zip(cands, plans, strict=True):  # one model: the bucket overlap counts the recomputed forward
        assert c.estimate.iteration_s == pytest.approx(simulate(p, opt30, options=so).iteration_time_s, rel=1e-9)


def test_patience_does_not_stop_at_stage_counts_whose_even_splits_fit_nowhere(tmp_path: Path) -> None:
    # OPT-30 on 128 A100-40: at microbatch 2 a split packed to memory sets an incumbent; at microbatch 1
    # the shallow stage counts fit nowhere evenly, and the best plan needs 16 stages. Patience must not
    # count those stage counts as misses: the default search finds what searching every count finds.
    opt30 = seed_book("OPT-30", tmp_path)
    pool = parse_pool({"zones": {"us-central1-a": {"gpus": {A: {"count": 128}}}}}, opt30)
    req = PlanRequest(model="OPT-30", global_batch_size=1024, pool=pool)
    patient = plan(req, opt30)
    every = plan(replace(req, options=SearchOptions(patience=0)), opt30)
    assert patient.plan is not None and every.plan is not None
    assert patient.estimate.iteration_time_s == pytest.approx(every.estimate.iteration_time_s, rel=1e-9)


def test_recomputation_is_not_planned_where_plans_fit_without_it_unless_asked(book) -> None:
    pool = _pool(book, {"us-central1-a": {A: 16}})
    req = PlanRequest(model="OPT-350", global_batch_size=256, pool=pool)
    auto = plan(req, book)
    always = plan(replace(req, options=SearchOptions(recompute="always")), book)
    assert auto.plan is not None and not any(st.recompute for st in auto.plan.stages)
    assert always.plan is not None and all(st.recompute for st in always.plan.stages)
    # the extra forward in every backward: the plan that must recompute is slower
    assert always.estimate.iteration_time_s > auto.estimate.iteration_time_s
    with pytest.raises(SailorError, match="--recompute auto, never or always"):
        SearchOptions(recompute="sometimes")



def test_equally_fast_plans_go_to_the_cheaper_market() -> None:
    # 3 spot + 4 on-demand GPUs of one type, at most 4 used: every 4-GPU plan is equally fast, and
    # the cheapest puts as many TP groups on spot as fit (the search alone kept markets apart).
    b = tiny_book(3, gpus=("fast",), memory_gib=(6.0,), zones=("r1-a",))
    pool = ResourcePool(entries=(
        Capacity(zone="r1-a", region="r1", gpu_type="fast", gpus=3, market=Market.SPOT, gpus_per_vm=2,
                  usd_per_gpu_hour=0.1),
        Capacity(zone="r1-a", region="r1", gpu_type="fast", gpus=4, market=Market.ON_DEMAND, gpus_per_vm=2,
                  usd_per_gpu_hour=0.3),
    ))
    res = plan(PlanRequest(model=MODEL, global_batch_size=8, pool=pool, restrictions=Restrictions(max_gpus=4)), b)
    assert res.plan is not None and res.estimate is not None and res.plan.num_gpus == 4
    used = res.plan.gpus_by_place()
    assert used[("r1-a", "fast", Market.SPOT)] >= 2
    on_demand_only = plan(PlanRequest(model=MODEL, global_batch_size=8, pool=pool,
                                      restrictions=Restrictions(max_gpus=4, markets=(Market.ON_DEMAND,))), b)
    assert on_demand_only.estimate is not None
    assert res.estimate.iteration_time_s == pytest.approx(on_demand_only.estimate.iteration_time_s)
    assert res.estimate.usd_per_hour < on_demand_only.estimate.usd_per_hour


def test_the_choice_is_the_best_on_the_objective_and_a_near_plan_is_offered() -> None:
    from sailor_core.planner.verify import Verified, choose, near_alternative

    def res(it_s: float, usd: float) -> Any:
        return SimpleNamespace(iteration_time_s=it_s, usd_per_iteration=usd)

    fast = Verified(value=1.000, plan="fast", result=res(1.000, 9.0))  # type: ignore[arg-type]
    close_cheap = Verified(value=1.004, plan="close", result=res(1.004, 5.0))  # type: ignore[arg-type]
    far_cheaper = Verified(value=1.010, plan="far", result=res(1.010, 1.0))  # type: ignore[arg-type]
    opts = [close_cheap, fast, far_cheaper]
    got = choose(Objective.MAX_THROUGHPUT, opts)
    assert got is not None and got.plan == "fast"  # the fastest, though a plan 0.4 % slower costs 44 % less
    alt = near_alternative(Objective.MAX_THROUGHPUT, got, opts, 0.005)
    assert alt is not None and alt.plan == "close"  # offered in the explanation, within the 0.5 % tolerance
    assert near_alternative(Objective.MAX_THROUGHPUT, got, opts, 0.0) is None
    # exact ties on the objective go to the other goal; min cost: the cheapest, ties to the fastest
    twin = Verified(value=1.000, plan="twin", result=res(1.000, 8.0))  # type: ignore[arg-type]
    got = choose(Objective.MAX_THROUGHPUT, [fast, twin])
    assert got is not None and got.plan == "twin"
    cheap = Verified(value=2.000, plan="cheap", result=res(9.0, 2.000))  # type: ignore[arg-type]
    cheap_fast = Verified(value=2.009, plan="cheap-fast", result=res(3.0, 2.009))  # type: ignore[arg-type]
    got = choose(Objective.MIN_COST, [cheap_fast, cheap])
    assert got is not None and got.plan == "cheap"
    alt = near_alternative(Objective.MIN_COST, got, [cheap, cheap_fast], 0.005)
    assert alt is not None and alt.plan == "cheap-fast"
    assert choose(Objective.MIN_COST, []) is None


def _pipelines_in_zones(pl, pool):
    """The same plan with each pipeline's replicas moved into one zone of its region (whole
    pipelines per zone, the roomiest zone first), or None if the pool has no such room."""
    free = {(e.zone, e.gpu_type, e.market): e.gpus for e in pool.entries}
    zones_of = {e.zone: e.region for e in pool.entries}
    new_reps: list[list] = [[] for _ in pl.stages]
    for j in range(pl.data_parallel):
        reps = [st.replicas[j] for st in pl.stages]
        need: dict[tuple[str, object], int] = {}
        for r in reps:
            need[(r.gpu_type, r.market)] = need.get((r.gpu_type, r.market), 0) + r.tp
        region = reps[0].region
        fits = [z for z, reg in sorted(zones_of.items()) if reg == region
                and all(free.get((z, g, mk), 0) >= n for (g, mk), n in need.items())]
        if not fits:
            return None
        z = max(fits, key=lambda z: (sum(free.get((z, g, mk), 0) for (g, mk) in need), z))
        for (g, mk), n in need.items():
            free[(z, g, mk)] -= n
        for s, r in enumerate(reps):
            new_reps[s].append(replace(r, zone=z))
    return replace(
        pl, stages=tuple(replace(st, replicas=tuple(rs)) for st, rs in zip(pl.stages, new_reps, strict=True))
    )


def test_a_plan_as_fast_with_pipelines_inside_zones_is_offered_beside_the_fastest(tmp_path: Path) -> None:
    # The issue's case: a 2.7B model on 5 A100 zones. Stage-major placement sent every pipeline's
    # activations across zones (egress 40% of the cost per iteration here); the same plan with whole
    # pipelines per zone is within the tolerance of the fastest and pays no pipeline egress. The planner
    # returns the fastest (the objective first) and names the in-zone plan, on its frontier and in words.
    neo = seed_book("GPT-Neo-2.7", tmp_path)
    zones: dict[str, dict] = {z: {"gpus": {A: {"count": 32}}} for z in
                              ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-west1-b")}
    zones["us-west1-b"]["region"] = "us-west1"
    pool = parse_pool({"zones": zones}, neo)
    # Two stages: at any depth the search (issue 29) finds 4 stages x 8, one stage per zone (0.1304
    # it/s), 0.9 % faster than its pipelines moved into zones (each stage's gradient ring then spans
    # four zones instead of one): no premise there. Two-stage plans are the case this test is about.
    req = PlanRequest(model="GPT-Neo-2.7", global_batch_size=1024, pool=pool,
                      options=SearchOptions(min_stages=2, max_stages=2))
    res = plan(req, neo)
    assert res.plan is not None and res.estimate is not None and res.plan.num_stages == 2
    # The premise, checked under the simulator: the fastest plan moved to whole pipelines per zone.
    inside = _pipelines_in_zones(res.plan, pool)
    assert inside is not None
    r_in = simulate(inside, neo, options=sim_options(pool, "fp32", "1f1b"))
    # (0.09 % slower when this was written; should the simulator come to price rings across zones above
    # the sends saved, the premise fails here, and the case needs a pool where it holds)
    assert r_in.throughput_iterations_per_s >= res.estimate.throughput_iterations_per_s * (1 - 0.005), (
        "premise: whole pipelines per zone are within the 0.5 % tolerance of the fastest plan")
    # nothing on the frontier is faster than the chosen plan, and a cheaper one within the tolerance keeps
    # every pipeline inside a zone
    assert all(f.iterations_per_s <= res.estimate.throughput_iterations_per_s * (1 + 1e-9) for f in res.frontier)
    near = [f for f in res.frontier if not f.chosen
            and f.iterations_per_s >= res.estimate.throughput_iterations_per_s * (1 - 0.005)
            and f.usd_per_iteration < res.estimate.usd_per_iteration]
    assert near and any(all(len({st.replicas[j].zone for st in f.plan.stages}) == 1
                            for j in range(f.plan.data_parallel)) for f in near)
    assert "Within 0.5% of this throughput" in res.explanation

def _assert_on_frontier(res) -> None:
    """The chosen plan is a point of the frontier shown, marked, and no frontier point beats it on both goals."""
    marked = [f for f in res.frontier if f.chosen]
    assert len(marked) == 1 and marked[0].plan == res.plan
    e = res.estimate
    assert marked[0].iterations_per_s == pytest.approx(e.throughput_iterations_per_s)
    for f in res.frontier:
        assert not (f.iterations_per_s >= e.throughput_iterations_per_s and f.usd_per_iteration < e.usd_per_iteration)
        assert not (f.iterations_per_s > e.throughput_iterations_per_s and f.usd_per_iteration <= e.usd_per_iteration)


def test_the_chosen_plan_lies_on_the_frontier_for_every_objective(book) -> None:
    pool = _pool(book, {"us-central1-a": {A: 32, V: 96}})
    for obj in (Objective.MAX_THROUGHPUT, Objective.MIN_COST):
        res = plan(PlanRequest(model="OPT-350", global_batch_size=1024, pool=pool, objective=obj,
                               options=SearchOptions(wide_frontier=True)), book)
        _assert_on_frontier(res)


@pytest.mark.parametrize("tp_last", [1, 2], ids=["slices", "full-layout"])
def test_tied_head_exchange_is_billed_once_by_the_simulator_and_the_search(tmp_path: Path, tp_last: int) -> None:
    """A tied model split over stages: our runtime adds the embedding's and the head's gradients after
    the rings (tied_weights.TiedWeights.sync). The simulator bills it after the first and last stages' rings, with
    its egress, and the search's estimate composes the same term."""
    from sailor_core.planner import build_slots
    from sailor_core.planner.estimate import estimate
    from sailor_core.planner.placement import place
    from sailor_core.planner.space import Problem, Sketch
    from sailor_core.planner.verify import materialize

    neo = seed_book("GPT-Neo-2.7", tmp_path)
    tied = replace(neo, model=replace(neo.model, tied_head=True))
    pool = _pool(neo, {"us-central1-a": {A: 8}, "us-west1-b": {A: 8}})
    slots = build_slots(pool)
    west = next(i for i, s in enumerate(slots) if s.zones[0][0] == "us-west1-b")
    central = next(i for i, s in enumerate(slots) if s.zones[0][0] == "us-central1-a")
    n = neo.model.num_layers
    sk = Sketch(mbs=1, bounds=((0, n // 2 - 1), (n // 2, n - 1)), kinds=((central, 1), (west, tp_last)), dp=2)
    results = {}
    for name, bk in (("untied", neo), ("tied", tied)):
        problem = Problem(num_layers=n, global_batch_size=16, tokens_per_sample=bk.model.sequence_length,
                          slots=slots, mbs_values=(1,), tp_values=(1, 2))
        lay = place(slots, sk)
        assert lay is not None
        est = estimate(problem, SimCosts(bk), sk, lay)
        assert est is not None
        p = materialize(sk, lay, slots, model="GPT-Neo-2.7", global_batch_size=16)
        results[name] = (est, simulate(p, bk, options=sim_options(pool, "fp32", "1f1b")), p)
    (e0, s0, p), (e1, s1, _) = results["untied"], results["tied"]
    weight_gb = neo.model.vocab_size * neo.model.hidden_size * 4 / 1e9
    exchange = s1.iteration_time_s - s0.iteration_time_s
    assert exchange > 0.05  # 1.3 GB of fp32 gradients between two regions, per pipeline
    a, b = p.stages[0].replicas[0], p.stages[-1].replicas[0]
    assert exchange <= model_for(tied).tied_sync_s(a, b, same_node=False) * (1 + 1e-9)
    crossing = neo.egress_usd_per_gb(a.zone, b.zone) + neo.egress_usd_per_gb(b.zone, a.zone)
    assert s1.egress_usd_per_iteration - s0.egress_usd_per_iteration == pytest.approx(2 * weight_gb * crossing)
    # one model: the search's estimate of the same plan is the simulator's
    assert e1.iteration_s == pytest.approx(s1.iteration_time_s, rel=1e-6)
    assert e1.usd_per_iteration == pytest.approx(s1.usd_per_iteration, rel=1e-6)
    assert e0.iteration_s == pytest.approx(s0.iteration_time_s, rel=1e-6)
