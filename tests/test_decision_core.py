"""One decision core (sailor_core/decisions.py) for the flow's replan and the trace replay.

The same scripted events (a spot VM of the plan preempted at step 100, then the spot price rising
ninefold at step 300) drive the replay's Sailor policy over a trace and the flow's replan decision
(flows/replan.weigh: the subflow's own planning, pricing and weighing, before it changes anything)
over the offerings a provider would show at those steps; both decide the same, for the same
reasons. And the reconfiguration time the decisions assume is measured (issue 44, item 6): this
run's switches, else earlier runs', else the provider's measured VM start, not a constant.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from flows.params import SailorParams
from flows.replan import RunContext, RunSetup, weigh
from infra.provider import EventKind, ProviderEvent, Vm
from profiles_store import open_store
from sailor_core.decisions import (
    Assessment,
    Happened,
    Option,
    PlanCost,
    Replacement,
    RunningJob,
    StartupTimes,
    assess,
    choose,
    reconfiguration_estimate,
)
from sailor_core.domain import Capacity, Market, ResourcePool, default_region
from sailor_core.planner import SearchOptions
from sailor_core.planner.request import Constraints, PlanRequest, Restrictions
from sailor_core.planner.risk import ASSUMED_LOAD_BYTES_PER_S, assumed_vm_start_s
from sailor_core.replay import Place, Planner, ReplayJob, Trace, TracePoint, policy_named, replay
from tasks.history import Measurement, RunHistory
from tasks.jobs import Job, nodes
from tasks.steps import make_plan
from tests.planner_fixtures import MODEL, tiny_book

BOOK = tiny_book(3)
OD, SPOT = Market.ON_DEMAND, Market.SPOT
PLACES = (("r1-a", "fast", SPOT), ("r1-a", "fast", OD), ("r1-b", "fast", OD))
ASSUMED_RECONFIGURATION_S = 15.0  # the flow's Deps.reconfiguration_estimate_s
TOTAL, EVERY = 2000, 40
MIN_IT_S = 0.6  # a throughput floor one GPU cannot reach: the plan spans VMs
GPN = 1  # GPUs per VM: a preemption takes one of the plan's VMs and leaves the other
# (step, GPUs available per place, prices, GPUs of running VMs taken per place): the scripted events
START = (0, (4, 4, 4), (1.0, 3.0, 3.0), (0, 0, 0))
PREEMPTION = (100, (3, 4, 4), (1.0, 3.0, 3.0), (1, 0, 0))
PRICE_RISE = (300, (3, 4, 4), (9.0, 3.0, 3.0), (0, 0, 0))


def the_trace() -> Trace:
    def point(at_step, counts, prices, taken):
        return TracePoint(at_s=0, at_step=at_step or None, counts=counts, usd_per_gpu_hour=prices,
                          taken=taken if any(taken) else ())
    return Trace(name="scripted", places=tuple(Place(zone=z, gpu_type=g, market=m, gpus_per_node=GPN)
                                               for z, g, m in PLACES),
                 points=tuple(point(*e) for e in (START, PREEMPTION, PRICE_RISE)))


def replay_job() -> ReplayJob:
    # what the flow's RunContext asks for and assumes with these parameters on a fresh store
    return ReplayJob(model=MODEL, global_batch_size=16, total_steps=TOTAL, tokens_per_step=16 * 1024,
                     objective="min-cost", search=SearchOptions(max_stages=2), checkpoint_interval=EVERY,
                     restrictions=Restrictions(max_gpus=16), constraints=Constraints(min_iterations_per_s=MIN_IT_S),
                     reconfiguration_s=ASSUMED_RECONFIGURATION_S,
                     vm_start_s=assumed_vm_start_s("local"), load_bytes_per_s=ASSUMED_LOAD_BYTES_PER_S)


class _Local:
    """The provider as the decision reads it: its name (whose VM start times count)."""

    name = "local"


def flow_context(tmp_path: Path, plan) -> RunContext:
    params = SailorParams(model=MODEL, global_batch_size=16, objective="min-cost", max_stages=2, workers=16,
                          provider="local", checkpoint_interval=EVERY, steps=TOTAL,
                          min_iterations_per_s=MIN_IT_S)
    setup = RunSetup(run_id="run-1", params=params, provider=_Local(), history=RunHistory(open_store(
        str(tmp_path / "store"), seed=False)), run_dir=tmp_path, reconfiguration_estimate_s=ASSUMED_RECONFIGURATION_S)
    return RunContext(setup=setup, base_book=BOOK, plan=plan, total_steps=TOTAL)


def vms_of(plan) -> list[Vm]:
    return [Vm(vm_id=f"vm-{n.index}", run_id="run-1", name=n.name, zone=n.spec.zone, gpu_type=n.spec.gpu_type,
               gpus=n.devices, market=n.spec.market) for n in nodes(plan)]


def offers_at(event, held: list[Vm]) -> list[Capacity]:
    """What a provider offers at the event: the trace's GPUs less those the job still holds."""
    _, counts, prices, _ = event
    out = []
    for (z, g, m), n, u in zip(PLACES, counts, prices, strict=True):
        mine = sum(v.gpus for v in held if (v.zone, v.gpu_type, v.market) == (z, g, m))
        out.append(Capacity(zone=z, region=default_region(z), gpu_type=g, gpus=max(0, n - mine), market=m,
                            gpus_per_vm=GPN, usd_per_gpu_hour=u))
    return out


def flow_decides(tmp_path: Path, plan, event, kind: EventKind):
    """The flow's replan decision at the event, on a job running `plan` (the event's taken GPUs are its VMs)."""
    vms = vms_of(plan)
    step, _, _, taken = event
    lost: list[Vm] = []
    for (z, g, m), t in zip(PLACES, taken, strict=True):
        lost += [v for v in vms if (v.zone, v.gpu_type, v.market) == (z, g, m)][: t // GPN]
    now = datetime.now(UTC)
    events = [ProviderEvent(kind=kind, at=now, vm_id=v.vm_id, zone=v.zone, gpu_type=v.gpu_type, market=v.market)
              for v in lost] or [ProviderEvent(kind=kind, at=now)]
    job = Job(run_id="run-1", version=1, plan=plan, vms=vms, run_dir=tmp_path, total_steps=TOTAL,
              checkpoint_interval=EVERY, state=None)
    held = [v for v in vms if v not in lost]
    return weigh(flow_context(tmp_path, plan), job, events=events, calibration=None, step=step,
                 offers=offers_at(event, held), plan=make_plan.fn)


def test_the_replay_and_the_flow_decide_the_same_for_the_same_reasons(tmp_path):
    job = replay_job()
    r = replay(the_trace(), BOOK, job, policy_named("sailor"), name="sailor")
    changes = [d for d in r.decisions if d.trigger != "start"]
    assert [d.step for d in changes] == [100, 300]
    first = Planner(BOOK, job).best(the_trace().pool_at(0))
    assert first is not None and {rep.market for st in first.plan.stages for rep in st.replicas} == {SPOT}

    after_loss = flow_decides(tmp_path / "a", first.plan, PREEMPTION, EventKind.PREEMPTION)
    v = after_loss.verdict
    assert (v.kind, v.reason) == (changes[0].kind, changes[0].reason)
    assert v.kind == "switch" and "1 GPU(s) of the plan lost (1x fast spot @r1-a)" in v.reason
    # it asked for the best plan on the GPU still held and on everything; one GPU is below the throughput floor
    assert [k for k, _ in after_loss.assessment.requests] == ["held", "best"]
    assert "no plan for the best plan on the VMs still held" in after_loss.notes[0]

    assert v.option is not None
    after_rise = flow_decides(tmp_path / "b", v.option.plan, PRICE_RISE, EventKind.PRICE_CHANGE)
    assert (after_rise.verdict.kind, after_rise.verdict.reason) == (changes[1].kind, changes[1].reason)
    assert after_rise.verdict.reason.startswith("after price_change at step 300: ")


def _assessment(*, gone=None, cost=PlanCost(iteration_time_s=1.0, usd_per_iteration=0.01, usd_per_hour=36.0),
                limits=Constraints()) -> Assessment:
    plan = Planner(BOOK, replay_job()).best(the_trace().pool_at(0)).plan
    req = PlanRequest(model=MODEL, global_batch_size=16, pool=the_trace().pool_at(0), constraints=limits)
    return assess(Happened(kinds=("preemption",) if gone else ("price_change",), step=130, gone=gone or {}),
                  RunningJob(plan=plan, cost=cost, total_steps=1000, checkpoint_interval=50), limits=req,
                  held=ResourcePool(entries=()) if gone else None)


def test_assess_says_why_the_plan_cannot_go_on_and_what_to_plan():
    lost = _assessment(gone={("r1-a", "fast", SPOT): 2})
    assert lost.lost and lost.broken == "2 GPU(s) of the plan lost (2x fast spot @r1-a)"
    assert (lost.remaining_steps, lost.lost_steps) == (870, 30)  # 130 - the checkpoint at 100
    assert [k for k, _ in lost.requests] == ["best"] and lost.move_current  # nothing held: no "held" request
    whole = _assessment()
    assert not whole.lost and whole.broken == "" and whole.lost_steps == 0  # a whole plan stops at a checkpoint
    capped = _assessment(limits=Constraints(max_usd_per_hour=10.0))
    assert capped.broken.startswith("the current plan now breaks a limit: ")


def test_choose_waits_stays_or_switches_and_says_why():
    a = _assessment(gone={("r1-a", "fast", SPOT): 2})
    times = StartupTimes(reconfiguration_s=20.0, vm_start_s=10.0)
    assert choose(a, [], objective="min-cost", times=times).kind == "wait"
    whole = _assessment()
    stay = choose(whole, [], objective="min-cost", times=times)
    assert stay.kind == "stay" and stay.reason == ("after price_change at step 130: no feasible plan with current "
                                                   "offerings; staying on the current plan")
    cheaper = Option(kind="best", plan=replace(whole.job.plan, global_batch_size=whole.job.plan.global_batch_size),
                     replacement=Replacement(cost=PlanCost(iteration_time_s=1.0, usd_per_iteration=0.001,
                                                           usd_per_hour=3.6)))
    sw = choose(whole, [cheaper], objective="min-cost", times=times)
    assert sw.kind == "stay" and "the best plan is the current plan" in sw.reason  # an equal plan is no switch


def test_the_reconfiguration_time_is_measured_before_it_is_assumed():
    assert reconfiguration_estimate(this_run_in_place_s=(), assumed_s=15.0) == (15.0, "assumed (nothing measured yet)")
    assert reconfiguration_estimate(this_run_in_place_s=(), vm_start_s=41.0, assumed_s=15.0)[0] == 41.0
    assert reconfiguration_estimate(this_run_in_place_s=(), earlier_in_place_s=(20.0, 30.0, 70.0), vm_start_s=41.0,
                                    assumed_s=15.0)[0] == 30.0  # the median of earlier runs' switches
    got = reconfiguration_estimate(this_run_in_place_s=(51.1, 12.0), earlier_in_place_s=(20.0,), assumed_s=15.0)
    assert got[0] == 51.1 and "this run" in got[1]


def test_the_flows_decisions_use_the_reconfiguration_it_measured(tmp_path):
    first = Planner(BOOK, replay_job()).best(the_trace().pool_at(0)).plan
    ctx = flow_context(tmp_path, first)
    assert ctx.reconfiguration() == (ASSUMED_RECONFIGURATION_S, "assumed (nothing measured yet)")
    # the provider's VMs measured at this run's cold start (the testbed's boot): the estimate before any switch
    ctx.history.measurement("run-1", Measurement.VM_START, {"provider": "local", "vm_start_s": 44.0})
    assert ctx.reconfiguration()[0] == 44.0
    # an earlier run's switch in place counts before the VM start
    ctx.history.measurement("run-0", Measurement.RECONFIGURATION, {"reconfiguration_s": 33.0, "new_vms": 0})
    assert ctx.reconfiguration()[0] == 33.0
    # this run's own switch in place counts first (51.1 s: the switch that took that long)
    ctx.switches[2] = (51.1, True)
    assert ctx.reconfiguration()[0] == 51.1
    decided = flow_decides(tmp_path / "x", first, PRICE_RISE, EventKind.PRICE_CHANGE)  # a fresh store: assumed
    assert "incl. 15.0s reconfiguration" in decided.verdict.reason
    measured_store = tmp_path / "x" / "store"
    RunHistory(open_store(str(measured_store), seed=False)).measurement(
        "run-0", Measurement.RECONFIGURATION, {"reconfiguration_s": 51.1, "new_vms": 0})
    again = flow_decides(tmp_path / "x", first, PRICE_RISE, EventKind.PRICE_CHANGE)
    assert "incl. 51.1s reconfiguration" in again.verdict.reason
    assert again.verdict.decision is not None and decided.verdict.decision is not None
    assert again.verdict.decision.switch_usd > decided.verdict.decision.switch_usd  # the longer switch costs more


def test_a_replayed_run_assumes_the_reconfiguration_the_flow_knew_at_each_replan(tmp_path):
    """The replay rebuilds, at each replan, what the flow's store held then (its own switches, earlier
    runs' switches in place, the provider's VM starts), never what was recorded later, and the same
    function turns it into the figure: the flow and the replay assume the same reconfiguration."""
    from datetime import timedelta

    from sailor_core.decisions import Measured
    from sailor_core.replay.history import run_trace
    from tasks.history import RunEvent, RunStatus

    ticks = iter(datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=i) for i in range(100))
    first = Planner(BOOK, replay_job()).best(the_trace().pool_at(0)).plan
    ctx = flow_context(tmp_path, first)
    h = ctx.history
    h.clock = lambda: next(ticks)
    h.run_status("run-1", RunStatus.RUNNING, "", {"params": {"provider": "local"}})
    flow_knew: list[float] = []

    def replan(step: int) -> None:
        flow_knew.append(ctx.reconfiguration()[0])  # what the flow assumes, read before it records the replan
        h.event("run-1", RunEvent.REPLAN, "", {"step": step})

    replan(10)  # nothing measured: assumed
    h.measurement("run-1", Measurement.VM_START, {"provider": "local", "vm_start_s": 44.0})
    h.measurement("run-9", Measurement.VM_START, {"provider": "aws", "vm_start_s": 99.0})  # another provider's
    replan(20)  # this run's VM start
    h.measurement("run-0", Measurement.RECONFIGURATION, {"reconfiguration_s": 33.0, "new_vms": 0})
    h.measurement("run-0", Measurement.RECONFIGURATION, {"reconfiguration_s": 70.0, "new_vms": 2})  # rented VMs
    replan(30)  # an earlier run's switch in place
    h.event("run-1", RunEvent.RECONFIGURED, "", {"reconfiguration_s": 51.1, "new_vms": 0})
    h.measurement("run-1", Measurement.RECONFIGURATION, {"reconfiguration_s": 51.1, "new_vms": 0})
    ctx.switches[2] = (51.1, True)
    replan(40)  # this run's own switch in place
    h.measurement("run-0", Measurement.RECONFIGURATION, {"reconfiguration_s": 90.0, "new_vms": 0})  # learned later
    assert flow_knew == [ASSUMED_RECONFIGURATION_S, 44.0, 33.0, 51.1]

    measured = [(r.time, m) for r in h.store.read_history("measurements")
                if (m := Measured.of(r.run_id, r.kind, r.payload)) is not None]
    tr = run_trace(h.show("run-1"), the_trace().pool_at(0), measured=measured)
    assert [(p.at_step, p.reconfiguration_s) for p in tr.points[1:]] == [(10, ASSUMED_RECONFIGURATION_S), (20, 44.0),
                                                                         (30, 33.0), (40, 51.1)]
