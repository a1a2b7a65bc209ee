"""What the flow decides while a plan trains: pure functions of what monitoring saw.

Contract: no I/O, no clock (callers pass `now`), no Prefect. `tasks.steps.monitor` gathers the facts
(progress, provider events, worker statuses, agent exit codes) and asks these functions what they
mean; the replan subflow and `sailor replay` (sailor_core.replay) share `decide_switch`, re-exported
here from sailor_core:
- `decide_switch(...)`: is a new plan worth the switch (`PlanCost`, `SwitchDecision`);
- `needs_decision(kind, vm_id, plan_vms)`: does a provider event call for re-planning;
- `failed_vms(statuses)`: VMs whose workers reported a failed generation (a lost worker to the flow);
- `lost_vms(events, plan_vms)`: the VMs a replan replaces (the provider's word before the workers');
- `awaits_cause(events, first_seen, now)`: whether only workers' failures are known yet and the provider may
  still name the VM that really went (`CAUSE_GRACE_S`);
- `check_calibration(...)`: measured against estimated iteration time, once enough steps ran;
- `first_step_kind(started_by)`: what a plan version's first step measures (`FirstStep`: the switch that
  started it, or its cold start);
- `all_exited_cleanly(codes)`, `exit_verdict(codes, step, total_steps)`: what agents that all exited
  cleanly mean;
- `stop_reason(...)`: a stall or a deadline that ends the run.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from infra.provider import EventKind, ProviderEvent, Reporter
from sailor_core.decisions import PlanCost, SwitchDecision, decide_switch
from tasks.jobs import ColdStart, Switch

__all__ = ["CalibrationCheck", "FirstStep", "PlanCost", "SwitchDecision", "all_exited_cleanly", "awaits_cause",
           "check_calibration", "decide_switch", "exit_verdict", "failed_vms", "first_step_kind", "lost_vms",
           "needs_decision", "stop_reason"]

# Provider events a running plan must answer (every kind there is, today).
ACTIONABLE_KINDS = frozenset({EventKind.PREEMPTION, EventKind.LOST, EventKind.PRICE_CHANGE, EventKind.CAPACITY_CHANGE})
VM_KINDS = frozenset({EventKind.PREEMPTION, EventKind.LOST})  # about one VM: only the plan's own VMs matter


def needs_decision(kind: str, vm_id: str | None, plan_vms: Collection[str]) -> bool:
    """A price or capacity change, or a preemption or loss of one of the plan's VMs."""
    if kind not in ACTIONABLE_KINDS:
        return False
    return kind not in VM_KINDS or vm_id in plan_vms


def lost_vms(events: Sequence[ProviderEvent], plan_vms: Collection[str]) -> set[str]:
    """The plan's VMs a replan replaces: those the provider saw go (preempted or lost); only when it saw
    none, those whose workers reported a failed generation (a worker failing because a peer died is
    collateral, not lost)."""
    gone = [e for e in events if e.kind in VM_KINDS]
    hard = {e.vm_id for e in gone if e.reported_by is not Reporter.WORKERS}
    return (hard or {e.vm_id for e in gone}) & set(plan_vms)


# How long the monitor waits for the provider to name the VM that went, once only workers' failures are known:
# a killed worker's peers fail their collective at once (gloo: connection reset), a moment before the provider
# sees the killed process exit; answering at once took the survivor for the lost VM and planned on the dead one.
CAUSE_GRACE_S = 5.0


def awaits_cause(events: Sequence[ProviderEvent], first_seen: float | None, now: float) -> bool:
    """Whether to hold these events a little longer: workers reported losses (collateral of a peer, or the
    only sign there will be), the provider has named no VM gone (`lost_vms` would take the workers' word),
    and the first came less than `CAUSE_GRACE_S` ago."""
    gone = [e for e in events if e.kind in VM_KINDS]
    unexplained = bool(gone) and all(e.reported_by is Reporter.WORKERS for e in gone)
    return unexplained and (first_seen is None or now - first_seen < CAUSE_GRACE_S)


def failed_vms(statuses: Mapping[str, str]) -> list[str]:
    """VMs whose workers' generation failed (a peer gone, a collective timed out): they wait for a new
    plan, so to the orchestration each is a lost worker whatever the provider says about the VM."""
    return [vm for vm, status in statuses.items() if status.startswith("failed")]


@dataclass(frozen=True)
class CalibrationCheck:
    ratio: float  # measured / estimated iteration time
    departs: bool  # off by more than the tolerance: re-plan with corrected profiles

    def reason(self, measured_s: float, estimated_s: float) -> str:
        return f"measured {measured_s:.4f}s/it vs estimated {estimated_s:.4f}s/it (x{self.ratio:.2f})"


def check_calibration(measured_s: float | None, estimated_s: float, samples: int, *, after: int,
                      tolerance: float) -> CalibrationCheck | None:
    """None until `after` steps were timed (and when there is no estimate); then the ratio and whether it
    departs from 1 by more than `tolerance`."""
    if estimated_s <= 0 or not measured_s or samples < after:
        return None
    ratio = measured_s / estimated_s
    return CalibrationCheck(ratio=ratio, departs=abs(ratio - 1.0) > tolerance)


class FirstStep(enum.StrEnum):
    """What a plan version's first trained step measures (the measurement's kind in the run history)."""

    RECONFIGURED = "reconfigured"  # the time a switch took, from the event that triggered it
    COLD_START = "cold_start"  # a fresh start, from provisioning


def first_step_kind(started_by: ColdStart | Switch | None) -> FirstStep | None:
    """What a plan version's first trained step measures, by how the version started."""
    if isinstance(started_by, Switch):
        return FirstStep.RECONFIGURED
    if isinstance(started_by, ColdStart):
        return FirstStep.COLD_START
    return None


def exit_verdict(codes: Sequence[int | None], step: int, total_steps: int) -> str | None:
    """Agents that all exited with 0: "completed" when the steps are done, else "stopped early" (an
    error: the workers believe they are done and the run is not); None while any still runs or failed
    (the heartbeats and statuses speak for those)."""
    if not all_exited_cleanly(codes):
        return None
    return "completed" if step >= total_steps else "stopped early"


def all_exited_cleanly(codes: Sequence[int | None]) -> bool:
    """Every agent has exited, each with 0 (None: still running)."""
    return bool(codes) and all(c == 0 for c in codes)


def stop_reason(*, now: float, last_progress_at: float, stall_timeout_s: float, deadline_at: float | None,
                step: int, total_steps: int, plan_shape: str, logs: str) -> str | None:
    """Why the run must stop now (no progress for too long while every worker beats, or the deadline
    passed), with how to fix it; None to go on watching."""
    if now - last_progress_at > stall_timeout_s:
        return (f"no training progress for {stall_timeout_s:.0f}s (step {step} of {total_steps}, {plan_shape}) "
                f"while every worker still beat its heartbeat: the runtime hangs on this plan; to fix: see the "
                f"worker logs under {logs} or restrict the plan (e.g. max_stages=1)")
    if deadline_at is not None and now > deadline_at:
        return f"deadline reached at step {step} of {total_steps}"
    return None
