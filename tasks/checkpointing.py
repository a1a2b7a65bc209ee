"""The flow's checkpoint interval: the user's, or Young/Daly's from what the run knows.

Contract (no Prefect, no I/O): `interval_for(given, plan, iteration_s, ...)` returns the user's
interval when `given` >= 1, else `sailor_core.planner.risk.checkpoint_interval` over:
- the plan's estimated iteration time;
- the checkpoint's write and stall times: measured (the slowest rank's, from the last plan
  version's step records: `measured_checkpoint`) once the run has checkpointed, else estimated from
  the bytes the largest writer holds (fp32 weights and AdamW's two moments of its stage's layers)
  at `ASSUMED_WRITE_BYTES_PER_S` and `ASSUMED_SNAPSHOT_BYTES_PER_S`;
- the spot preemption rate of the plan's VMs (`SpotRisk`: the store's history, else the run's
  parameter) and the notice a preemption gives (`notice_s`: the parameter, the provider's
  documented notice, or the local scenario's shortest grace).
The flow records the interval and its reason with every plan version.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sailor_core.domain import ParallelPlan
from sailor_core.models.config import get_config, model_spec
from sailor_core.planner.risk import (
    CheckpointInterval,
    SpotRisk,
    checkpoint_interval,
    largest_shard_bytes,
    plan_nodes,
    plan_preemptions_per_hour,
)
from tasks.records import MetricRow

# Before a run has measured its own checkpoint: one writer's rate to object storage (a single stream of
# PUTs, well below a VM's NIC) and a host memory copy for the snapshot. Assumptions, replaced by the
# run's measurement at its next plan version.
ASSUMED_WRITE_BYTES_PER_S = 100e6
ASSUMED_SNAPSHOT_BYTES_PER_S = 2e9
# The notice a spot VM gets before it is taken back, as each cloud documents it.
PROVIDER_NOTICE_S = {"aws": 120.0, "gcp": 30.0}


def notice_s(provider: str, given: float | None, scenario_graces: Iterable[float] = ()) -> float | None:
    """The preemption notice the run can count on (None: unknown)."""
    if given is not None:
        return given
    if provider in PROVIDER_NOTICE_S:
        return PROVIDER_NOTICE_S[provider]
    graces = list(scenario_graces)
    return min(graces) if graces else None


def writer_state_bytes(plan: ParallelPlan) -> int:
    """What the largest checkpoint writer holds: one TP rank's shard of its stage's layers."""

    tps = sorted({r.tp for st in plan.stages for r in st.replicas})
    return largest_shard_bytes(plan, model_spec(get_config(plan.model), tps))


def measured_checkpoint(rows: Iterable[MetricRow]) -> dict[str, float] | None:
    """The newest step record's checkpoint times (`checkpoint_write_s`, `checkpoint_stall_s`), if any."""
    found = None
    for r in rows:
        if "checkpoint_write_s" in r:
            found = {"write_s": float(r["checkpoint_write_s"]), "stall_s": float(r.get("checkpoint_stall_s", 0.0))}
    return found


def interval_for(given: int, plan: ParallelPlan, iteration_s: float, *, total_steps: int, risk: SpotRisk,
                 notice: float | None, measured: Mapping[str, float] | None = None) -> CheckpointInterval:
    """The interval of this plan version (see the module's contract)."""
    if given >= 1:
        return CheckpointInterval(steps=given, seconds=given * iteration_s, reason=f"every {given} steps, as given")
    if measured is not None:
        write_s, stall_s, how = measured["write_s"], measured["stall_s"], "measured"
    else:
        size = writer_state_bytes(plan)
        write_s, stall_s = size / ASSUMED_WRITE_BYTES_PER_S, size / ASSUMED_SNAPSHOT_BYTES_PER_S
        how = f"estimated for {size / 1e6:.0f} MB per writer"
    nodes = plan_nodes(plan)
    c = checkpoint_interval(iteration_s=max(iteration_s, 1e-6), write_s=write_s, stall_s=stall_s, notice_s=notice,
                            spot_preemptions_per_hour=plan_preemptions_per_hour(nodes, risk),
                            vms=max(1, sum(nodes.values())), total_steps=total_steps)
    return CheckpointInterval(steps=c.steps, seconds=c.seconds, reason=f"{c.reason} (checkpoint times {how})")
