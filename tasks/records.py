"""JSON-shaped records that cross the seam between flows/, tasks/ and the store, typed once.

Contract: each record here is genuinely JSON (it is written to the store's run history, a Prefect
artifact or event, or comes from a worker as a JSON line), so it is a `TypedDict`: the same dict as
before, with its keys named. Values the orchestration computes and keeps in memory are dataclasses
beside their owners (tasks/jobs.py, tasks/steps.py, flows/replan.py), not here.
- `JSONObject`: a payload of arbitrary JSON (an event's or a measurement's `payload`); read it only
  where its producer is known, through one of the records below.
- `MetricRow`: one per-step record a worker reports (`Controller.metrics`, tasks/control.py), saved
  under the run's state (`flush_metrics`, tasks/runstate.py) and read back with its `plan_version`.
- `RunRow`: one run as `RunHistory.list_runs` derives it from the `runs` table.
- `LeaseOwner`, `ReplanRequest`: the lease's owning process; another run's request to re-plan.
- `RunSummary`, `CostTable`: what a `sailor` run returns and its cost artifact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

# Arbitrary JSON, as the store's payload column and Prefect's event payloads hold it: a mapping from
# names to JSON values (the writer, json.dumps or the store, checks them).
JSONObject = Mapping[str, object]


class MetricRow(TypedDict, total=False):
    """sailor_core/runtime/engine.py writes these (and may add measured times); all optional to a reader."""

    step: int
    loss: float
    samples: int
    samples_seen: int
    iteration_time_s: float
    grad_norm: float
    tokens_per_s: float
    memory_bytes: int
    plan_version: int
    world_size: int
    time: float
    lr: float
    model_flops_per_s: float
    pipeline_s: float  # the step's parts on this rank: forwards, backwards and sends,
    grad_sync_s: float  # waiting for the gradient all-reduce (and the tied weights'),
    agree_s: float  # the step's one world all-reduce (loss, grad norm, notices),
    optimizer_s: float  # clipping and the optimizer step
    checkpoint_write_s: float
    checkpoint_stall_s: float


class LeaseOwner(TypedDict):
    host: str
    pid: int
    start: int | None  # the process's start time in clock ticks since boot (None: unknown)


class RunRow(TypedDict, total=False):
    run_id: str
    name: str
    started_at: str
    updated_at: str
    ended_at: str
    status: str
    status_reason: str
    provider: str
    model: str
    flow_run_id: str
    lease_expires_at: str
    owner: LeaseOwner
    crash_detected: bool
    steps_done: int
    final_loss: float | None
    tokens: int
    usd_total: float
    wall_s: float
    training_s: float
    orchestration_overhead_s: float
    plan_versions: int


class ReplanRequest(TypedDict):
    requested_by: str
    reason: str
    time: str


class DecisionNote(TypedDict):
    kind: str
    reason: str


class CostTable(TypedDict):
    usd_so_far: float
    vms_rented: int
    usd_per_hour_now: float
    plan_version: int
    steps_done: int
    total_steps: int


class RunSummary(TypedDict, total=False):
    run_id: str
    status: str
    steps_done: int
    total_steps: int
    final_loss: float | None  # the last step's loss
    tokens: int  # tokens trained: steps x global batch x sequence length
    plan_versions: int
    usd_total: float
    wall_s: float
    training_s: float
    orchestration_overhead_s: float
    reconfigurations_s: list[float]
    decisions: list[DecisionNote]
    plan: str
    dry_run: str  # a dry run: what provisioning would do
    deferred_to: str  # a scheduled rerun that asked the live run to re-plan instead
    nothing_to_do_after: str  # a rerun of a job whose last run had trained every step asked: rented nothing
