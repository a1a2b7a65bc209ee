"""Run history: what a run did and why, kept in the store's run-history tables.

Contract: `RunHistory(store)` writes and reads the append-only tables `runs`, `events`, `decisions`,
`plans` and `measurements` of profiles_store (one row = run_id, time, kind, reason, JSON payload).
Every run has a unique id (`new_run_id`: its name plus a random suffix), so a second run with the
same name never overwrites the first. A run's status is the kind of its newest `runs` row
(running, completed, failed, cancelled, crashed). No Prefect here: the CLI (`sailor runs`) reads
it too. Times are timezone-aware UTC; `clock` is passed in.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from sailor_core.domain import SailorError

TABLES = ("runs", "events", "decisions", "plans", "measurements")
# Event kinds a person reads in `sailor runs show` (the minimum plus what monitoring adds).
EVENT_KINDS = (
    "provisioned", "training_started", "preemption", "lost", "price_change", "capacity_change",
    "iteration_time", "replan", "reconfigured", "teardown", "completed", "failed",
)
FINAL_STATUSES = ("completed", "failed", "cancelled", "crashed")


class HistoryStore(Protocol):
    def append_history(self, table: str, records: Any, *, provenance: Any = None) -> int: ...

    def read_history(self, table: str, *, run_id: str | None = None, kind: str | None = None) -> list[Any]: ...


class UnknownRunError(SailorError):
    """No run with that id in the store."""


def new_run_id(name: str, suffix: str | None = None) -> str:
    return f"{name}-{suffix or uuid.uuid4().hex[:8]}"


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="milliseconds")


class RunHistory:
    def __init__(self, store: HistoryStore, *, clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.store = store
        self.clock = clock
        self._last: datetime | None = None

    # -- writes ----------------------------------------------------------------------------------
    def _append(self, table: str, run_id: str, kind: str, reason: str = "", payload: Mapping[str, Any] | None = None,
                at: datetime | None = None) -> None:
        from profiles_store.store import HistoryRecord

        t = at or self.clock()
        if at is None:
            # Rows are read back in time order: keep this writer's rows in the order they were written.
            if self._last is not None and t <= self._last:
                t = self._last + timedelta(microseconds=1)
            self._last = t
        rec = HistoryRecord(run_id=run_id, kind=kind, time=t, reason=reason, payload=dict(payload or {}))
        self.store.append_history(table, [rec])

    def run_status(self, run_id: str, status: str, reason: str = "", payload: Mapping[str, Any] | None = None) -> None:
        self._append("runs", run_id, status, reason, payload)

    def event(self, run_id: str, kind: str, reason: str = "", payload: Mapping[str, Any] | None = None,
              at: datetime | None = None) -> None:
        self._append("events", run_id, kind, reason, payload, at)

    def decision(self, run_id: str, kind: str, reason: str, payload: Mapping[str, Any] | None = None) -> None:
        self._append("decisions", run_id, kind, reason, payload)

    def plan(self, run_id: str, version: int, plan: Mapping[str, Any], estimate: Mapping[str, Any], reason: str) -> None:
        self._append("plans", run_id, "plan", reason, {"version": version, "plan": plan, "estimate": estimate})

    def measurement(self, run_id: str, kind: str, payload: Mapping[str, Any], reason: str = "") -> None:
        self._append("measurements", run_id, kind, reason, payload)

    # -- reads -----------------------------------------------------------------------------------
    def calibration(self, gpu_types: list[str] | None = None) -> dict[str, float]:
        """Newest correction factor (measured / estimated iteration time) per GPU type, over all runs."""
        out: dict[str, tuple[datetime, float]] = {}
        for r in self.store.read_history("measurements", kind="calibration"):
            g = str(r.payload.get("gpu_type", ""))
            if gpu_types is not None and g not in gpu_types:
                continue
            if g not in out or r.time >= out[g][0]:
                out[g] = (r.time, float(r.payload["factor"]))
        return {g: f for g, (_, f) in out.items()}

    def list_runs(self) -> list[dict[str, Any]]:
        rows = self.store.read_history("runs")
        runs: dict[str, dict[str, Any]] = {}
        for r in sorted(rows, key=lambda r: r.time):
            cur = runs.setdefault(r.run_id, {"run_id": r.run_id, "name": "", "started_at": _iso(r.time)})
            if r.kind == "running":
                cur["name"] = r.payload.get("name", "")
                cur["provider"] = r.payload.get("provider", "")
                cur["model"] = r.payload.get("model", "")
                cur["flow_run_id"] = r.payload.get("flow_run_id", "")
            cur["status"] = r.kind
            cur["updated_at"] = _iso(r.time)
            if r.kind in FINAL_STATUSES:
                cur["ended_at"] = _iso(r.time)
                for k in ("steps_done", "usd_total", "wall_s", "training_s", "orchestration_overhead_s", "plan_versions"):
                    if k in r.payload:
                        cur[k] = r.payload[k]
        return sorted(runs.values(), key=lambda r: r["started_at"])

    def show(self, run_id: str) -> dict[str, Any]:
        runs = [r for r in self.list_runs() if r["run_id"] == run_id]
        if not runs:
            known = [r["run_id"] for r in self.list_runs()][-5:]
            raise UnknownRunError(
                f"no run {run_id!r} in the store; to fix: pick an id from `sailor runs list` (latest: {known})"
            )
        out = dict(runs[0])
        status_rows = self.store.read_history("runs", run_id=run_id)
        out["status_reason"] = status_rows[-1].reason if status_rows else ""
        out["params"] = next((r.payload.get("params", {}) for r in status_rows if r.kind == "running"), {})
        out["events"] = [
            {"kind": r.kind, "time": _iso(r.time), "reason": r.reason, **{k: v for k, v in r.payload.items()
                                                                           if k not in ("kind", "time", "reason")}}
            for r in self.store.read_history("events", run_id=run_id)
        ]
        out["decisions"] = [
            {"kind": r.kind, "time": _iso(r.time), "reason": r.reason, "detail": dict(r.payload)}
            for r in self.store.read_history("decisions", run_id=run_id)
        ]
        out["plans"] = [
            {"version": r.payload.get("version"), "time": _iso(r.time), "reason": r.reason,
             "plan": r.payload.get("plan"), "estimate": r.payload.get("estimate")}
            for r in self.store.read_history("plans", run_id=run_id)
        ]
        out["measurements"] = [
            {"kind": r.kind, "time": _iso(r.time), **dict(r.payload)}
            for r in self.store.read_history("measurements", run_id=run_id)
        ]
        # where the run's VMs and state lived (isolation, zones, device types, VMs, wheel, checkpoints)
        out["cluster"] = next((e["cluster"] for e in reversed(out["events"]) if e["kind"] == "cluster"), None)
        return out
