"""What a person sees of a run in Prefect: events, artifacts and progress.

Contract: `emit(kind, run_id, ...)` sends a Prefect event `sailor.<kind>` about the resource
`sailor.run.<run_id>` (and records nothing else); the artifact functions publish the plan as a
table, the throughput-cost frontier as a plot (PNG, inlined) with its table, the event and
decision timeline, the cost so far, and the training curves (loss and tokens/s per step, reconfigurations
marked; `curves_png` is also what `sailor runs show --plot` draws), under keys derived from the run id.
Each key is one artifact, created once and then updated in place (`_publish`): a run's curves, plan,
timeline and cost are each one artifact whatever the number of updates, not a new version per update
(each was an `artifact.created` event in `prefect deployment run --watch`). `ProgressBar` wraps a
progress artifact, updated every 10 % of the steps.
Nothing here decides anything; failures to publish are logged, never fatal for the run.
"""

from __future__ import annotations

import base64
import io
import logging
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING
from uuid import UUID

from prefect.artifacts import (
    TableArtifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.events import emit_event
from prefect.logging import get_run_logger

from infra.provider import Vm
from sailor_core.domain import ParallelPlan
from sailor_core.units import sig, usd
from tasks.records import CostTable, JSONObject, MetricRow

if TYPE_CHECKING:
    from sailor_core.planner.request import FrontierPoint
    from sailor_core.simulator.result import SimulationResult


def artifact_key(prefix: str, run_id: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{prefix}-{run_id}".lower()).strip("-")[:100]


# What get_run_logger returns (a run's logger adapter, or a plain logger outside a run).
Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]


def _logger() -> Logger:
    try:
        return get_run_logger()
    except Exception:  # outside a run (tests calling .fn)
        return logging.getLogger("sailor")


def emit(kind: str, run_id: str, payload: JSONObject | None = None) -> None:
    try:
        emit_event(
            event=f"sailor.{kind}",
            resource={"prefect.resource.id": f"sailor.run.{run_id}", "prefect.resource.name": run_id,
                      "sailor.run_id": run_id},
            payload=dict(payload or {}),
        )
    except Exception as e:  # events are for people and automations; the run goes on without them
        _logger().warning("could not emit event sailor.%s: %s", kind, e)


def _publish(key: str, description: str, *, markdown: str | None = None,
             table: Sequence[dict[str, object]] | None = None) -> None:
    """The artifact `key` with this content: updated in place when the run published it before, else created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=[key])), limit=1)
        if found:
            data = markdown if markdown is not None else TableArtifact(table=list(table or [])).format()
            client.update_artifact(found[0].latest_id, ArtifactUpdate(data=data, description=description))
            return
    if markdown is not None:
        create_markdown_artifact(key=key, markdown=markdown, description=description)
    else:
        create_table_artifact(key=key, table=list(table or []), description=description)


def plan_rows(plan: ParallelPlan, vms: Sequence[Vm] | None = None) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    k = 0
    for i, st in enumerate(plan.stages):
        for j, r in enumerate(st.replicas):
            p = plan.pipelines[j]
            row = {"stage": i, "layers": f"{st.first_layer}-{st.last_layer}", "replica": j, "gpu_type": r.gpu_type,
                   "zone": r.zone, "market": r.market.value, "tp": r.tp, "microbatch_size": p.microbatch_size,
                   "microbatches": p.num_microbatches}
            if vms is not None and k < len(vms):
                row["vm"] = vms[k].vm_id
            rows.append(row)
            k += 1
    return rows


def publish_plan(run_id: str, version: int, plan: ParallelPlan, estimate: SimulationResult, reason: str) -> None:
    try:
        _publish(artifact_key("plan", run_id), table=plan_rows(plan),
                 description=(f"Plan v{version} for {plan.model}, global batch {plan.global_batch_size}: "
                              f"{sig(estimate.iteration_time_s)} s/iteration, "
                              f"{usd(estimate.usd_per_hour)} USD/hour. {reason}"))
    except Exception as e:  # noqa: BLE001 - artifacts are for people: the run goes on
        _logger().warning("could not publish the plan artifact: %s", e)


def frontier_png(points: Sequence[FrontierPoint], chosen: SimulationResult | None) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=90)
    xs = [p.usd_per_iteration for p in points]
    ys = [p.iterations_per_s for p in points]
    ax.plot(xs, ys, "o-", color="#2563eb", label="frontier")
    if chosen:
        ax.plot([chosen.usd_per_iteration], [chosen.throughput_iterations_per_s], "*", color="#dc2626", ms=14,
                label="chosen")
    ax.set_xlabel("USD per iteration")
    ax.set_ylabel("iterations per second")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def publish_frontier(run_id: str, version: int, points: Sequence[FrontierPoint],
                     chosen: SimulationResult | None) -> None:
    try:
        lines = [f"# Throughput-cost frontier (plan v{version})", ""]
        if points:
            png = base64.b64encode(frontier_png(points, chosen)).decode()
            lines += [f"![frontier](data:image/png;base64,{png})", ""]
        lines += ["| iterations/s | USD/iteration | USD/hour | GPUs | plan |", "|---|---|---|---|---|"]
        for p in points:
            lines.append(f"| {sig(p.iterations_per_s)} | {usd(p.usd_per_iteration)} | {usd(p.usd_per_hour)} "
                         f"| {p.num_gpus} | {'**chosen**: ' if p.chosen else ''}{p.summary} |")
        _publish(artifact_key("frontier", run_id), markdown="\n".join(lines),
                 description="Pareto frontier of throughput against cost, as the simulator scores it")
    except Exception as e:  # noqa: BLE001 - artifacts are for people: the run goes on
        _logger().warning("could not publish the frontier artifact: %s", e)


def publish_timeline(run_id: str, events: Iterable[JSONObject], decisions: Iterable[JSONObject]) -> None:
    try:
        rows = [("event", str(e["kind"]), str(e["time"]), e.get("reason", "")) for e in events]
        rows += [("decision", str(d["kind"]), str(d["time"]), d.get("reason", "")) for d in decisions]
        rows.sort(key=lambda r: r[2])
        lines = ["# Events and decisions", "", "| time (UTC) | what | kind | reason |", "|---|---|---|---|"]
        for what, kind, t, reason in rows:
            lines.append(f"| {t[11:23]} | {what} | {kind} | {str(reason).replace('|', '/')} |")
        _publish(artifact_key("timeline", run_id), markdown="\n".join(lines),
                 description="What happened in this run and what the flow decided, with reasons")
    except Exception as e:  # noqa: BLE001 - artifacts are for people: the run goes on
        _logger().warning("could not publish the timeline artifact: %s", e)


def publish_cost(run_id: str, cost: CostTable) -> None:
    try:
        rows = [{"item": k, "value": v} for k, v in cost.items()]
        _publish(artifact_key("cost", run_id), table=rows, description="Cost so far")
    except Exception as e:  # noqa: BLE001 - artifacts are for people: the run goes on
        _logger().warning("could not publish the cost artifact: %s", e)


def reconfiguration_steps(rows: Sequence[MetricRow]) -> list[tuple[int, int]]:
    """(step, plan version) where each plan version after the first trained its first step."""
    out: list[tuple[int, int]] = []
    seen: set[int] = set()
    for r in sorted(rows, key=lambda r: (r.get("plan_version", 0), r["step"])):
        v = int(r.get("plan_version", 0))
        if v not in seen:
            seen.add(v)
            if len(seen) > 1:
                out.append((int(r["step"]), v))
    return out


def curves_png(rows: Sequence[MetricRow], title: str = "") -> bytes:
    """Loss and throughput (tokens/s) against the step, each reconfiguration a dashed line named by its plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: (r.get("plan_version", 0), r["step"]))
    fig, (loss_ax, tps_ax) = plt.subplots(2, 1, figsize=(6, 4.6), dpi=90, sharex=True)
    for v in sorted({int(r.get("plan_version", 0)) for r in rows}):
        mine = [r for r in rows if int(r.get("plan_version", 0)) == v]
        steps = [r["step"] for r in mine]
        loss_ax.plot(steps, [r.get("loss", float("nan")) for r in mine], ".-", label=f"plan v{v}")
        tps_ax.plot(steps, [r.get("tokens_per_s", float("nan")) for r in mine], ".-")
    for step, v in reconfiguration_steps(rows):
        for ax in (loss_ax, tps_ax):
            ax.axvline(step - 0.5, color="#dc2626", ls="--", lw=1)
        loss_ax.annotate(f"v{v}", (step - 0.5, 1), xycoords=("data", "axes fraction"), color="#dc2626",
                         ha="left", va="top", fontsize=8)
    loss_ax.set_ylabel("loss")
    tps_ax.set_ylabel("tokens / s")
    tps_ax.set_xlabel("step")
    for ax in (loss_ax, tps_ax):
        ax.grid(alpha=0.3)
    if rows:
        loss_ax.legend(loc="upper right", fontsize=8)
    if title:
        loss_ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def publish_curves(run_id: str, rows: Sequence[MetricRow]) -> None:
    """The loss and throughput curves so far (PNG, inlined) with one row per plan version, the artifact
    updated in place each call, so the UI shows the latest while the run trains."""
    try:
        if not rows:
            return
        png = base64.b64encode(curves_png(rows)).decode()
        lines = ["# Training curves", "", f"![loss and throughput](data:image/png;base64,{png})", "",
                 "| plan version | steps | loss (first -> last) | median tokens/s |", "|---|---|---|---|"]
        for v in sorted({int(r.get("plan_version", 0)) for r in rows}):
            mine = sorted((r for r in rows if int(r.get("plan_version", 0)) == v), key=lambda r: r["step"])
            tps = sorted(float(r.get("tokens_per_s", 0.0)) for r in mine)
            lines.append(f"| v{v} | {mine[0]['step']}-{mine[-1]['step']} | {mine[0].get('loss', float('nan')):.4f} -> "
                         f"{mine[-1].get('loss', float('nan')):.4f} | {tps[len(tps) // 2]:,.0f} |")
        marks = ", ".join(f"step {s}: plan v{v}" for s, v in reconfiguration_steps(rows))
        lines += ["", f"Reconfigurations (dashed lines): {marks or 'none'}."]
        _publish(artifact_key("curves", run_id), markdown="\n".join(lines),
                 description="Loss and tokens/s per step, each reconfiguration marked")
    except Exception as e:  # noqa: BLE001 - artifacts are for people: the run goes on
        _logger().warning("could not publish the training curves: %s", e)


class ProgressBar:
    def __init__(self, run_id: str, total_steps: int) -> None:
        self.total = max(1, total_steps)
        self.id: UUID | None = None
        self.last = -1.0
        try:
            made = create_progress_artifact(progress=0.0, key=artifact_key("progress", run_id),
                                            description=f"training steps done of {total_steps}")
            self.id = made if isinstance(made, UUID) else None  # the sync client returns the id
        except Exception as e:  # noqa: BLE001 - artifacts are for people: the run goes on
            _logger().warning("could not create the progress artifact: %s", e)

    def update(self, step: int) -> None:
        pct = min(100.0, 100.0 * step / self.total)
        if self.id is None or pct - self.last < 10.0 and pct < 100.0:
            return
        self.last = pct
        try:
            update_progress_artifact(self.id, pct)
        except Exception as e:  # noqa: BLE001 - artifacts are for people: the run goes on
            _logger().warning("could not update progress: %s", e)
