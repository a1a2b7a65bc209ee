"""The trace replay (sailor_core.replay): readers, the synthetic generator, the engine's accounting,
the four policies, and `sailor replay` end to end. Pure and fast: small made-up profile books
(tests/planner_fixtures.py) except the CLI tests, which read the store's seed (OPT-350)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import sailor_core.decisions
import tasks.decisions
from sailor_core.domain import Market
from sailor_core.planner import SearchOptions
from sailor_core.replay import (
    POLICIES,
    Place,
    Planner,
    ReplayJob,
    SyntheticSpec,
    Trace,
    TraceError,
    TracePoint,
    compare,
    parse_artifact_csv,
    parse_artifact_json,
    parse_changes_csv,
    parse_sailor_trace,
    policy_named,
    relocate,
    replay,
    synthetic_trace,
    trace_to_json,
)
from sailor_core.simulator import simulate
from tests.planner_fixtures import MODEL, tiny_book

BOOK = tiny_book(3)
OD, SPOT = Market.ON_DEMAND, Market.SPOT


def gpn(_: str) -> int:
    return 2


def trace(places: list[tuple[str, str, Market]], rows: list[tuple[float, list[int], list[float]]]) -> Trace:
    return Trace(name="t", places=tuple(Place(zone=z, gpu_type=g, market=m, gpus_per_node=2) for z, g, m in places),
                 points=tuple(TracePoint(at_s=t, counts=tuple(c), usd_per_gpu_hour=tuple(p)) for t, c, p in rows))


def job(**kw) -> ReplayJob:
    args = dict(model=MODEL, global_batch_size=16, total_steps=2000, tokens_per_step=16 * 1024,
                search=SearchOptions(max_stages=2), reconfiguration_s=60.0, grace_s=30.0, checkpoint_interval=50)
    args.update(kw)
    return ReplayJob(**args)


def run(tr: Trace, name: str, j: ReplayJob | None = None):
    j = j or job()
    return replay(tr, BOOK, j, policy_named(name), name=name, period_s=j.period_s if name == "periodic" else None)


# -- traces ---------------------------------------------------------------------------------------

def test_the_flow_and_the_replay_decide_with_one_function():
    assert tasks.decisions.decide_switch is sailor_core.decisions.decide_switch
    assert tasks.decisions.PlanCost is sailor_core.decisions.PlanCost


def test_artifact_controller_json_is_one_place_priced_from_the_store():
    rows = [{"Time": 0, "GPUs": 4}, {"Time": 63, "GPUs": 4}, {"Time": 126, "GPUs": 3}, {"Time": 189, "GPUs": 4}]
    tr = parse_artifact_json(rows, zone="r1-a", gpu_type="fast", market=OD, gpus_per_node=2,
                             prices=BOOK.price_usd_per_gpu_hour)
    assert [p.at_s for p in tr.points] == [0, 126, 189]  # the unchanged row at 63 s is merged
    assert [p.counts for p in tr.points] == [(4,), (3,), (4,)]
    assert tr.points[0].usd_per_gpu_hour == (3.0,)
    with pytest.raises(TraceError, match="to fix"):
        parse_artifact_json(rows, zone="r1-a", gpu_type="fast", market=SPOT, gpus_per_node=2,
                            prices=BOOK.price_usd_per_gpu_hour)  # the store has no spot price


def test_artifact_csv_columns_are_gpu_type_and_zone():
    text = ",Timestamp,fast_r1-a,slow_r1-b\n0,1712574014.0,32,96\n1,1712574137.2,80,240\n"
    tr = parse_artifact_csv(text, market=OD, gpus_per_node=gpn, prices=BOOK.price_usd_per_gpu_hour)
    assert [(p.gpu_type, p.zone) for p in tr.places] == [("fast", "r1-a"), ("slow", "r1-b")]
    assert tr.points[1].at_s == pytest.approx(123.2) and tr.points[1].counts == (80, 240)
    assert {(e.gpu_type, e.gpus) for e in tr.pool_at(1).entries} == {("fast", 80), ("slow", 240)}


def test_changes_csv_carries_values_forward_and_reads_a_store_price_history():
    text = ("at_s,zone,gpu_type,market,count,usd_per_gpu_hour\n"
            "0,r1-a,fast,spot,8,1.0\n0,r1-a,fast,on-demand,4,3.0\n3600,r1-a,fast,spot,,1.5\n7200,r1-a,fast,spot,2,\n")
    tr = parse_changes_csv(text, gpus_per_node=gpn)
    assert [p.counts for p in tr.points] == [(8, 4), (8, 4), (2, 4)]
    assert [p.usd_per_gpu_hour for p in tr.points] == [(1.0, 3.0), (1.5, 3.0), (1.5, 3.0)]
    # The store's gpu_prices rows (cloud, zone, gpu_type, market, usd_per_gpu_hour, fetched_at): no counts.
    hist = ("cloud,zone,gpu_type,market,usd_per_gpu_hour,fetched_at\n"
            "aws,us-east-1a,fast,spot,1.2,2026-01-01T02:00:00+00:00\n"
            "aws,us-east-1a,fast,spot,1.0,2026-01-01T00:00:00+00:00\n")
    with pytest.raises(TraceError, match="--trace-gpus"):
        parse_changes_csv(hist, gpus_per_node=gpn)
    tr = parse_changes_csv(hist, gpus_per_node=gpn, default_count=16)
    assert [(p.at_s, p.usd_per_gpu_hour, p.counts) for p in tr.points] == [
        (0.0, (1.0,), (16,)),
        (7200.0, (1.2,), (16,)),
    ]


def test_our_json_round_trips_and_bad_traces_say_how_to_fix_them():
    tr = synthetic_trace(SyntheticSpec(zones=("r1-a", "r1-b"), gpu_types=("fast", "slow"), total_gpus=64, days=2),
                         BOOK.price_usd_per_gpu_hour, gpn)
    back = parse_sailor_trace(json.loads(json.dumps(trace_to_json(tr))))
    assert back.places == tr.places and back.points == tr.points
    with pytest.raises(TraceError, match="to fix"):
        parse_sailor_trace({"format": "sailor-trace", "version": 1, "places": [{"zone": "a"}], "points": []})
    with pytest.raises(TraceError, match="sort the points"):
        trace([("r1-a", "fast", OD)], [(0, [4], [3.0]), (0, [2], [3.0])])


def test_synthetic_traces_are_seeded_and_shaped_as_asked():
    spec = SyntheticSpec(zones=("r1-a", "r1-b"), gpu_types=("fast", "slow"), total_gpus=256, days=14, seed=7,
                         preemptions_per_day=1.0, price_changes_per_day=1.0, stockouts_per_week=2.0)
    a = synthetic_trace(spec, BOOK.price_usd_per_gpu_hour, gpn)
    assert a == synthetic_trace(spec, BOOK.price_usd_per_gpu_hour, gpn)
    assert a != synthetic_trace(SyntheticSpec(**{**spec.__dict__, "seed": 8}), BOOK.price_usd_per_gpu_hour, gpn)
    assert len(a.places) == 2 * 2 * 2 and a.max_gpus <= 256 and a.duration_s <= 14 * 86400
    spot = [k for k, p in enumerate(a.places) if p.market is SPOT]
    od = [k for k, p in enumerate(a.places) if p.market is OD]
    assert any(pt.counts[k] < a.points[0].counts[k] for pt in a.points for k in spot)  # preemption waves
    assert any(pt.counts[k] == 0 for pt in a.points for k in od)  # a regional stockout
    assert len({pt.usd_per_gpu_hour[k] for pt in a.points for k in spot}) > 2  # spot prices move
    for pt in a.points:  # spot stays between 10% and 100% of on-demand
        for k in spot:
            base = BOOK.price_usd_per_gpu_hour(a.places[k].zone, a.places[k].gpu_type, OD)
            assert 0.1 * base - 1e-3 <= pt.usd_per_gpu_hour[k] <= base + 1e-3


# -- the engine's accounting ------------------------------------------------------------------------

def test_a_quiet_trace_trains_at_the_simulated_speed_and_pays_for_it():
    tr = trace([("r1-a", "fast", OD)], [(0, [4], [3.0])])
    r = run(tr, "sailor")
    plan = r.decisions[0]
    assert plan.kind == "switch" and r.finished and r.switches == 0
    p = Planner(BOOK, job()).best(tr.pool_at(0))
    assert p is not None
    it = simulate(p.plan, BOOK).iteration_time_s
    # the first launch takes a reconfiguration's time (VMs start), billed; then 2000 steps
    assert r.time_to_train_s == pytest.approx(60.0 + 2000 * it)
    assert r.usd == pytest.approx(p.cost.usd_per_hour * r.time_to_train_s / 3600)
    assert r.goodput_steps_per_s == pytest.approx(2000 / r.time_to_train_s)
    assert r.gpu_hours_wasted == 0 and r.redone_steps == 0


def test_a_preemption_without_a_notice_checkpoint_redoes_the_steps_since_the_last_one():
    places = [("r1-a", "fast", OD), ("r1-b", "fast", OD)]
    tr = trace(places, [(0, [4, 0], [3.0, 3.0]), (1000, [0, 4], [3.0, 3.0])])
    j = job(checkpoint_on_notice=False, total_steps=100_000)
    r = run(tr, "sailor", j)
    it = Planner(BOOK, j).best(tr.pool_at(0)).cost.iteration_time_s
    reached = (1000 + 30 - 60) / it  # trained from 60 s (start-up) until the VMs went, 30 s after the notice
    assert r.redone_steps == pytest.approx(reached - math.floor(reached / 50) * 50)
    assert r.switches == 1 and r.reconfiguration_s == 60.0
    # with the runtime's just-in-time checkpoint on the notice, nothing is redone
    assert run(tr, "sailor", job(total_steps=100_000)).redone_steps == 0


def test_after_a_capacity_loss_sailor_replans_relaunch_moves_static_waits():
    places = [("r1-a", "fast", OD), ("r1-b", "fast", OD), ("r1-a", "slow", OD)]
    tr = trace(places, [(0, [4, 0, 0], [3.0, 3.0, 1.5]),
                        (3600, [0, 4, 0], [3.0, 3.0, 1.5]),    # r1-a's fast GPUs go, r1-b has room
                        (7200, [0, 0, 8], [3.0, 3.0, 1.5]),    # no fast GPU anywhere, slow ones instead
                        (36000, [4, 0, 8], [3.0, 3.0, 1.5])])  # the fast ones come back in r1-a
    j = job(total_steps=200_000)
    res = {p: run(tr, p, j) for p in POLICIES}
    first = Planner(BOOK, j).best(tr.pool_at(0)).plan
    assert {k[1] for k in first.gpus_by_place()} == {"fast"}
    moved = [d for d in res["relaunch-same"].decisions if d.kind == "switch" and d.trigger == "change"]
    assert moved and "r1-b" in moved[0].reason
    assert res["static"].waiting_s >= 36000 - 3600 - 1  # waits from the loss until its own GPUs return
    assert res["relaunch-same"].waiting_s == pytest.approx(36000 - 7200, abs=1)
    assert res["sailor"].waiting_s == 0  # it trains on the slow GPUs meanwhile
    assert res["sailor"].time_to_train_s < res["relaunch-same"].time_to_train_s < res["static"].time_to_train_s
    assert all(r.finished for r in res.values())


def test_after_a_loss_sailor_weighs_the_shrink_against_the_rest_over_the_remaining_work():
    places = [("r1-a", "fast", OD), ("r1-b", "fast", OD)]
    base = trace(places, [(0, [4, 0], [3.0, 3.0])])
    tr = Trace(name="t", places=base.places, points=(base.points[0], TracePoint(  # half the plan's GPUs go;
        at_s=3600, counts=(2, 4), usd_per_gpu_hour=(3.0, 3.0), taken=(2, 0))))   # r1-b has room for all of it
    weigh, shrink = job(total_steps=200_000), job(total_steps=200_000, weigh_replacements=False)
    held = Planner(BOOK, weigh).best(tr.pool_at(0))
    assert held is not None and held.plan.num_gpus == 4
    w, f = run(tr, "sailor", weigh), run(tr, "sailor", shrink)
    # shrinking first (the flow's rule before it weighed replacements): the best plan on the 2 GPUs still held
    assert f.segments[-1].gpus == 2
    # weighed over the 200,000 steps left, a plan with r1-b's GPUs finishes sooner, its VM start included
    assert w.segments[-1].gpus > 2 and w.time_to_train_s < f.time_to_train_s
    assert w.switches == f.switches == 1
    # new VMs that take longer to start than the bigger plan saves over the remaining work: it shrinks
    saved = f.time_to_train_s - w.time_to_train_s
    slow_vms = job(total_steps=200_000, vm_start_s=2 * saved)
    s_ = run(tr, "sailor", slow_vms)
    assert s_.segments[-1].gpus == 2 and s_.time_to_train_s == pytest.approx(f.time_to_train_s, rel=1e-9)
    # and a move to new VMs waits for them: the reconfiguration it is charged grows by their start
    quick = run(tr, "sailor", job(total_steps=200_000, vm_start_s=0.25 * saved))
    assert quick.segments[-1].gpus > 2
    assert quick.reconfiguration_s == pytest.approx(w.reconfiguration_s + 0.25 * saved, rel=1e-6)
    # best_replacement: soonest under max-throughput, cheapest otherwise, the first of equals, each with its start
    slow = sailor_core.decisions.PlanCost(iteration_time_s=2.0, usd_per_iteration=0.001, usd_per_hour=1.8)
    fast = sailor_core.decisions.PlanCost(iteration_time_s=1.0, usd_per_iteration=0.002, usd_per_hour=7.2)
    held_, new_ = (sailor_core.decisions.Replacement(cost=slow),
                   sailor_core.decisions.Replacement(cost=fast, new_vms=2, load_bytes=1e9))
    pick = sailor_core.decisions.best_replacement
    at = sailor_core.decisions.StartupTimes

    def best(objective, cands, **t):
        return pick(objective=objective, candidates=cands, remaining_steps=1000, lost_steps=0,
                    times=at(reconfiguration_s=60, **t))

    assert best("max-throughput", [held_, new_]) == 1
    assert best("min-cost", [held_, new_]) == 0
    assert best("max-throughput", [new_, new_]) == 0
    # 1000 steps: the held plan takes 60 + 2000 s, the new one 60 + 1000 s + its VM start + 1 s to load 1e9 B
    assert best("max-throughput", [held_, new_], vm_start_s=998, load_bytes_per_s=1e9) == 1  # 2059 < 2060 s
    assert best("max-throughput", [held_, new_], vm_start_s=999, load_bytes_per_s=1e9) == 0  # a tie: the first
    assert best("max-throughput", [held_, new_], vm_start_s=1000, load_bytes_per_s=1e9) == 0
    assert best("max-throughput", [held_, new_], vm_start_s=0, load_bytes_per_s=1e9 / 1001) == 0  # 1001 s to load
    assert sailor_core.decisions.startup_s(new_, at(reconfiguration_s=60, vm_start_s=30, load_bytes_per_s=1e8)) == 100
    assert sailor_core.decisions.startup_s(held_, at(reconfiguration_s=60, vm_start_s=30)) == 60


def test_a_spot_price_rise_moves_sailor_not_relaunch_same():
    places = [("r1-a", "fast", SPOT), ("r1-a", "fast", OD)]
    tr = trace(places, [(0, [4, 4], [1.0, 3.0]), (3600, [4, 4], [9.0, 3.0])])
    j = job(objective="min-cost", total_steps=200_000)
    s, b = run(tr, "sailor", j), run(tr, "relaunch-same", j)
    sw = [d for d in s.decisions if d.trigger == "change"]
    assert sw[0].kind == "switch" and "switch pays" in sw[0].reason
    assert b.switches == 0 and s.usd < b.usd
    # a rise too small to pay for the reconfiguration is not worth it (a whole plan's switch redoes no step:
    # it stops at a step boundary with a checkpoint, so only the reconfiguration weighs against the gain)
    tiny = trace(places, [(0, [4, 4], [1.0, 3.0]), (3600, [4, 4], [3.0000001, 3.0])])
    d = [x for x in run(tiny, "sailor", j).decisions if x.trigger == "change"]
    assert d[0].kind == "stay" and "not worth the switch" in d[0].reason


def test_periodic_reacts_only_on_its_schedule():
    places = [("r1-a", "fast", OD), ("r1-b", "fast", OD)]
    tr = trace(places, [(0, [4, 0], [3.0, 3.0]), (1800, [0, 4], [3.0, 3.0])])
    r = run(tr, "periodic", job(total_steps=200_000, period_s=7200))
    assert r.waiting_s == pytest.approx(7200 - 1800, abs=1)  # lost at 30 min, replanned at the 2 h run
    assert [d.trigger for d in r.decisions if d.kind == "switch"][-1] == "tick"


def test_the_planner_is_memoised_per_pool_and_shared_by_compare():
    places = [("r1-a", "fast", OD)]
    tr = trace(places, [(0, [4], [3.0]), (3600, [2], [3.0]), (7200, [4], [3.0]), (10800, [2], [3.0])])
    rs = compare(tr, BOOK, job(total_steps=200_000))
    assert rs[0].policy == "sailor" and rs[0].planner_calls == 2 and rs[0].planner_hits >= 2
    assert sum(r.planner_calls for r in rs[1:]) == 0  # the others find every pool already planned


def test_relocate_keeps_the_shape_and_takes_the_cheapest_room():
    j = job()
    plan = Planner(BOOK, j).best(trace([("r1-a", "fast", OD)], [(0, [4], [3.0])]).pool_at(0)).plan
    pool = trace([("r1-a", "fast", OD), ("r1-b", "fast", SPOT), ("r1-b", "fast", OD)],
                 [(0, [0, 4, 4], [3.0, 1.0, 3.0])]).pool_at(0)
    moved = relocate(plan, pool)
    assert moved is not None and moved.num_gpus == plan.num_gpus
    assert set(moved.gpus_by_place()) == {("r1-b", "fast", SPOT)}
    assert [len(s.replicas) for s in moved.stages] == [len(s.replicas) for s in plan.stages]
    assert relocate(plan, pool, (OD,)) is not None and relocate(plan, trace(
        [("r1-a", "slow", OD)], [(0, [8], [1.5])]).pool_at(0)) is None


# -- the command ---------------------------------------------------------------------------------------

A100 = [{"Time": 0, "GPUs": 4}, {"Time": 600, "GPUs": 3}, {"Time": 1200, "GPUs": 2}, {"Time": 1800, "GPUs": 4}]


def cli(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    from sailor_cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["replay", "--store", str(tmp_path / "store"), *args])
    return rc, out.getvalue(), err.getvalue()


def test_cli_replays_an_artifact_trace_with_every_policy(tmp_path):
    t = tmp_path / "a100_trace.json"
    t.write_text(json.dumps(A100))
    png = tmp_path / "timeline.png"
    rc, out, err = cli(tmp_path, "--trace", str(t), "--model", "OPT-350", "--global-batch-size", "1024", "--steps",
                       "300", "--policy", "all", "--json", "--timeline-png", str(png))
    assert rc == 0, err
    doc = json.loads(out)
    assert [r["policy"] for r in doc["results"]] == list(POLICIES)
    assert all(r["finished"] for r in doc["results"])
    assert doc["sailor_vs_relaunch_same"]["time_ratio"] < 1  # relaunch-same waits for 4 GPUs, sailor uses 3
    assert png.stat().st_size > 10_000
    rc, out, _ = cli(tmp_path, "--trace", str(t), "--model", "OPT-350", "--global-batch-size", "1024",
                     "--token-budget", str(300 * 1024 * 2048), "--policy", "relaunch-same")
    assert rc == 0 and "relaunch-same" in out and "sailor vs" not in out


def test_cli_errors_are_one_line(tmp_path):
    t = tmp_path / "bad.json"
    t.write_text("[{\"Time\": 0}]")
    for args, needle in [
        (["--trace", str(t), "--model", "OPT-350", "--global-batch-size", "8", "--steps", "5"], "Time or GPUs"),
        (["--trace", str(tmp_path / "none.json"), "--model", "OPT-350", "--global-batch-size", "8", "--steps", "5"],
         "does not exist"),
        (["--trace", "synthetic", "--model", "OPT-350", "--global-batch-size", "8"], "exactly one of"),
        (["--trace", "synthetic", "--model", "OPT-350", "--global-batch-size", "8", "--steps", "5", "--policy", "x"],
         "unknown policy"),
    ]:
        rc, _, err = cli(tmp_path, *args)
        assert rc == 2 and needle in err and err.count("\n") == 1 and "to fix" in err, err


# -- a run's history as a trace ------------------------------------------------------------------------

def test_a_runs_events_become_step_points_that_take_the_jobs_vms():
    from sailor_core.domain import Capacity, ResourcePool
    from sailor_core.replay.history import decisions_of, run_job, run_trace

    start = ResourcePool(
        entries=(
            Capacity(
                zone="r1-a", region="r1", gpu_type="fast", gpus=4, market=SPOT, gpus_per_vm=2, usd_per_gpu_hour=1.0
            ),
            Capacity(
                zone="r1-a", region="r1", gpu_type="fast", gpus=4, market=OD, gpus_per_vm=2, usd_per_gpu_hour=3.0
            ),
        )
    )
    run = {
        "run_id": "r-1",
        "params": {"model": MODEL, "global_batch_size": 16, "steps": 400, "objective": "min-cost", "provider": "local",
                   "workers": 4, "checkpoint_interval": 10, "min_gain": 0.0},
        "events": [
            {"kind": "preemption", "zone": "r1-a", "gpu_type": "fast", "market": "spot", "grace_s": 2},
            {"kind": "replan", "step": 50},
            {"kind": "price_change", "zone": "r1-a", "gpu_type": "fast", "market": "spot", "new_usd_per_gpu_hour": 9.0},
            {"kind": "replan", "step": 120},
            {"kind": "lost", "vm_id": "vm-7"},  # a worker's own report names no place
            {"kind": "replan", "step": 120, "trigger": ["lost"]},
            {"kind": "preemption", "zone": "r1-a", "gpu_type": "fast", "market": "spot", "vm_id": "vm-8"},
            {"kind": "lost", "vm_id": "vm-8", "zone": "r1-a", "gpu_type": "fast", "market": "spot"},
            {"kind": "lost", "vm_id": "vm-7"},  # a VM the job already gave up dies again: no loss
            {"kind": "iteration_time"},
            {"kind": "replan", "step": 130, "trigger": ["iteration_time"]},
        ],
        "decisions": [{"kind": "switch", "detail": {"step": 50}}, {"kind": "stay", "detail": {"step": 120}}],
    }
    tr = run_trace(run, start)
    assert [p.at_step for p in tr.points] == [None, 50, 120, 120, 130]
    assert tr.points[1].counts == (2, 4) and tr.points[1].taken == (2, 0)  # the preempted VM and its capacity
    assert tr.points[2].usd_per_gpu_hour == (9.0, 3.0) and tr.points[2].taken == ()
    assert tr.points[3].counts == (2, 4) and tr.points[3].taken == (2, 2)  # wherever the plan runs
    assert tr.points[4].counts == (0, 4) and tr.points[4].taken == (2, 0)  # vm-8 once, as its preemption
    assert [p.happened for p in tr.points] == [(), (), (), ("lost",), ("iteration_time",)]  # what woke each replan
    j = run_job(run, sequence_length=1024)
    assert (j.total_steps, j.objective, j.grace_s, j.restrictions.max_gpus) == (400, "min-cost", 2.0, 4)
    assert not j.reuse_dominating_plans and decisions_of(run) == [("switch", 50), ("stay", 120)]
    r = replay(tr, BOOK, j, policy_named("sailor"), name="sailor")
    steps = [d.step for d in r.decisions if d.trigger != "start"]
    assert steps[:3] == [50, 120, 120] and r.finished
    assert r.decisions[3].reason.startswith("after lost at step 120: 1 GPU(s) of the plan lost")  # the flow's words
    assert [(d.kind, d.reason) for d in r.decisions if d.step == 130] == [
        ("stay", "after iteration_time at step 130: the best plan is the current plan")]  # nothing of its lost


def test_a_replan_is_priced_as_the_flow_read_the_offerings_not_by_when_a_change_was_stamped():
    """The provider stamps a price change when it happens; the flow reports it at its next poll. A change
    stamped just before a replan whose offerings read missed it is not in that replan's pool (the flow
    planned with the old price), and is in the next one's."""
    from sailor_core.domain import Capacity, ResourcePool
    from sailor_core.replay.history import run_trace

    start = ResourcePool(entries=(
        Capacity(zone="r1-a", region="r1", gpu_type="fast", gpus=4, market=SPOT, gpus_per_vm=2, usd_per_gpu_hour=1.0),
        Capacity(zone="r1-a", region="r1", gpu_type="fast", gpus=4, market=OD, gpus_per_vm=2, usd_per_gpu_hour=3.0)))

    def prices(spot: float) -> list[dict[str, object]]:
        return [{"zone": "r1-a", "gpu_type": "fast", "market": "spot", "usd_per_gpu_hour": spot},
                {"zone": "r1-a", "gpu_type": "fast", "market": "on-demand", "usd_per_gpu_hour": 3.0}]

    run = {"run_id": "r-2", "params": {"provider": "local"}, "events": [
        {"kind": "preemption", "zone": "r1-a", "gpu_type": "fast", "market": "spot",
         "time": "2026-01-01T00:00:01+00:00"},
        {"kind": "price_change", "zone": "r1-a", "gpu_type": "fast", "market": "spot", "new_usd_per_gpu_hour": 40.0,
         "time": "2026-01-01T00:00:02+00:00"},
        {"kind": "replan", "step": 8, "prices": prices(1.0), "time": "2026-01-01T00:00:03+00:00"},
        {"kind": "replan", "step": 8, "prices": prices(40.0), "time": "2026-01-01T00:00:04+00:00"}]}
    tr = run_trace(run, start)
    assert [p.usd_per_gpu_hour for p in tr.points] == [(1.0, 3.0), (1.0, 3.0), (40.0, 3.0)]
    run["events"] = [e for e in run["events"] if e["kind"] != "replan"] + [
        {"kind": "replan", "step": 8, "time": "2026-01-01T00:00:03+00:00"}]  # a run recorded without prices
    assert [p.usd_per_gpu_hour for p in run_trace(run, start).points] == [(1.0, 3.0), (40.0, 3.0)]


def test_a_plan_under_notice_trains_through_its_window_then_the_new_one_starts():
    places = [("r1-a", "fast", OD), ("r1-b", "fast", OD)]
    tr = Trace(name="t", places=tuple(Place(zone=z, gpu_type=g, market=m, gpus_per_node=2) for z, g, m in places),
               points=(TracePoint(at_s=0, counts=(4, 4), usd_per_gpu_hour=(3.0, 3.0)),
                       TracePoint(at_s=0, counts=(4, 4), usd_per_gpu_hour=(3.0, 3.0), at_step=100, taken=(4, 4))))
    j = job(total_steps=300, grace_s=10.0, reconfiguration_s=60.0)
    r = run(tr, "sailor", j)
    it = Planner(BOOK, j).best(tr.pool_at(0)).cost.iteration_time_s
    # start-up, 100 steps, the notice: 10 s more of training, then 60 s of reconfiguration from the notice
    assert r.decisions[1].step == 100 and r.redone_steps == 0
    assert r.time_to_train_s == pytest.approx(60 + 100 * it + 60 + (300 - 100 - 10 / it) * it)
