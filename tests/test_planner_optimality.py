"""Optimality: on small random pools the planner's best plan is within 1% of brute force.

Both sides are scored by the same full simulator; brute force enumerates the planner's whole plan
space (every microbatch size, stage count, contiguous split, GPU kind and TP per stage, data
parallel degree and zone fill start). The worlds are random: profiles, memory, links, prices and
pool contents vary with the seed, and the objective rotates over the three objectives.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from sailor_core.domain import Capacity, Market, ResourcePool
from sailor_core.planner import Objective, PlanRequest, SearchOptions, plan
from sailor_core.planner.verify import objective_value
from tests.planner_fixtures import MODEL, multi_region_world, tiny_book
from tests.planner_oracle import exhaustive_best

MAX_STAGES = 3
OBJECTIVES = (Objective.MAX_THROUGHPUT, Objective.MIN_COST, Objective.MIN_COST_PER_TOKEN)


def random_pool(seed: int, book, counts=(2, 4)) -> ResourcePool:
    rng = random.Random(seed)
    entries = []
    for zone in ("r1-a", "r1-b"):
        for gpu in ("fast", "slow"):
            if rng.random() < 0.6:
                base = book.price_usd_per_gpu_hour(zone, gpu, Market.ON_DEMAND)
                entries.append(
                    Capacity(
                        zone=zone,
                        region="r1",
                        gpu_type=gpu,
                        gpus=rng.choice(counts),
                        gpus_per_vm=2,
                        usd_per_gpu_hour=round(base * rng.uniform(0.8, 1.2), 3),
                    )
                )
    if not entries:
        entries.append(Capacity(zone="r1-a", region="r1", gpu_type="fast", gpus=4, gpus_per_vm=2,
                                 usd_per_gpu_hour=3.0))
    return ResourcePool(entries=tuple(entries))


def case(seed: int, *, counts=(2, 4), max_stages: int = MAX_STAGES, gbs: int = 16,
         memory_gib: tuple[float, float] = (6.0, 3.0)):
    book = tiny_book(seed, memory_gib=memory_gib)
    req = PlanRequest(model=MODEL, global_batch_size=gbs, pool=random_pool(seed, book, counts),
                      objective=OBJECTIVES[seed % 3], options=SearchOptions(max_stages=max_stages))
    ours = plan(req, book)
    _, best, n = exhaustive_best(req, book, max_stages=max_stages)
    return req, ours, best, n


@pytest.mark.parametrize("seed", range(100, 120))
def test_within_one_percent_of_brute_force(seed: int) -> None:
    req, ours, best, n = case(seed)
    assert n > 0
    if best is None:
        assert ours.plan is None
        return
    assert ours.plan is not None and ours.estimate.fits_memory
    got, opt = objective_value(req.objective, ours.estimate), objective_value(req.objective, best)
    assert got <= opt * 1.01, f"seed {seed}: planner {got:.6g} vs brute force {opt:.6g} ({req.objective.value})"


# Worlds where memory binds (GPUs of 2.2 and 1.8 GiB, or 2.5 and 2.0): few kinds fit a stage, so the
# cheapest per stage often sit in different zones, whose sends pay egress every microbatch (the DP's
# price key counts it: 100, 131, 146), and some pools fit only recomputing, at a smaller TP than the
# one that fits without (174: 2 fast GPUs, the plain stage needs tp 2 of them). Brute force includes
# the recomputing plans as the planner's second pass searches them (101, 106, 108 need them).
TIGHT = [(100, (2.2, 1.8)), (131, (2.2, 1.8)), (146, (2.5, 2.0)), (174, (2.5, 2.0)), (101, (2.2, 1.8)),
         (106, (2.2, 1.8)), (108, (2.2, 1.8))]


@pytest.mark.parametrize("seed,memory", TIGHT)
def test_where_memory_binds_within_the_tolerance_of_brute_force(seed: int, memory: tuple[float, float]) -> None:
    req, ours, best, n = case(seed, memory_gib=memory)
    assert best is not None and ours.plan is not None and ours.estimate.fits_memory
    got, opt = objective_value(req.objective, ours.estimate), objective_value(req.objective, best)
    assert got <= opt * (1 + req.options.tolerance), f"seed {seed}: planner {got:.6g} vs brute force {opt:.6g}"


def test_brute_force_recomputes_as_the_planner_may() -> None:
    """"auto": plans as they are while any fits in memory, else each stage recomputing exactly where it
    must; "never" finds nothing where only recomputing fits; "always" recomputes every stage."""
    book = tiny_book(101, memory_gib=(2.2, 1.8))
    req = PlanRequest(model=MODEL, global_batch_size=16, pool=random_pool(101, book), objective=Objective.MIN_COST,
                      options=SearchOptions(max_stages=MAX_STAGES))
    never = replace(req, options=replace(req.options, recompute="never"))
    assert exhaustive_best(never, book, max_stages=MAX_STAGES)[0] is None
    auto, r, _ = exhaustive_best(req, book, max_stages=MAX_STAGES)
    assert auto is not None and r is not None and r.fits_memory
    assert any(st.recompute for st in auto.stages) and not all(st.recompute for st in auto.stages)
    always = replace(req, options=replace(req.options, recompute="always"))
    every, r_every, _ = exhaustive_best(always, book, max_stages=MAX_STAGES)
    assert every is not None and all(st.recompute for st in every.stages)
    assert objective_value(req.objective, r) <= objective_value(req.objective, r_every)
    roomy = tiny_book(101)  # 6 and 3 GiB: plans fit as they are, and brute force keeps to them
    plain, _, _ = exhaustive_best(replace(req, pool=random_pool(101, roomy)), roomy, max_stages=MAX_STAGES)
    assert plain is not None and not any(st.recompute for st in plain.stages)


@pytest.mark.parametrize("seed", range(200, 206))
def test_constrained_within_one_percent_of_brute_force(seed: int) -> None:
    """Limits placed mid-frontier, so they bind: min cost with a minimum it/s, max it/s within a budget."""
    from sailor_core.planner import Constraints

    book = tiny_book(seed)
    base = PlanRequest(model=MODEL, global_batch_size=16, pool=random_pool(seed, book, (2, 4, 6)),
                       options=SearchOptions(max_stages=MAX_STAGES))
    front = plan(base, book).frontier
    if len(front) < 2:
        pytest.skip("frontier has a single point: no binding limit to place")
    mid_thr = (front[0].iterations_per_s + front[-1].iterations_per_s) / 2
    mid_usd = (front[0].usd_per_iteration + front[-1].usd_per_iteration) / 2
    if seed % 2:
        req = replace(base, objective=Objective.MIN_COST, constraints=Constraints(min_iterations_per_s=mid_thr))
    else:
        req = replace(base, constraints=Constraints(max_usd_per_iteration=mid_usd))
    ours = plan(req, book)
    _, best, _ = exhaustive_best(req, book, max_stages=MAX_STAGES)
    assert best is not None and ours.plan is not None
    e = ours.estimate
    assert not req.constraints.violations(usd_per_iteration=e.usd_per_iteration, usd_per_hour=e.usd_per_hour,
                                          iterations_per_s=e.throughput_iterations_per_s)
    got, opt = objective_value(req.objective, e), objective_value(req.objective, best)
    assert got <= opt * 1.01, f"seed {seed}: planner {got:.6g} vs brute force {opt:.6g}"


GROUP_GPUS = ("fast", "mid", "slow")


def group_world(seed: int, gbs: int = 8, memory_gib: tuple[float, float, float] = (6.0, 4.0, 3.0)):
    """Three GPU types in one zone, 1-3 of each, TP 1: small enough to brute-force pipeline kinds."""
    book = tiny_book(seed, gpus=GROUP_GPUS, memory_gib=memory_gib, zones=("r1-a",), tps=(1,))
    rng = random.Random(seed)
    pool = ResourcePool(entries=tuple(
        Capacity(zone="r1-a", region="r1", gpu_type=g, gpus=rng.choice((1, 2, 3)), gpus_per_vm=2,
                  usd_per_gpu_hour=3.0 / (1 + k)) for k, g in enumerate(GROUP_GPUS)))
    return book, PlanRequest(model=MODEL, global_batch_size=gbs, pool=pool, options=SearchOptions(max_stages=2))


# 8: its optimum runs a slow GPU type at a microbatch size none of the best single-kind plans runs (7.8 % off
# when the group search collected types only at those plans' sizes)
@pytest.mark.parametrize("seed", [0, 1, 4, 6, 7, 8, 9])
def test_any_shape_per_pipeline_microbatch_space_within_one_percent_of_brute_force(seed: int) -> None:
    """Brute force over every set of up to 3 pipeline kinds (own microbatch size, own GPU kinds per
    stage), their counts and every way to share the batch; the planner within 1% of it."""
    from tests.planner_oracle import exhaustive_groups_best

    book, req = group_world(seed)
    ours = plan(req, book)
    _, best, n = exhaustive_groups_best(req, book, max_stages=2, max_groups=3)
    assert n > 0 and best is not None and ours.plan is not None
    got, opt = objective_value(req.objective, ours.estimate), objective_value(req.objective, best)
    assert got <= opt * 1.01, f"seed {seed}: planner {got:.6g} vs brute force {opt:.6g}"


# Where memory binds on the smaller GPUs (a sweep of seeds 0-20 at four memory sizes found these):
# seed 1 at 5/3.5/2.6 GiB came out 16 % slower than brute force while the kinds were looked for only
# on the best plans' layer split, which the middle GPU cannot hold a pipeline of (own_splits), and
# 10 % slower while pipelines were balanced by their time from 1 to 2 microbatches (linear_time);
# seed 10 there came out 6 % slower while splits came only from the best plans (its optimum pairs
# each of 3 fast GPUs with a weak one that holds the head alone: mixed_kind_splits);
# at 3.5/2.8/2.0 GiB the optimum recomputes activations.
GROUP_TIGHT = [(1, (5.0, 3.5, 2.6)), (10, (5.0, 3.5, 2.6)), (0, (3.5, 2.8, 2.0)), (15, (3.5, 2.8, 2.0)),
               (0, (4.0, 3.0, 2.2))]


@pytest.mark.parametrize("seed,memory", GROUP_TIGHT)
def test_pipeline_kinds_where_memory_binds_within_one_percent_of_brute_force(
        seed: int, memory: tuple[float, float, float]) -> None:
    from tests.planner_oracle import exhaustive_groups_best

    book, req = group_world(seed, gbs=16, memory_gib=memory)
    ours = plan(req, book)
    found, best, n = exhaustive_groups_best(req, book, max_stages=2, max_groups=3)
    assert n > 0 and found is not None and best is not None and ours.plan is not None
    assert ours.estimate.fits_memory and best.fits_memory
    got, opt = objective_value(req.objective, ours.estimate), objective_value(req.objective, best)
    assert got <= opt * 1.01, f"seed {seed}: planner {got:.6g} vs brute force {opt:.6g}"
    if memory == (3.5, 2.8, 2.0):  # nothing fits as it is: both recompute, where they must
        assert any(st.recompute for st in found.stages) and any(st.recompute for st in ours.plan.stages)


@pytest.mark.parametrize("seed", [*range(3, 9), 12, 21])
def test_multi_region_pools_with_pipelines_across_zones_within_the_tolerance(seed: int) -> None:
    """Four zones in two regions, one GPU type at equal or different prices (issue 29): brute force
    enumerates pipelines across zones and across regions (every stage on any region's slot, every zone
    fill); no enumerated plan beats the planner's by more than the tolerance. Before the assign step
    ranked its end states with their sends, seed 6 came out 2.8 % slower than brute force and 12 2.3 %
    (with only the best by the send floor estimated, 12 still did); 21 came out 1.7 % slower while the
    DP kept one path per usage (the order of kinds that sends more cheaply to the next stage was
    merged away before the end)."""
    book, req = multi_region_world(seed)
    ours = plan(req, book)
    crossing = {"zones": 0, "regions": 0}

    def count(pl, _r) -> None:
        for j in range(pl.data_parallel):
            zones = {st.replicas[j].zone for st in pl.stages}
            crossing["zones"] += len(zones) > 1
            crossing["regions"] += len({z[:2] for z in zones}) > 1

    _, best, n = exhaustive_best(req, book, max_stages=3, seen=count)
    assert n > 0 and crossing["zones"] > 0 and crossing["regions"] > 0
    e = ours.estimate
    assert best is not None and ours.plan is not None and e is not None and e.fits_memory
    got, opt = objective_value(req.objective, e), objective_value(req.objective, best)
    tol = req.options.tolerance
    assert got <= opt * (1 + tol) * (1 + 1e-9), (
        f"seed {seed}: planner {got:.6g} vs brute force {opt:.6g} ({req.objective.value}), more than {tol:.1%}")


@pytest.mark.parametrize("seed", [3, 30])
def test_a_stage_whose_replicas_span_regions_is_found_when_it_is_the_optimum(seed: int) -> None:
    """In these worlds the brute-force optimum has a stage with data-parallel replicas in both regions,
    which per-region slots cannot express (a stage's replicas come from one slot). The planner's search
    over slots that pool a GPU type's regions reaches it; without it the plan is 1.7 % (seed 3) and
    2.4 % (seed 30) slower, beyond the tolerance."""
    book, req = multi_region_world(seed)
    best_plan, best, _ = exhaustive_best(req, book, max_stages=3)
    assert best_plan is not None and best is not None
    assert any(len({r.region for r in st.replicas}) > 1 for st in best_plan.stages)
    tol = req.options.tolerance
    ours = plan(req, book).estimate
    assert ours is not None
    assert objective_value(req.objective, ours) <= objective_value(req.objective, best) * (1 + tol) * (1 + 1e-9)
    per_region = plan(replace(req, options=replace(req.options, replicas_across_regions=False)), book).estimate
    assert per_region is not None
    assert objective_value(req.objective, per_region) > objective_value(req.objective, best) * (1 + tol)


def test_the_search_across_regions_runs_only_where_the_best_plans_cross_regions() -> None:
    """The second search (slots that pool regions) costs a search: it runs when one of the best plans
    has stages in different regions (seed 3's), not when they all stay in one region (seed 1's one-GPU
    plan), and never with `replicas_across_regions` off."""
    for seed, expected in ((3, True), (1, False)):
        book, req = multi_region_world(seed)
        assert ("replicas across regions" in plan(req, book).stats.passes) is expected, seed
        off = plan(replace(req, options=replace(req.options, replicas_across_regions=False)), book)
        assert "replicas across regions" not in off.stats.passes
