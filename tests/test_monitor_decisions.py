"""The monitor's decisions (tasks/decisions.py) as pure functions: what each observation means."""

from __future__ import annotations

import pytest

from tasks.decisions import (
    all_exited_cleanly,
    check_calibration,
    exit_verdict,
    failed_vms,
    first_step_kind,
    needs_decision,
    stop_reason,
)
from tasks.jobs import ColdStart, Switch


@pytest.mark.parametrize("kind, vm, answer", [
    ("preemption", "vm-1", True), ("lost", "vm-1", True),
    ("preemption", "vm-old", False), ("lost", None, False),  # a VM the plan no longer uses
    ("price_change", None, True), ("capacity_change", None, True),
    ("provisioned", "vm-1", False), ("heartbeat", "vm-1", False),
])
def test_which_events_call_for_a_decision(kind, vm, answer) -> None:
    assert needs_decision(kind, vm, {"vm-1", "vm-2"}) is answer


def test_a_failed_generation_is_a_lost_worker() -> None:
    statuses = {"vm-1": "training", "vm-2": "failed: peer vm-1/0 gone", "vm-3": "failed", "vm-4": "switched"}
    assert failed_vms(statuses) == ["vm-2", "vm-3"]


def test_calibration_waits_for_enough_steps_then_compares_with_the_tolerance() -> None:
    assert check_calibration(0.2, 0.1, 4, after=5, tolerance=0.25) is None
    assert check_calibration(None, 0.1, 9, after=5, tolerance=0.25) is None
    assert check_calibration(0.2, 0.0, 9, after=5, tolerance=0.25) is None  # nothing estimated
    near = check_calibration(0.11, 0.1, 5, after=5, tolerance=0.25)
    assert near is not None and not near.departs and near.ratio == pytest.approx(1.1)
    far = check_calibration(0.05, 0.1, 5, after=5, tolerance=0.25)
    assert far is not None and far.departs and "x0.50" in far.reason(0.05, 0.1)


def test_the_first_step_measures_the_switch_or_the_cold_start_that_began_the_version() -> None:
    switch = Switch(trigger_at=1.0, trigger=("preemption",), pids_before={"vm-1": {"vm-1/0": 41}})
    assert first_step_kind(switch) == "reconfigured"
    assert first_step_kind(ColdStart(provisioned_at=0.5)) == "cold_start"
    assert first_step_kind(None) is None


def test_agents_that_exit_cleanly_complete_only_when_the_steps_are_done() -> None:
    assert exit_verdict([0, 0], 10, 10) == "completed"
    assert exit_verdict([0, 0], 7, 10) == "stopped early"
    assert exit_verdict([0, None], 10, 10) is None  # one still runs
    assert exit_verdict([0, 1], 10, 10) is None  # a failure: heartbeats and statuses report it
    assert exit_verdict([], 10, 10) is None
    assert all_exited_cleanly([0, 0]) and not all_exited_cleanly([0, None]) and not all_exited_cleanly([])


def test_a_stall_or_a_deadline_stops_the_run_and_says_how_to_fix_it() -> None:
    common = dict(step=3, total_steps=10, plan_shape="plan v1: 2 stage(s) x 1 replica(s)", logs="s3://b/logs")
    assert stop_reason(now=100.0, last_progress_at=90.0, stall_timeout_s=30.0, deadline_at=None, **common) is None
    stall = stop_reason(now=200.0, last_progress_at=90.0, stall_timeout_s=30.0, deadline_at=None, **common)
    assert (
        stall is not None and "no training progress for 30s" in stall and "to fix" in stall and "s3://b/logs" in stall
    )
    late = stop_reason(now=100.0, last_progress_at=90.0, stall_timeout_s=30.0, deadline_at=99.0, **common)
    assert late == "deadline reached at step 3 of 10"
