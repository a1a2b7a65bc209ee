"""Pipelines across zones and regions: the search reaches them, and its bounds stay below them.

Issue 29: on 5 zones x 128 A100-40 (four of them in us-central1, one in us-west1) for GPT-Neo-2.7
at batch 2048, the search returned 3 stages x 41 pipelines (0.1955 it/s under the simulator) while
5 stages x 25 pipelines, each pipeline crossing zones of us-central1, runs 0.2042 it/s (+4.4 %),
and 4 stages x 32 (one stage per zone) 0.2134 (+9.1 %). The assign step's DP sees compute and
price only: the same GPU at the same price in two regions ties, and the tie went to the usage
vector that sorts first, which put a stage in us-west1 (a cross-region hop); the all-us-central1
assignment was never estimated. `assign.with_sends` ranks the DP's end states with each boundary's
send floor too; `bounds.SketchFloors` bounds the picks it adds with their sends.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from sailor_core.domain import ParallelPlan, Replica, Stage, split_batch
from sailor_core.planner import PlanRequest, parse_pool, plan
from sailor_core.planner.assign import usage_dp
from sailor_core.planner.bounds import Floor, SketchFloors, bound, floor_of
from sailor_core.planner.core import problem_of
from sailor_core.planner.costs import SimCosts
from sailor_core.planner.estimate import estimate
from sailor_core.planner.links import LinkFloors
from sailor_core.planner.picks import end_states, fronts, reconstruct
from sailor_core.planner.scoring import Goal
from sailor_core.planner.shapes import bounds_from_cuts, stage_table
from sailor_core.planner.slots import build_slots
from sailor_core.planner.space import PIPELINE_MAJOR, STAGE_MAJOR, Problem, Sketch
from sailor_core.planner.verify import sim_options
from sailor_core.simulator import simulate
from tests.planner_fixtures import multi_region_world

CENTRAL = ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f")


def _neo_pool(book):
    zones: dict[str, dict] = {z: {"gpus": {"A100-40": {"count": 128, "gpus_per_node": 4}}}
                              for z in (*CENTRAL, "us-west1-b")}
    zones["us-west1-b"]["region"] = "us-west1"
    return parse_pool({"zones": zones}, book)


def _stage_major(book, sizes: list[int], dp: int, tp: int, mbs: int) -> ParallelPlan:
    """Each stage's dp replicas fill the us-central1 zones in order (128 GPUs each): pipelines cross zones."""
    free = dict.fromkeys(CENTRAL, 128)
    stages, first = [], 0
    for size in sizes:
        reps: list[Replica] = []
        for z in CENTRAL:
            while len(reps) < dp and free[z] >= tp:
                reps.append(Replica(gpu_type="A100-40", zone=z, tp=tp, gpus_per_node=4))
                free[z] -= tp
        stages.append(Stage(first_layer=first, last_layer=first + size - 1, replicas=tuple(reps)))
        first += size
    assert first == book.model.num_layers
    return ParallelPlan(model="GPT-Neo-2.7", global_batch_size=2048, stages=tuple(stages),
                        pipelines=split_batch(2048, [mbs] * dp))


def test_the_search_reaches_the_deeper_cross_zone_plan(tmp_path: Path) -> None:
    from profiles_store.store import open_store

    neo = open_store(str(tmp_path)).profile_book("GPT-Neo-2.7")
    pool = _neo_pool(neo)
    so = sim_options(pool, "fp32", "1f1b")
    # the reference planner's shape: 5 stages x 25 tp-4 replicas, pipelines across zones
    theirs = simulate(_stage_major(neo, [5, 7, 7, 7, 8], dp=25, tp=4, mbs=2), neo, options=so)
    assert theirs.fits_memory
    res = plan(PlanRequest(model="GPT-Neo-2.7", global_batch_size=2048, pool=pool), neo)
    assert res.plan is not None and res.estimate is not None and res.estimate.fits_memory
    ours = res.estimate.throughput_iterations_per_s
    # 0.1955 it/s (3 x 41, pipelines in zones) before the fix; 0.2042 theirs; 0.2134 ours after
    assert ours >= theirs.throughput_iterations_per_s * (1 - 0.005), (
        f"ours {ours:.4f} it/s vs 5 x 25 across zones {theirs.throughput_iterations_per_s:.4f}")
    crossing = [j for j in range(res.plan.data_parallel) if len({st.replicas[j].zone for st in res.plan.stages}) > 1]
    assert crossing, "the faster plans here cross zones: the chosen one should too"


def test_equal_gpus_in_two_regions_the_front_keeps_a_pipeline_in_one() -> None:
    """The DP's keys tie between two slots of one GPU at one price; the send floor breaks the tie."""
    # three stages, each 1.0 s on a tp-1 GPU of slot 0 (region A, 6 GPUs) or slot 1 (region B, 2 GPUs)
    options = [[(0, 1, 1.0, 2.0), (1, 1, 1.0, 2.0)] for _ in range(3)]
    inside, across = (0.01, 0.01), (0.5, 0.5)
    pairs = {((a, 1), (b, 1)): inside if a == b else across for a in (0, 1) for b in (0, 1)}
    caps = (6, 2)
    dp = usage_dp(options, caps, [pairs, pairs])
    assert dp is not None
    layers, states = dp.layers, dp.last
    ends = end_states(states, caps, None)
    lb = Floor(options=(((1, 1.0),),) * 3, fill=(0.0,) * 2, act=(0.0,) * 3, grad=(0.0,) * 3, opt=0.0, rate=0.0,
               gpus=8)
    pb = Problem(num_layers=3, global_batch_size=8, tokens_per_sample=1, slots=(), mbs_values=(1,), tp_values=(1,))
    got = {pk.d: (pk.front, pk.with_sends) for pk in fronts(pb, Goal.of_problem(pb), ends, 1.0, 8, [2], lb,
                                                             lambda: math.inf)}
    front, extra = got[2]
    # at D = 2 both (3, 0) (every stage in region A) and (2, 1) fit; they tie on compute and price,
    # and (2, 1), one stage in region B, sorts first: the front alone never estimates (3, 0)
    assert {u for u, _ in front} == {(2, 1)}
    assert [u for u, _ in extra] == [(3, 0)] and reconstruct(layers, extra[0]) == ((0, 1), (0, 1), (0, 1))


def test_a_path_that_sends_more_cheaply_to_what_follows_is_kept_though_slower_so_far() -> None:
    """Hand case: slot 0 (region A, 1 GPU) and slot 1 (region B, 2 GPUs); within a region a stage's
    sends cost 0.01 s each way, across 0.5 s. Stage 0 takes 1.1 s on A or 1.0 s on B, stage 1 1.0 s
    on A or 1.1 s on B, stage 2 runs on B only. The only end usage is (1, 2), by two paths:
    B, A, B: 3.0 s of stages + 2 x 1.0 s of sends = 5.0 s, and A, B, B: 3.2 s + 1.0 + 0.02 = 4.22 s.
    After two stages both sit at usage (1, 1) and B, A is faster so far (2.0 s against 2.2 s); the
    time with sends must still reach A, B, B."""
    two = [(0, 1, 1.1, 0.0), (1, 1, 1.0, 0.0)], [(0, 1, 1.0, 0.0), (1, 1, 1.1, 0.0)]
    options = [*two, [(1, 1, 1.0, 0.0)]]
    inside, across = (0.01, 0.01), (0.5, 0.5)
    pairs = {((a, 1), (b, 1)): inside if a == b else across for a in (0, 1) for b in (0, 1)}
    caps = (1, 2)
    dp = usage_dp(options, caps, [pairs, pairs])
    assert dp is not None
    layers, states = dp.layers, dp.last
    ends = {reconstruct(layers, key): (p1, w) for key, (p1, _, _, _, w) in states.items()}
    assert set(ends) == {((1, 1), (0, 1), (1, 1)), ((0, 1), (1, 1), (1, 1))}
    assert ends[((1, 1), (0, 1), (1, 1))] == pytest.approx((3.0, 2.0))  # the keys' best: fastest compute
    assert ends[((0, 1), (1, 1), (1, 1))] == pytest.approx((3.2, 1.02))  # the best with sends
    lb = Floor(options=(((1, 1.0),),) * 3, fill=(0.0,) * 2, act=(0.0,) * 3, grad=(0.0,) * 3, opt=0.0, rate=0.0,
               gpus=8)
    pb = Problem(num_layers=3, global_batch_size=8, tokens_per_sample=1, slots=(), mbs_values=(1,), tp_values=(1,))
    (pick,) = fronts(pb, Goal.of_problem(pb), end_states(states, caps, None), 1.1, 8, [1], lb, lambda: math.inf)
    assert [reconstruct(layers, k) for k in pick.with_sends] == [((0, 1), (1, 1), (1, 1))]


def test_under_a_cost_objective_the_price_key_counts_the_egress_of_the_sends() -> None:
    """Hand case, min cost: slot 0 (zone a, 1 GPU at 1.0 USD/h) and slot 1 (zone b, 2 GPUs at 1.2 USD/h),
    two stages. Split over the zones (1.0 + 1.2 = 2.2 USD/h) is cheaper than both stages in zone b
    (2.4 USD/h) on GPUs alone, but each microbatch's sends across pay 0.00025 USD of egress; at one
    microbatch every 2 s (tau) that is 0.45 USD/h more, so zone b alone is the cheaper path."""
    options = [[(0, 1, 1.0, 2.0), (1, 1, 1.2, 2.0)] for _ in range(2)]
    caps = (1, 2)
    tolls = [{((a, 1), (b, 1)): 0.0 if a == b else 0.00025 for a in (0, 1) for b in (0, 1)}]

    def cheapest(**kw: object) -> tuple[tuple[int, int], ...]:
        dp = usage_dp(options, caps, speed_first=False, **kw)  # type: ignore[arg-type]
        assert dp is not None
        layers, states = dp.layers, dp.last
        return reconstruct(layers, min(states, key=lambda k: states[k][0]))

    assert sorted(cheapest()) == [(0, 1), (1, 1)]  # GPUs alone: split over the zones
    assert cheapest(tolls=tolls, toll_rate=3600 / 2.0) == ((1, 1), (1, 1))


@pytest.mark.parametrize("objective", ["max-throughput", "min-cost"])
@pytest.mark.parametrize("seed", range(8))
def test_the_sketch_bound_with_sends_is_never_above_the_estimate(seed: int, objective: str) -> None:
    """`SketchFloors.score` with the kinds' send floors, the split's `bound` at the sketch's own
    bottleneck and the stage count's `DepthFloors.floor`, on random sketches of a multi-region world
    (every split, kinds, D, zone rotation and fill; under min-cost with a second, slower GPU type at its
    own price: the floors' least USD of the work): never above the estimate's score."""
    import dataclasses

    from sailor_core.planner import Objective
    from sailor_core.planner.bounds import DepthFloors

    book, req = multi_region_world(seed, slow_share=0.0 if objective == "max-throughput" else 0.5)
    req = dataclasses.replace(req, objective=Objective.parse(objective))
    slots = build_slots(req.pool)
    pb = problem_of(req, book, slots)
    costs = SimCosts(book)
    goal = Goal.of_problem(pb)
    links = LinkFloors(pb, costs)
    floors = SketchFloors(pb, costs, goal, links)
    depths = DepthFloors(pb, costs, goal)
    kinds_all = [(s.index, tp) for s in slots for tp in pb.tp_values if tp <= s.gpus_per_node]
    rng = random.Random(seed)
    checked = 0
    for _ in range(600):
        mbs, p = rng.choice(pb.mbs_values), rng.choice((1, 2, 3))
        n = pb.global_batch_size // mbs
        bounds = bounds_from_cuts(sorted(rng.sample(range(1, pb.num_layers), p - 1)), pb.num_layers)
        kinds = tuple(rng.choice(kinds_all) for _ in range(p))
        sk = Sketch(mbs=mbs, bounds=bounds, kinds=kinds, dp=rng.randint(1, n),
                    zone_rot=tuple(rng.randrange(len(s.zones)) for s in slots),
                    placement=rng.choice((STAGE_MAJOR, PIPELINE_MAJOR)))
        e = estimate(pb, costs, sk)
        if e is None or not math.isfinite(e.iteration_s):
            continue
        checked += 1
        lb = floors.score(mbs, bounds, kinds, sk.dp, n, math.inf)
        assert lb <= goal.of(e) * (1 + 1e-9), f"seed {seed}: {sk} bound {lb:.6g} > {goal.of(e):.6g}"
        assert floors.score(mbs, bounds, kinds, sk.dp, n, math.inf, sends=False) <= lb * (1 + 1e-12)
        assert depths.floor(mbs, p) <= goal.of(e) * (1 + 1e-9), f"seed {seed}: {sk} depth floor above its estimate"
        # the split's bound at the sketch's own bottleneck (the sweep stops on it), where its kinds fit
        table = stage_table(pb, costs, mbs, bounds)
        times = [dict(table[i][si]).get(tp) for i, (si, tp) in enumerate(kinds)] if table else [None]
        if table is None or None in times:
            continue
        tau = max(t for t in times if t is not None)
        split = bound(goal, tau, floor_of(pb, costs, links, mbs, bounds, table), n, [sk.dp])
        assert split <= goal.of(e) * (1 + 1e-9), f"seed {seed}: {sk} split bound {split:.6g} > {goal.of(e):.6g}"
    assert checked > 50


@pytest.mark.parametrize("speed_first", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_pruning_the_dp_keeps_every_state_the_search_can_pick(seed: int, speed_first: bool) -> None:
    """Random DPs (2-3 slots, TP 1-2, 3-5 stages, random times, prices and sends per pair of kinds, a GPU
    limit on some, some copies D no longer worth estimating), for max throughput and for a cost
    objective: `usage_dp` keeps the first track's end states at every usage that fits a D still
    estimated, and at each such D `with_sends`'s picks have the same values as from both tracks run
    whole."""
    from sailor_core.planner.assign import BY_KEYS, _keys_track, _sends_track, copies
    from sailor_core.planner.picks import with_sends

    rng = random.Random(seed)
    slots = rng.randint(2, 3)
    caps = tuple(rng.randint(2, 8) for _ in range(slots))
    kinds = [(g, tp) for g in range(slots) for tp in (1, 2)]
    stages = rng.randint(3, 5)
    timed = [[(g, tp, rng.uniform(0.5, 2.0) / tp ** 0.7, tp * rng.uniform(1, 3)) for g, tp in
              rng.sample(kinds, rng.randint(2, len(kinds)))] for _ in range(stages)]
    # options are (slot, tp, primary, secondary): time first for throughput, price first for cost
    options = timed if speed_first else [[(g, tp, y, x) for g, tp, x, y in row] for row in timed]
    sends = [{(a, b): (rng.uniform(0, 0.6), rng.uniform(0, 0.6)) for a in kinds for b in kinds}
             for _ in range(stages - 1)]
    max_gpus = rng.choice([None, sum(caps) // 2])
    live = sorted(rng.sample(range(1, max(caps) + 1), rng.randint(1, max(caps)))) if seed % 2 else None
    pruned = usage_dp(options, caps, sends, speed_first, max_gpus, live)
    keyed = _keys_track(options, caps, sends)
    least = min(live) if live else 1
    fits = {k: v for k, v in keyed[0][-1].items() if copies(k[0], caps, max_gpus) >= least} if keyed else {}
    assert (pruned is None) == (not fits)
    if pruned is None:
        return
    assert keyed is not None
    whole = keyed[0][-1] | _sends_track(options, caps, sends, speed_first, None)[-1]
    assert {k: v for k, v in pruned[1].items() if k[1] == BY_KEYS} == fits
    assert len(pruned[1]) <= len(whole)

    def picks(states: dict, d: int) -> list[tuple[float, ...]]:
        eligible = sorted((p1, p2, key, w) for dd, p1, p2, key, w in end_states(states, caps, max_gpus) if dd >= d)
        by_state = {key: (p1, p2, w) for p1, p2, key, w in eligible}
        if not eligible:
            return []
        return [tuple(round(x, 9) for x in by_state[u]) for u in with_sends(eligible, speed_first)]

    for d in live or range(1, max(caps) + 1):
        assert picks(pruned[1], d) == picks(whole, d)


@pytest.mark.parametrize("seed", range(20))
def test_a_price_ceiling_drops_exactly_the_end_states_above_it(seed: int) -> None:
    """Cost objectives: with `price_ceiling` the first track ends in the same states and values as run
    whole, less those whose price key is above the ceiling (a path's prefix plus the least its later
    stages add never passes the ceiling its best completion keeps)."""
    from sailor_core.planner.assign import _keys_track

    rng = random.Random(seed)
    caps = tuple(rng.randint(2, 8) for _ in range(rng.randint(2, 3)))
    kinds = [(g, tp) for g in range(len(caps)) for tp in (1, 2)]
    options = [[(g, tp, tp * rng.uniform(1, 3), rng.uniform(0.5, 2.0)) for g, tp in
                rng.sample(kinds, rng.randint(2, len(kinds)))] for _ in range(rng.randint(2, 5))]
    live = sorted(rng.sample(range(1, max(caps) + 1), rng.randint(1, max(caps))))
    whole = _keys_track(options, caps, [], min(live))
    if whole is None:
        return
    ends = whole[1]
    prices = sorted(v[0] for v in ends.values())
    top = prices[len(prices) // 2]
    dp = usage_dp(options, caps, speed_first=False, live=live, price_ceiling=top)
    kept = {k: v for k, v in ends.items() if v[0] <= top}
    assert (dp is None) == (not kept)
    if dp is not None:
        assert {k: v[:2] for k, v in dp.last.items()} == {k: v[:2] for k, v in kept.items()}


def test_the_with_sends_track_keeps_the_best_of_each_copies_count_past_its_size(monkeypatch) -> None:
    """Past SENDS_TRACK_STATES a stage of the with-sends track keeps, for each number of copies its
    usages fit, the SENDS_TRACK_WIDTH states least by time with sends (then the other key)."""
    import sailor_core.planner.assign as assign
    from sailor_core.planner.assign import _sends_track, _thinned, copies

    rng = random.Random(7)
    caps = (8, 8, 6)
    states = {((a, b, c), cls): (rng.uniform(1, 5), rng.uniform(1, 5), None, None, rng.uniform(0, 2))
              for a in range(9) for b in range(9) for c in range(7) for cls in range(2)}
    for speed_first in (True, False):
        kept = _thinned(states, caps, speed_first)
        groups: dict[int, list] = {}
        for key, (p1, p2, _, _, w) in states.items():
            rank = (p1 + w, p2) if speed_first else (p2 + w, p1)
            groups.setdefault(copies(key[0], caps, None), []).append((rank, key))
        expected = {k for g in groups.values() for _, k in sorted(g)[:assign.SENDS_TRACK_WIDTH]}
        assert set(kept) == expected and all(kept[k] == states[k] for k in kept)
        assert any(len(g) > assign.SENDS_TRACK_WIDTH for g in groups.values())  # something was thinned

    kinds = [(g, tp) for g in range(3) for tp in (1, 2)]
    options = [[(g, tp, rng.uniform(0.5, 2.0), tp * rng.uniform(1, 3)) for g, tp in kinds] for _ in range(5)]
    sends = [{(a, b): (rng.uniform(0, 0.6), rng.uniform(0, 0.6)) for a in kinds for b in kinds} for _ in range(4)]
    whole = _sends_track(options, caps, sends, True, None)
    monkeypatch.setattr(assign, "SENDS_TRACK_STATES", 20)
    monkeypatch.setattr(assign, "SENDS_TRACK_WIDTH", 2)
    thin = _sends_track(options, caps, sends, True, None)
    assert len(thin) == len(whole) and max(len(layer) for layer in whole) > 20
    for layer in thin:
        per = [copies(key[0], caps, None) for key in layer]
        assert len(layer) <= 20 or max(per.count(d) for d in set(per)) <= 2


class _AllLinked:
    """The costs with every link taken as profiled: what the estimate times when nothing is ruled out first."""

    def __init__(self, costs: SimCosts) -> None:
        self._costs = costs

    def linked(self, *_: object) -> bool:
        return True

    def __getattr__(self, name: str) -> object:
        return getattr(self._costs, name)


def test_a_placement_needing_an_unprofiled_link_is_ruled_out_before_it_is_timed(tmp_path: Path) -> None:
    """GH-96 in the seed store reaches the other types only inside us-central1-a: on four zones of A100-40,
    V100-16 and GH-96, random placed sketches that need a link the store lacks (`needs_missing_link`) are
    exactly those whose timed estimate is infinite, and `estimate` answers None for them without timing."""
    from profiles_store.store import open_store
    from sailor_core.planner.estimate import needs_missing_link
    from sailor_core.planner.placement import place

    book = open_store(str(tmp_path / "store")).profile_book("OPT-350")
    zones = {z: {"gpus": {"A100-40": {"count": 32}, "V100-16": {"count": 64}, "GH-96": {"count": 16}}} for z in CENTRAL}
    req = PlanRequest(model="OPT-350", global_batch_size=1024, pool=parse_pool({"zones": zones}, book))
    slots = build_slots(req.pool)
    pb = problem_of(req, book, slots)
    costs = SimCosts(book)
    timed = _AllLinked(costs)
    kinds_all = [(s.index, tp) for s in slots for tp in pb.tp_values if tp <= s.gpus_per_node]
    rng = random.Random(7)
    missing = finite = 0
    for _ in range(400):
        p, mbs = rng.choice((1, 2, 3, 4)), rng.choice((1, 2, 4, 8))
        kinds = [k for k in kinds_all if costs.profiled(slots[k[0]].gpu_type, mbs, k[1])]
        sk = Sketch(mbs=mbs, kinds=tuple(rng.choice(kinds) for _ in range(p)),
                    bounds=bounds_from_cuts(sorted(rng.sample(range(1, pb.num_layers), p - 1)), pb.num_layers),
                    dp=rng.choice((1, 2, 4, 8, 16)), zone_rot=tuple(rng.randrange(len(s.zones)) for s in slots))
        lay = place(slots, sk)
        if lay is None:
            continue
        full = estimate(pb, timed, sk, lay)  # type: ignore[arg-type]
        assert full is not None
        ruled_out = needs_missing_link(slots, costs, sk, lay)
        assert ruled_out == (not math.isfinite(full.iteration_s)), sk
        assert (estimate(pb, costs, sk, lay) is None) == ruled_out
        missing += ruled_out
        finite += not ruled_out
    assert missing > 20 and finite > 20, (missing, finite)
