"""max-goodput: spot preemptions priced in (sailor_core/planner/risk.py), pool-file rates, history rates."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from sailor_core.domain import Capacity, Market, ResourcePool
from sailor_core.planner import Objective, PlanRequest, PoolFileError, parse_pool, plan
from sailor_core.planner.pool import parse_preemption_rates
from sailor_core.planner.risk import (
    DEFAULT_CHECKPOINT_INTERVAL_STEPS,
    SpotRisk,
    goodput,
    rates_from_history,
    reconfiguration_from_history,
    spot_exposure_vm_hours,
    useful_fraction_of,
)
from tests.planner_fixtures import MODEL, tiny_book


def test_useful_fraction_follows_the_renewal_model() -> None:
    risk = SpotRisk(reconfiguration_s=120.0, checkpoint_interval_steps=10)
    assert useful_fraction_of(0.0, 2.0, risk) == 1.0
    # small rates: u ~ 1 - Lambda (R + I/2) with I = 10 steps x 2 s
    lam_h = 0.01
    approx = 1 - lam_h / 3600 * (120 + 20 / 2)
    assert useful_fraction_of(lam_h, 2.0, risk) == pytest.approx(approx, rel=1e-5)
    # exact: u = I / E, E = e^(lam R) (e^(lam I) - 1) / lam; at 30 preemptions an hour lam = 1/120 per s:
    # lam R = 1, lam I = 1/6, E = e * (e^(1/6) - 1) * 120 = 2.7182818 * 0.1813604 * 120 = 59.158646 s,
    # u = 20 / 59.158646 = 0.33807400
    assert useful_fraction_of(30.0, 2.0, risk) == pytest.approx(0.33807400, rel=1e-7)
    us = [useful_fraction_of(x, 2.0, risk) for x in (0.1, 1, 10, 100, 1e4)]
    assert all(a > b for a, b in zip(us, us[1:], strict=False)) and us[-1] >= 0
    # a longer checkpoint interval loses more work per preemption
    assert useful_fraction_of(5.0, 2.0, SpotRisk(checkpoint_interval_steps=100)) < useful_fraction_of(
        5.0, 2.0, SpotRisk(checkpoint_interval_steps=10))


def _pool(spot_count: int = 8, od_count: int = 8) -> ResourcePool:
    return ResourcePool(entries=(
        Capacity(zone="r1-a", region="r1", gpu_type="fast", gpus=od_count, market=Market.ON_DEMAND, gpus_per_vm=2,
                  usd_per_gpu_hour=3.0),
        Capacity(zone="r1-a", region="r1", gpu_type="fast", gpus=spot_count, market=Market.SPOT, gpus_per_vm=2,
                  usd_per_gpu_hour=1.0),
    ))


def _markets(res) -> dict[Market, int]:
    out: dict[Market, int] = {}
    for (_, _, mk), n in res.plan.gpus_by_place().items():
        out[mk] = out.get(mk, 0) + n
    return out


def test_high_spot_preemption_rates_move_work_to_on_demand() -> None:
    book = tiny_book(5, gpus=("fast",), memory_gib=(6.0,), zones=("r1-a",))
    base = PlanRequest(model=MODEL, global_batch_size=16, pool=_pool(), objective=Objective.MIN_COST)
    cheap = plan(base, book)
    assert cheap.plan is not None and set(_markets(cheap)) == {Market.SPOT}
    risky = SpotRisk(default_preemptions_per_vm_hour=20.0, reconfiguration_s=300.0, checkpoint_interval_steps=50)
    res = plan(PlanRequest(model=MODEL, global_batch_size=16, pool=_pool(), objective=Objective.MAX_GOODPUT,
                           spot_risk=risky), book)
    assert res.plan is not None and res.goodput is not None
    assert set(_markets(res)) == {Market.ON_DEMAND}, res.explanation
    # the spot plan would have been worse per useful iteration, as the planner's own model says
    spot_g = goodput(cheap.plan, cheap.estimate.iteration_time_s, cheap.estimate.usd_per_iteration, risky)
    assert res.goodput.expected_usd_per_useful_iteration < spot_g.expected_usd_per_useful_iteration
    assert res.goodput.useful_fraction == 1.0 and res.goodput.expected_iterations_per_s == pytest.approx(
        res.estimate.throughput_iterations_per_s)


def test_moderate_rates_keep_some_spot_and_report_expected_below_nominal() -> None:
    book = tiny_book(5, gpus=("fast",), memory_gib=(6.0,), zones=("r1-a",))
    # one preemption per VM every 10 hours: spot at a third of the price still pays
    mild = SpotRisk(default_preemptions_per_vm_hour=0.1, reconfiguration_s=60.0)
    res = plan(PlanRequest(model=MODEL, global_batch_size=16, pool=_pool(), objective=Objective.MAX_GOODPUT,
                           spot_risk=mild), book)
    assert res.plan is not None and res.goodput is not None
    assert Market.SPOT in _markets(res)
    assert 0 < res.goodput.useful_fraction < 1
    assert res.goodput.expected_iterations_per_s < res.goodput.nominal_iterations_per_s
    assert "Spot risk" in res.explanation


@pytest.mark.parametrize("seed", [5, 8, 13])
def test_near_zero_rates_pick_the_max_throughput_per_dollar_plan(seed: int) -> None:
    book = tiny_book(seed)
    pool = ResourcePool(entries=_pool().entries + (
        Capacity(zone="r1-b", region="r1", gpu_type="slow", gpus=6, market=Market.SPOT, gpus_per_vm=2,
                  usd_per_gpu_hour=0.6),
    ))
    per_dollar = plan(PlanRequest(model=MODEL, global_batch_size=16, pool=pool, objective=Objective.MIN_COST), book)
    tiny = SpotRisk(default_preemptions_per_vm_hour=1e-9)
    res = plan(PlanRequest(model=MODEL, global_batch_size=16, pool=pool, objective=Objective.MAX_GOODPUT,
                           spot_risk=tiny), book)
    assert res.plan is not None and per_dollar.plan is not None
    assert res.plan == per_dollar.plan


def test_pool_file_rates_and_their_errors(tmp_path) -> None:
    book = tiny_book(5, gpus=("fast",), memory_gib=(6.0,), zones=("r1-a", "r1-b"))
    data = {
        "preemptions_per_vm_hour": 0.05,
        "zones": {
            "r1-a": {"gpus": {"fast": [{"count": 4}, {"count": 4, "market": "spot", "usd_per_gpu_hour": 1.0,
                                                      "preemptions_per_vm_hour": 0.5}]}},
            "r1-b": {"gpus": {"fast": {"count": 4, "market": "spot", "usd_per_gpu_hour": 1.0}}},
        },
    }
    parse_pool(data, book)
    rates, default = parse_preemption_rates(data)
    risk = SpotRisk(preemptions_per_vm_hour=rates, default_preemptions_per_vm_hour=default)
    assert risk.rate("r1-a", "fast", Market.SPOT) == 0.5
    assert risk.rate("r1-b", "fast", Market.SPOT) == 0.05
    assert risk.rate("r1-a", "fast", Market.ON_DEMAND) == 0.0
    bad = {"preemptions_per_vm_hour": -1, "zones": {"r1-a": {"gpus": {"fast": {"count": 4,
                                                                              "preemptions_per_vm_hour": "often"}}}}}
    with pytest.raises(PoolFileError) as e:
        parse_pool(bad, book)
    msg = str(e.value)
    assert "preemptions_per_vm_hour: must be a number from 0 to 3600" in msg
    assert "only spot capacity is preempted" in msg


def test_rates_and_reconfiguration_from_the_run_history() -> None:
    from sailor_core.domain import ParallelPlan, PipelineBatch, Replica, Stage

    def one_stage(n: int, market: Market) -> ParallelPlan:
        r = Replica(gpu_type="A100-40", zone="z-a", tp=1, gpus_per_node=4, market=market, region="z")
        return ParallelPlan(
            model="m",
            global_batch_size=n,
            stages=(Stage(first_layer=0, last_layer=0, replicas=(r,) * n),),
            pipelines=(PipelineBatch(microbatch_size=1, num_microbatches=1),) * n,
        )

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [("run1", t0, one_stage(8, Market.SPOT)),  # 2 spot VMs for 5 h
            ("run1", t0 + timedelta(hours=5), one_stage(4, Market.ON_DEMAND)),  # then on-demand for 1 h
            ("run2", t0, one_stage(4, Market.SPOT))]  # 1 VM, still running: no end, no exposure counted
    ends = {"run1": t0 + timedelta(hours=6)}
    exposure = spot_exposure_vm_hours(rows, ends)
    assert exposure == {("z-a", "A100-40"): pytest.approx(10.0)}
    rates = rates_from_history([("z-a", "A100-40", "spot")] * 3 + [("z-a", "A100-40", "on-demand")], exposure)
    assert rates[("z-a", "A100-40")] == (pytest.approx(0.3), 3, pytest.approx(10.0))
    # too little exposure says nothing
    assert rates_from_history([("z-a", "A100-40", "spot")], {("z-a", "A100-40"): 0.2}) == {}
    assert reconfiguration_from_history([10.0, 20.0]) == 15.0
    assert reconfiguration_from_history([]) is None


def test_cli_max_goodput_reports_expected_and_nominal_throughput(tmp_path, capsys) -> None:
    import json

    from sailor_cli.main import main

    pool = tmp_path / "pool.yaml"
    pool.write_text("preemptions_per_vm_hour: 2.0\nzones:\n  us-central1-a:\n    gpus:\n      A100-40:\n"
                    "        - {count: 8}\n        - {count: 8, market: spot, usd_per_gpu_hour: 1.2}\n")
    store = tmp_path / "store"
    rc = main(["plan", "--pool", str(pool), "--model", "OPT-350", "--global-batch-size", "64", "--json",
               "--objective", "max-goodput", "--checkpoint-interval", "20", "--reconfiguration-s", "90",
               "--store", str(store)])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    g = got["goodput"]
    assert g["expected_iterations_per_s"] == pytest.approx(g["nominal_iterations_per_s"] * g["useful_fraction"])
    assert g["nominal_iterations_per_s"] == pytest.approx(got["estimate"]["throughput_iterations_per_s"])
    assert got["spot_risk"]["checkpoint_interval_steps"] == 20 and got["spot_risk"]["reconfiguration_s"] == 90
    assert got["spot_risk"]["default_preemptions_per_vm_hour"] == 2.0
    # 0 (the default) is the automatic interval: before a plan exists, the flow's stand-in
    rc = main(["plan", "--pool", str(pool), "--model", "OPT-350", "--global-batch-size", "64", "--json",
               "--objective", "max-goodput", "--checkpoint-interval", "0", "--store", str(store)])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["spot_risk"]["checkpoint_interval_steps"] == \
        DEFAULT_CHECKPOINT_INTERVAL_STEPS
    rc = main(["plan", "--pool", str(pool), "--model", "OPT-350", "--global-batch-size", "64",
               "--checkpoint-interval", "-1", "--store", str(store)])
    assert rc == 2 and "--checkpoint-interval" in capsys.readouterr().err


def test_cli_takes_rates_and_reconfiguration_time_from_the_store_history(tmp_path, capsys) -> None:
    import json

    from profiles_store.store import HistoryRecord, open_store
    from sailor_cli.main import main
    from sailor_core.domain import ParallelPlan, PipelineBatch, Replica, Stage
    from sailor_core.plan_format import plan_to_dict

    store_dir = tmp_path / "store"
    st = open_store(str(store_dir))
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    spot = Replica(gpu_type="A100-40", zone="us-central1-a", tp=1, gpus_per_node=4, market=Market.SPOT,
                   region="us-central1")
    ran = ParallelPlan(model="OPT-350", global_batch_size=8, stages=(Stage(first_layer=0, last_layer=25,
                                                                           replicas=(spot,) * 8),),
                       pipelines=(PipelineBatch(microbatch_size=1, num_microbatches=1),) * 8)
    # 2 spot VMs for 10 hours, 6 preemptions there: 0.3 per VM-hour; reconfigurations took 40 and 80 s
    st.append_history("plans", [HistoryRecord(run_id="r1", kind="plan", time=t0,
                                              payload={"version": 1, "plan": plan_to_dict(ran), "estimate": {}})])
    st.append_history("runs", [HistoryRecord(run_id="r1", kind="completed", time=t0 + timedelta(hours=10))])
    st.append_history("events", [HistoryRecord(run_id="r1", kind="preemption", time=t0 + timedelta(hours=i),
                                               payload={"zone": "us-central1-a", "gpu_type": "A100-40",
                                                        "market": "spot"}) for i in range(6)])
    st.append_history("measurements", [HistoryRecord(run_id="r1", kind="reconfiguration", time=t0,
                                                     payload={"reconfiguration_s": s}) for s in (40.0, 80.0)])
    pool = tmp_path / "pool.yaml"
    pool.write_text("preemptions_per_vm_hour: 5.0\nzones:\n  us-central1-a:\n    gpus:\n      A100-40:\n"
                    "        - {count: 8}\n        - {count: 8, market: spot, usd_per_gpu_hour: 1.2}\n")
    rc = main(["plan", "--pool", str(pool), "--model", "OPT-350", "--global-batch-size", "64", "--json",
               "--objective", "max-goodput", "--store", str(store_dir)])
    assert rc == 0
    risk = json.loads(capsys.readouterr().out)["spot_risk"]
    assert risk["preemptions_per_vm_hour"]["us-central1-a/A100-40"] == pytest.approx(0.3)
    assert risk["reconfiguration_s"] == pytest.approx(60.0)
    assert any("history, 6 preemption(s) in 20.0 spot VM-hours" in s for s in risk["sources"])
    assert risk["default_preemptions_per_vm_hour"] == 5.0  # the pool file's, for markets history has not seen


# -- the checkpoint interval (Young/Daly) ----------------------------------------------------------
def test_checkpoint_interval_is_youngs_with_daly_correction_by_hand():
    from sailor_core.planner.risk import UNNOTICED_FAILURES_PER_VM_HOUR, checkpoint_interval

    # 2 spot preemptions per hour, a 5 s notice that a 1 s step + 8 s write does not fit in:
    # lambda = (2 + 4 x 1/720) / 3600 per s, M = 1 / lambda = 1795.0 s. A checkpoint costs its 0.5 s stall
    # plus the 7 s its write outlasts the next step (which commits only once the write is durable):
    # S = 7.5 s, sqrt(2 x 7.5 x 1795.0) - 7.5 = 156.59 s
    c = checkpoint_interval(iteration_s=1.0, write_s=8.0, stall_s=0.5, notice_s=5.0, spot_preemptions_per_hour=2.0,
                            vms=4, total_steps=10_000)
    m = 3600 / (2 + 4 * UNNOTICED_FAILURES_PER_VM_HOUR)
    assert abs(m - 1795.01) < 0.01
    assert c.steps == 157 and "Young/Daly" in c.reason and "shorter than a step and a write" in c.reason
    # the same job with a notice long enough for the step and the write: only unnoticed failures count
    # (M = 180 h), so T = sqrt(2 x 7.5 x 648000) - 7.5 = 3110.19 s
    c = checkpoint_interval(iteration_s=1.0, write_s=8.0, stall_s=0.5, notice_s=120.0, spot_preemptions_per_hour=2.0,
                            vms=4, total_steps=10_000)
    assert c.steps == 3110 and "answered by their notice" in c.reason


def test_checkpoint_interval_bounds():
    from sailor_core.errors import ValidationError
    from sailor_core.planner.risk import checkpoint_interval

    # never below one write (here 30 s of 1 s steps: at 1000 preemptions an hour, M = 3.6 s and Young's
    # sqrt(2 x 29.01 x 3.6) = 14.5 s is shorter), never above the job, never below one step
    assert checkpoint_interval(iteration_s=1.0, write_s=30.0, stall_s=0.01, notice_s=None,
                               spot_preemptions_per_hour=1000.0, vms=1, total_steps=1000).steps == 30
    assert checkpoint_interval(iteration_s=1.0, write_s=1.0, stall_s=1.0, notice_s=None,
                               spot_preemptions_per_hour=0.0, vms=1, total_steps=50).steps == 50
    assert checkpoint_interval(iteration_s=100.0, write_s=1.0, stall_s=1.0, notice_s=None,
                               spot_preemptions_per_hour=50.0, vms=1, total_steps=50).steps == 1
    with pytest.raises(ValidationError):
        checkpoint_interval(iteration_s=0.0, write_s=1.0, stall_s=1.0, notice_s=None, spot_preemptions_per_hour=0.0,
                            vms=1, total_steps=5)
