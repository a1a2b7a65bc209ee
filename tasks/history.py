"""Run history: what a run did and why, kept in the store's run-history tables.

Contract: `RunHistory(store)` writes and reads the append-only tables `runs`, `events`, `decisions`,
`plans` and `measurements` of profiles_store (one row = run_id, time, kind, reason, JSON payload).
Every run has a unique id (`new_run_id`: its name plus a random suffix), so a second run with the
same name never overwrites the first. A run's status is the kind of its newest `runs` row
(running, completed, failed, cancelled, crashed). No Prefect here: the CLI (`sailor runs`) reads
it too. Times are timezone-aware UTC; `clock` is passed in.

Ownership: a running run holds a *lease* (`renew_lease`, a `running` row with `lease_expires_at`)
that its flow renews (`LeaseKeeper`). `list_runs` shows a run whose lease expired as `crashed`
(`crash_detected: True` until `mark_crashed` writes it down), so a run whose process died is never
`running` forever. `live_run(name)` is the run of that name whose lease is current; another run
asks it to re-plan with `request_replan` (an event `replan_request` on the live run), which the
live run's keeper hands to its flow (`LeaseKeeper.take_request`). Each renewal names its owner (host,
pid, process start time); a reader on the same host whose `owner_alive` says that process is gone
shows the run `crashed` at once instead of after the lease (a SIGKILLed flow showed `running` for up
to a minute). On another host the lease alone decides.
"""

from __future__ import annotations

import enum
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast

from infra.provider import EventKind
from sailor_core.errors import UnknownRunError as UnknownRunError  # re-exported: tests import it from here
from sailor_core.uris import redact_text, redact_values
from tasks.records import JSONObject, LeaseOwner, ReplanRequest, RunRow

if TYPE_CHECKING:
    from profiles_store.store import HistoryRecord
    from sailor_core.domain import Provenance

TABLES = ("runs", "events", "decisions", "plans", "measurements")


class RunStatus(enum.StrEnum):
    """The kind of a `runs` row: a run's status is its newest row's."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    CRASHED = "crashed"


FINAL_STATUSES = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.CRASHED})


class RunEvent(enum.StrEnum):
    """Kinds of the `events` rows the orchestration writes; a provider's events are written under their
    own kind (infra.provider.EventKind: preemption, lost, price_change, capacity_change)."""

    PROVISIONED = "provisioned"
    TRAINING_STARTED = "training_started"
    ITERATION_TIME = "iteration_time"  # measured iteration time departs from the estimate
    REPLAN = "replan"  # a replan's decision, with its trigger
    RECONFIGURED = "reconfigured"  # a switch's first step
    CAPACITY_CHANGE = "capacity_change"  # the first provisioning met a stockout
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # an invalid checkpoint quarantined at resume
    CLUSTER = "cluster"  # where the run's VMs and state live
    WHAT_IF = "what_if"  # the job replayed over a trace before renting
    DEFERRED = "deferred"  # a scheduled rerun asked the live run to re-plan instead
    NOTHING_TO_DO = "nothing_to_do"  # a rerun of a job that had trained all its steps: nothing rented
    REPLAN_REQUEST = "replan_request"  # another run asks this one to re-plan
    SCRIPTED_MISSED = "scripted_missed"  # a scenario's scripted event that could not happen in this run
    COMPLETED = "completed"
    TEARDOWN = "teardown"


class DecisionKind(enum.StrEnum):
    """Kinds of the `decisions` rows: what a replan decided."""

    SWITCH = "switch"  # adopt the new plan
    STAY = "stay"  # keep the current one


@dataclass(frozen=True, kw_only=True)
class Decision:
    """A replan's decision and its reason, as the run's summary lists it."""

    kind: DecisionKind
    reason: str


class Measurement(enum.StrEnum):
    """Kinds of the `measurements` rows."""

    ITERATION_TIME = "iteration_time"  # measured against estimated, once per plan version
    CALIBRATION = "calibration"  # a device type's correction factor
    CHECKPOINT_INTERVAL = "checkpoint_interval"  # the interval chosen for a plan version, and why
    RECONFIGURATION = "reconfiguration"  # how long a switch took
    COLD_START = "cold_start"  # provisioning to the first step
    VM_START = "vm_start"  # a provider's new VMs: the provisioning request to the first step


DEFAULT_LEASE_S = 60.0  # a flow renews its lease every third of this ($SAILOR_LEASE_S overrides)
REQUEST_POLL_S = 2.0  # how often a live run looks for re-plan requests


class HistoryStore(Protocol):
    def append_history(self, table: str, records: Iterable[HistoryRecord], *,
                       provenance: Provenance | None = None) -> int: ...

    def read_history(self, table: str, *, run_id: str | None = None,
                     kind: str | None = None) -> list[HistoryRecord]: ...


def new_run_id(name: str, suffix: str | None = None) -> str:
    return f"{name}-{suffix or uuid.uuid4().hex[:8]}"


def _start_ticks(pid: int) -> int | None:
    """A live process's start time in clock ticks since boot (Linux /proc), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else int(fields[19])


def this_process() -> LeaseOwner:
    """Who renews a lease: this host, pid and start time (so a reused pid is not mistaken for it)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_ticks(os.getpid())}


def owner_alive(owner: LeaseOwner) -> bool | None:
    """Whether a lease's owning process still lives: None when that cannot be seen from here (another
    host, no /proc, an owner recorded without a start time)."""
    if owner.get("host") != socket.gethostname() or owner.get("start") is None or not os.path.isdir("/proc/self"):
        return None
    return _start_ticks(int(owner["pid"])) == owner["start"]


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="milliseconds")


class RunHistory:
    def __init__(self, store: HistoryStore, *, clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 alive: Callable[[LeaseOwner], bool | None] = owner_alive,
                 owner: Callable[[], LeaseOwner] = this_process) -> None:
        self.store = store
        self.clock = clock
        self.alive, self.owner = alive, owner
        self._last: datetime | None = None

    # -- writes ----------------------------------------------------------------------------------
    def _append(self, table: str, run_id: str, kind: str, reason: str = "", payload: JSONObject | None = None,
                at: datetime | None = None) -> None:
        from profiles_store.store import HistoryRecord

        t = at or self.clock()
        if at is None:
            # Rows are read back in time order: keep this writer's rows in the order they were written.
            if self._last is not None and t <= self._last:
                t = self._last + timedelta(microseconds=1)
            self._last = t
        # no credential of a URI reaches the store (a store URI's secret_key, say, in the run's parameters)
        rec = HistoryRecord(run_id=run_id, kind=str(kind), time=t, reason=redact_text(reason),
                            payload=redact_values(dict(payload or {})))
        self.store.append_history(table, [rec])

    def run_status(self, run_id: str, status: RunStatus, reason: str = "", payload: JSONObject | None = None) -> None:
        self._append("runs", run_id, status, reason, payload)

    def renew_lease(self, run_id: str, ttl_s: float = DEFAULT_LEASE_S) -> datetime:
        """The run's process is alive: extend its lease by `ttl_s`; returns the new expiry."""
        until = self.clock() + timedelta(seconds=ttl_s)
        self._append("runs", run_id, RunStatus.RUNNING, "lease renewed",
                     {"lease_expires_at": _iso(until), "renewal": True, "owner": self.owner()})
        return until

    def mark_crashed(self, run_id: str, reason: str) -> None:
        self._append("runs", run_id, RunStatus.CRASHED, reason, {})

    def live_run(self, name: str, *, exclude: str | None = None) -> RunRow | None:
        """The newest run of this name whose lease is current (None: none alive). With `exclude`, a run
        that started after that one does not count: of two runs started together, the first goes on."""
        runs = self.list_runs()
        mine = next((r["started_at"] for r in runs if r["run_id"] == exclude), None)
        live = [r for r in runs if r.get("name") == name and r["run_id"] != exclude
                and r.get("status") == RunStatus.RUNNING and r.get("lease_expires_at")
                and (mine is None or r["started_at"] <= mine)]
        return live[-1] if live else None

    def last_job(self, name: str, *, exclude: str | None = None) -> RunRow | None:
        """The newest run of this name that may have trained: not one that deferred to a live run or found
        nothing to do (those end with `plan_versions` 0)."""
        runs = [r for r in self.list_runs() if r.get("name") == name and r["run_id"] != exclude
                and r.get("plan_versions", 1) != 0]
        return runs[-1] if runs else None

    def request_replan(self, run_id: str, requested_by: str, reason: str) -> None:
        self.event(run_id, RunEvent.REPLAN_REQUEST, reason, {"requested_by": requested_by})

    def replan_requests(self, run_id: str) -> list[HistoryRecord]:
        return list(self.store.read_history("events", run_id=run_id, kind=RunEvent.REPLAN_REQUEST))

    def event(self, run_id: str, kind: RunEvent | EventKind, reason: str = "", payload: JSONObject | None = None,
              at: datetime | None = None) -> None:
        self._append("events", run_id, kind, reason, payload, at)

    def decision(self, run_id: str, kind: DecisionKind, reason: str, payload: JSONObject | None = None) -> None:
        self._append("decisions", run_id, kind, reason, payload)

    def plan(self, run_id: str, version: int, plan: JSONObject, estimate: JSONObject, reason: str) -> None:
        self._append("plans", run_id, "plan", reason, {"version": version, "plan": plan, "estimate": estimate})

    def measurement(self, run_id: str, kind: Measurement, payload: JSONObject, reason: str = "") -> None:
        self._append("measurements", run_id, kind, reason, payload)

    # -- reads -----------------------------------------------------------------------------------
    def calibration(self, gpu_types: list[str] | None = None) -> dict[str, float]:
        """Newest correction factor (measured / estimated iteration time) per GPU type, over all runs."""
        out: dict[str, tuple[datetime, float]] = {}
        for r in self.store.read_history("measurements", kind=Measurement.CALIBRATION):
            g = str(r.payload.get("gpu_type", ""))
            if gpu_types is not None and g not in gpu_types:
                continue
            if g not in out or r.time >= out[g][0]:
                out[g] = (r.time, float(r.payload["factor"]))
        return {g: f for g, (_, f) in out.items()}

    def list_runs(self) -> list[RunRow]:
        rows = self.store.read_history("runs")
        runs: dict[str, RunRow] = {}
        for r in sorted(rows, key=lambda r: r.time):
            cur = runs.setdefault(r.run_id, {"run_id": r.run_id, "name": "", "started_at": _iso(r.time)})
            if r.payload.get("renewal"):  # a lease renewal changes nothing but the lease (and who holds it)
                cur["lease_expires_at"] = r.payload["lease_expires_at"]
                if r.payload.get("owner"):
                    cur["owner"] = r.payload["owner"]
                continue
            if r.kind == RunStatus.RUNNING:
                cur["name"] = r.payload.get("name", "")
                cur["provider"] = r.payload.get("provider", "")
                cur["model"] = r.payload.get("model", "")
                cur["flow_run_id"] = r.payload.get("flow_run_id", "")
            if "lease_expires_at" in r.payload:
                cur["lease_expires_at"] = r.payload["lease_expires_at"]
            cur["status"] = r.kind
            cur["updated_at"] = _iso(r.time)
            if r.kind in FINAL_STATUSES:
                cur["ended_at"] = _iso(r.time)
                for k in (
                    "steps_done",
                    "final_loss",
                    "tokens",
                    "usd_total",
                    "wall_s",
                    "training_s",
                    "orchestration_overhead_s",
                    "plan_versions",
                ):
                    if k in r.payload:
                        cur[k] = r.payload[k]
        now = self.clock()
        for cur in runs.values():
            lease = cur.get("lease_expires_at")
            if cur.get("status") != RunStatus.RUNNING or not lease:
                continue
            if datetime.fromisoformat(lease) < now:
                cur["status"] = RunStatus.CRASHED.value
                cur["status_reason"] = f"its flow stopped renewing its lease (expired {lease[:19]} UTC)"
                cur["crash_detected"] = True  # derived here, not yet written (mark_crashed does)
            elif cur.get("owner") and self.alive(cur["owner"]) is False:
                o = cur["owner"]
                cur["status"] = RunStatus.CRASHED.value
                cur["status_reason"] = f"its flow process (pid {o.get('pid')} on {o.get('host')}) is gone"
                cur["crash_detected"] = True
        return sorted(runs.values(), key=lambda r: r["started_at"])

    def show(self, run_id: str) -> dict[str, Any]:
        runs = [r for r in self.list_runs() if r["run_id"] == run_id]
        if not runs:
            known = [r["run_id"] for r in self.list_runs()][-5:]
            raise UnknownRunError(
                f"no run {run_id!r} in the store; to fix: pick an id from `sailor runs list` (latest: {known})"
            )
        out: dict[str, Any] = dict(runs[0])  # a run as `sailor runs show --json` prints it
        status_rows = [r for r in self.store.read_history("runs", run_id=run_id) if not r.payload.get("renewal")]
        out["status_reason"] = out.get("status_reason") or (status_rows[-1].reason if status_rows else "")
        out["params"] = next((r.payload.get("params", {}) for r in status_rows if r.kind == RunStatus.RUNNING), {})
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
        out["cluster"] = next((e["cluster"] for e in reversed(out["events"]) if e["kind"] == RunEvent.CLUSTER), None)
        return cast(dict[str, Any], redact_values(out))  # rows written before redaction show none either


class LeaseKeeper:
    """Renews a run's lease from a thread while its flow lives, and passes on re-plan requests.

    `start()` writes the first lease; the thread renews it every `ttl_s / 3` and polls the run's
    `replan_request` events; `take_request()` returns (and clears) the newest one not yet taken.
    `stop()` ends the thread (the lease then simply expires if the run is not marked final)."""

    def __init__(self, history: RunHistory, run_id: str, *, ttl_s: float = DEFAULT_LEASE_S) -> None:

        self.history, self.run_id, self.ttl_s = history, run_id, ttl_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._pending: ReplanRequest | None = None
        self._thread = threading.Thread(target=self._loop, name=f"lease-{run_id}", daemon=True)
        self.errors = 0

    def start(self) -> LeaseKeeper:
        self.history.renew_lease(self.run_id, self.ttl_s)
        self._thread.start()
        return self

    def _loop(self) -> None:
        # requests are looked for every few seconds; the lease is renewed every third of its length
        renewed = time.monotonic()
        while not self._stop.wait(min(self.ttl_s / 3, REQUEST_POLL_S)):
            try:
                if time.monotonic() - renewed >= self.ttl_s / 3:
                    self.history.renew_lease(self.run_id, self.ttl_s)
                    renewed = time.monotonic()
                for r in self.history.replan_requests(self.run_id):
                    key = f"{r.time.isoformat()}|{r.payload.get('requested_by', '')}"
                    if key not in self._seen:
                        self._seen.add(key)
                        with self._lock:
                            self._pending = {"requested_by": r.payload.get("requested_by", ""), "reason": r.reason,
                                             "time": _iso(r.time)}
            except Exception:  # noqa: BLE001 - a store hiccup: the next renewal retries; the lease has slack
                self.errors += 1

    def take_request(self) -> ReplanRequest | None:
        with self._lock:
            req, self._pending = self._pending, None
        return req

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
