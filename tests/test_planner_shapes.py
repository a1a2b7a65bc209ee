"""Per-pipeline microbatch sizes and stages with any number of replica shapes (groups.py, mixed.py)."""

from __future__ import annotations

import random

import pytest

from sailor_core.planner import PlanRequest, SearchOptions, parse_pool, plan
from sailor_core.planner.groups import PipeType, split_batch_by_finish
from sailor_core.planner.mixed import _split
from sailor_core.planner.space import Sketch


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    from profiles_store.store import open_store

    return open_store(str(tmp_path_factory.mktemp("store"))).profile_book("OPT-350")


def _pool(book, gpus: dict[str, int]):
    return parse_pool({"zones": {"us-central1-a": {"gpus": {g: {"count": n, "usd_per_gpu_hour": 1.0}
                                                            for g, n in gpus.items()}}}}, book)


def test_batch_split_over_types_is_exact_and_balances_finish_times() -> None:
    rng = random.Random(4)
    for _ in range(200):
        k = rng.randint(1, 3)
        types = [PipeType(sketch=Sketch(mbs=rng.choice((1, 2, 4, 8)), bounds=((0, 1),), kinds=((0, 1),), dp=1),
                          use=(1,), fill_s=rng.uniform(0, 1), cycle_s=rng.uniform(0.1, 2)) for _ in range(k)]
        counts = [rng.randint(1, 5) for _ in range(k)]
        gbs = rng.choice((64, 256, 1000, 4096))
        m = split_batch_by_finish(gbs, types, counts)
        least = sum(c * t.sketch.mbs for t, c in zip(types, counts, strict=True))
        if m is None:
            # with a size-1 type and room for one microbatch per pipeline an exact split always exists
            assert all(t.sketch.mbs > 1 for t in types) or least > gbs
            continue
        assert sum(sum(ms) * t.sketch.mbs for t, ms in zip(types, m, strict=True)) == gbs
        assert all(len(ms) == c and min(ms) >= 1 for ms, c in zip(m, counts, strict=True))
        finish = [t.fill_s + t.cycle_s * x for t, ms in zip(types, m, strict=True) for x in ms]
        # no pipeline could take one more microbatch of the slowest's size and finish earlier than it
        slowest = max(finish)
        for t, ms in zip(types, m, strict=True):
            for x in ms:
                assert t.fill_s + t.cycle_s * (x - 1) <= slowest + 1e-9


def test_two_groups_share_the_batch_exactly_with_their_own_microbatch_sizes() -> None:
    for gbs, mbs_a, d_a, mbs_b, d_b in ((4096, 4, 8, 1, 8), (1024, 8, 3, 2, 5), (96, 4, 2, 1, 3)):
        got = _split(gbs, mbs_a, d_a, mbs_b, d_b, (0.5, 0.2), (0.3, 0.09))
        assert got is not None
        counts_a, m_b = got
        assert sum(counts_a) * mbs_a + d_b * m_b * mbs_b == gbs and len(counts_a) == d_a


def test_per_pipeline_microbatch_sizes_beat_one_size(book) -> None:
    # 8 GH-96 and 16 V100-16: the V100 pipelines (tp2) run microbatches of 1, the GH-96 ones of 4;
    # with one size for all the V100s sit in a deeper pipeline instead.
    req = PlanRequest(model="OPT-350", global_batch_size=4096, pool=_pool(book, {"GH-96": 8, "V100-16": 16}),
                      options=SearchOptions(tolerance=0.0))
    per_pipe = plan(req, book)
    one = plan(PlanRequest(model="OPT-350", global_batch_size=4096, pool=req.pool,
                           options=SearchOptions(tolerance=0.0, per_pipeline_microbatches=False)), book)
    assert per_pipe.plan is not None and one.plan is not None
    assert len({p.microbatch_size for p in per_pipe.plan.pipelines}) >= 2
    assert len({p.microbatch_size for p in one.plan.pipelines}) == 1
    assert per_pipe.estimate.throughput_iterations_per_s > 1.005 * one.estimate.throughput_iterations_per_s
    assert sum(p.samples for p in per_pipe.plan.pipelines) == 4096
    # the estimate times each pipeline with its own microbatch size and count; checked by hand: a
    # pipeline's rows carry its (mbs, m), its time is at least 1F1B's compute (m - 1) * max_s t_s + sum_s t_s
    # (t_s: forward + backward of one microbatch), the slowest is the pipeline part of the iteration,
    # and the batch split leaves no pipeline a whole microbatch behind another
    pl, est = per_pipe.plan, per_pipe.estimate
    b = est.breakdown
    assert {row.microbatch_size for row in est.per_stage} == {p.microbatch_size for p in pl.pipelines}
    slowest_t = 0.0
    for j, pipe in enumerate(pl.pipelines):
        rows = [row for row in est.per_stage if row.replica == j]
        assert len(rows) == pl.num_stages
        assert all((row.microbatch_size, row.num_microbatches) == (pipe.microbatch_size, pipe.num_microbatches)
                   for row in rows)
        t = [row.forward_s + row.backward_s for row in rows]
        slowest_t = max(slowest_t, *t)
        assert b.pipeline_time_per_pipeline_s[j] >= ((pipe.num_microbatches - 1) * max(t) + sum(t)) * (1 - 1e-9)
    assert max(b.pipeline_time_per_pipeline_s) == pytest.approx(b.pipeline_compute_s + b.pipeline_p2p_s)
    assert max(b.pipeline_time_per_pipeline_s) - min(b.pipeline_time_per_pipeline_s) <= slowest_t
    assert est.iteration_time_s == pytest.approx(
        b.pipeline_compute_s + b.pipeline_p2p_s + b.dp_sync_exposed_s + b.optimizer_s)


def test_any_shape_stages_beat_two_shapes(book) -> None:
    req = PlanRequest(model="OPT-350", global_batch_size=4096,
                      pool=_pool(book, {"GH-96": 4, "A100-40": 8, "V100-16": 8}), options=SearchOptions(tolerance=0.0))
    many = plan(req, book)
    two = plan(PlanRequest(model="OPT-350", global_batch_size=4096, pool=req.pool,
                           options=SearchOptions(tolerance=0.0, max_shapes=2)), book)
    assert many.plan is not None and two.plan is not None
    assert max(len({r.gpu_type for r in st.replicas}) for st in many.plan.stages) == 3
    assert max(len({(r.gpu_type, r.tp, r.zone) for r in st.replicas}) for st in two.plan.stages) <= 2
    assert many.estimate.throughput_iterations_per_s > 1.05 * two.estimate.throughput_iterations_per_s
    assert many.estimate.fits_memory and sum(p.samples for p in many.plan.pipelines) == 4096




def test_a_pipelines_line_has_the_cycle_of_its_slowest_stage_past_the_fill() -> None:
    """linear_time, what the kinds of pipelines are balanced by: seconds = a + b x microbatches with b
    the 1F1B cycle once the pipeline is full (at least the slowest stage's forward and backward), so
    the line holds for many microbatches. A line through 1 and 2 microbatches put b at the second
    forward's overlap with the first one's way down: 0.126 s against 0.188 s here, and the planner
    gave the pipelines with a slow first stage too many microbatches."""
    from sailor_core.domain import Capacity, ParallelPlan, PipelineBatch, Replica, ResourcePool, Stage
    from sailor_core.planner.costs import SimCosts
    from sailor_core.planner.estimate import linear_time, stage_times
    from sailor_core.planner.placement import place
    from sailor_core.planner.slots import build_slots
    from sailor_core.simulator import simulate
    from tests.planner_fixtures import MODEL, tiny_book

    gpus = ("fast", "mid")
    book = tiny_book(1, gpus=gpus, memory_gib=(6.0, 4.0), zones=("r1-a",), tps=(1,))
    slots = build_slots(ResourcePool(entries=tuple(
        Capacity(zone="r1-a", region="r1", gpu_type=g, gpus=2, gpus_per_vm=2, usd_per_gpu_hour=1.0) for g in gpus)))
    costs = SimCosts(book)
    mid, fast = (next(s.index for s in slots if s.gpu_type == g) for g in ("mid", "fast"))
    sk = Sketch(mbs=1, bounds=((0, 2), (3, 5)), kinds=((mid, 1), (fast, 1)), dp=1)
    a, b = linear_time(costs, slots, sk, place(slots, sk))
    comp = stage_times(costs, slots, sk)
    assert comp[0].total_s > 1.3 * comp[1].total_s  # unequal: the first stage is the slow one
    assert b >= max(c.total_s for c in comp)
    for m in (12, 40):
        plan_m = ParallelPlan(model=MODEL, global_batch_size=m, stages=tuple(
            Stage(first_layer=f, last_layer=la, replicas=(Replica(gpu_type=g, zone="r1-a", tp=1, gpus_per_node=2),))
            for (f, la), g in zip(sk.bounds, ("mid", "fast"), strict=True)),
            pipelines=(PipelineBatch(microbatch_size=1, num_microbatches=m),))
        r = simulate(plan_m, book)
        assert a + b * m == pytest.approx(r.breakdown.pipeline_time_per_pipeline_s[0], rel=0.01)
