"""The local provider: "VMs" are worker slots on this machine (GPU type `cpu`, zone `local`).

Contract (the Provider protocol of infra/provider.py):
- `offerings()` reports free slots per market at the current scripted price (a scenario file,
  infra/scenario.py, sets capacities and prices and scripts preemptions and changes).
- `provision()` reserves slots (a VM record and a slot folder); `bootstrap()` writes the worker
  assignment into the slot and starts the worker agent there as its own process group, with
  SAILOR_ASSIGNMENT_FILE, SAILOR_HEARTBEAT_FILE and SAILOR_SLOT_DIR in its environment.
- `events(run_id)` advances the scenario (triggers by the run's highest reported step or by seconds
  since its first VM) and detects lost workers. A scripted preemption sends the agent a notice
  (SIGUSR1 by default: the runtime checkpoints just in time), waits its grace period and kills it; a worker is then reported LOST by the same check
  that finds a real one: its process exited without finishing (exit status not 0), or it is alive but
  its heartbeat file has not moved for `heartbeat_timeout_s`.
- `terminate()` stops the agents (SIGTERM, then SIGKILL after `stop_grace_s`) and frees the slots;
  `cleanup(run_id)` does that for everything a run left, also from another process, because all state
  lives as JSON files under `root` (one record per VM, one event log per run). Idempotent.

Side effects come in through the constructor: the state folder, the scenario, the clock and the
command that starts an agent (default: the runtime's `sailor worker --assignment FILE`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from infra.provider import (
    CapacityError,
    EventKind,
    Offering,
    ProviderError,
    ProviderEvent,
    Vm,
    VmRequest,
    WorkerAssignment,
)
from infra.scenario import CLOUD, GPU_TYPE, REGION, ZONE, Scenario, ScenarioEvent, default_scenario
from sailor_core.domain import Market

AgentCommand = Callable[[Vm, WorkerAssignment, Path], list[str]]
LIVE_STATES = ("running", "preempting")


def default_agent_command(vm: Vm, assignment: WorkerAssignment, slot: Path) -> list[str]:
    """The runtime's worker in controlled mode (sailor_core/runtime/worker_proc.py): it meets the
    orchestration's controller at the assignment's rendezvous endpoint under the VM's id."""
    return [sys.executable, "-m", "sailor_core.runtime.worker_proc", "--control", assignment.rendezvous_endpoint,
            "--worker-id", vm.vm_id]


def _now_dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) succeeds while zombies remain in the group; look for a live member.
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class LocalProvider:
    name = "local"

    def __init__(
        self,
        root: str | Path,
        *,
        scenario: Scenario | None = None,
        clock: Callable[[], float] = time.time,
        agent_command: AgentCommand = default_agent_command,
        heartbeat_timeout_s: float = 20.0,
        startup_grace_s: float = 90.0,
        stop_grace_s: float = 10.0,
        notice_signal: int = signal.SIGUSR1,
        env: dict[str, str] | None = None,
        heartbeats: Callable[[str], dict[str, Any] | None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.scenario = scenario or default_scenario()
        self.clock = clock
        self.agent_command = agent_command
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.startup_grace_s = startup_grace_s
        self.stop_grace_s = stop_grace_s
        self.notice_signal = notice_signal
        self.env = dict(env or {})
        # Where liveness comes from: by default the heartbeat file the agent beats in its slot; the
        # flow passes the runtime's heartbeats (reported to its controller) instead.
        self._heartbeats = heartbeats or self._file_heartbeat
        self._lock = threading.RLock()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        for d in ("vms", "slots", "events"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        if not self._state_path.exists():
            _write_json(self._state_path, {
                "prices": {o.market.value: o.usd_per_gpu_hour for o in self.scenario.offerings},
                "capacity": {o.market.value: o.count for o in self.scenario.offerings},
                "fired": {},
                "run_started": {},
            })

    # -- state -------------------------------------------------------------------------------
    @property
    def _state_path(self) -> Path:
        return self.root / "state.json"

    def _state(self) -> dict[str, Any]:
        return json.loads(self._state_path.read_text())

    def _records(self, run_id: str | None = None) -> list[dict[str, Any]]:
        out = []
        for p in sorted((self.root / "vms").glob("*.json")):
            try:
                rec = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if run_id is None or rec["run_id"] == run_id:
                out.append(rec)
        return sorted(out, key=lambda r: (r["created_at"], r["seq"]))

    def _record(self, vm_id: str) -> dict[str, Any] | None:
        p = self.root / "vms" / f"{vm_id}.json"
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def _save(self, rec: dict[str, Any]) -> None:
        _write_json(self.root / "vms" / f"{rec['vm_id']}.json", rec)

    @staticmethod
    def _vm(rec: dict[str, Any]) -> Vm:
        return Vm(
            vm_id=rec["vm_id"], run_id=rec["run_id"], name=rec["name"], zone=ZONE, gpu_type=rec["gpu_type"],
            gpus=rec["gpus"], market=Market(rec["market"]), address="127.0.0.1", state=rec["state"],
            usd_per_hour=rec["usd_per_hour"],
        )

    def slot_dir(self, vm_id: str) -> Path:
        return self.root / "slots" / vm_id

    def _record_event(self, run_id: str, ev: ProviderEvent) -> None:
        row = {"kind": ev.kind.value, "at": ev.at.isoformat(), "vm_id": ev.vm_id, "zone": ev.zone,
               "gpu_type": ev.gpu_type, "market": ev.market.value if ev.market else None, "detail": ev.detail}
        with open(self.root / "events" / f"{run_id}.jsonl", "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def _logged_events(self, run_id: str) -> list[ProviderEvent]:
        p = self.root / "events" / f"{run_id}.jsonl"
        if not p.exists():
            return []
        out = []
        for line in p.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(ProviderEvent(
                kind=EventKind(r["kind"]), at=datetime.fromisoformat(r["at"]), vm_id=r["vm_id"], zone=r["zone"],
                gpu_type=r["gpu_type"], market=Market(r["market"]) if r["market"] else None, detail=r["detail"],
            ))
        return out

    # -- Provider protocol -------------------------------------------------------------------
    def offerings(
        self, *, regions: Sequence[str] | None = None, gpu_types: Sequence[str] | None = None,
        markets: Sequence[Market] | None = None,
    ) -> list[Offering]:
        if regions is not None and REGION not in regions:
            return []
        if gpu_types is not None and GPU_TYPE not in gpu_types:
            return []
        with self._lock:
            st = self._state()
            used = self._used_by_market()
        now = _now_dt(self.clock())
        out = []
        for market_s, cap in sorted(st["capacity"].items()):
            market = Market(market_s)
            if markets is not None and market not in [Market.parse(m) for m in markets]:
                continue
            free = max(0, int(cap) - used.get(market_s, 0))
            out.append(Offering(
                cloud=CLOUD, region=REGION, zone=ZONE, gpu_type=GPU_TYPE, market=market, count=free,
                gpus_per_node=1, usd_per_gpu_hour=float(st["prices"][market_s]), instance_type="local-slot",
                price_fetched_at=now,
            ))
        return out

    def _used_by_market(self) -> dict[str, int]:
        # A VM under a preemption notice no longer counts: its slot left the capacity with the notice.
        used: dict[str, int] = {}
        for rec in self._records():
            if rec["state"] == "running":
                used[rec["market"]] = used.get(rec["market"], 0) + rec["gpus"]
        return used

    def provision(self, requests: Sequence[VmRequest], *, dry_run: bool = False) -> list[Vm]:
        problems = []
        for r in requests:
            if r.zone != ZONE:
                problems.append(f"{r.name}: zone {r.zone!r} is not offered here (only {ZONE!r})")
            if r.gpu_type != GPU_TYPE:
                problems.append(f"{r.name}: GPU type {r.gpu_type!r} is not offered here (only {GPU_TYPE!r})")
            if r.gpus < 1:
                problems.append(f"{r.name}: gpus must be >= 1, got {r.gpus}")
        if problems:
            raise ProviderError("local provider cannot provision: " + "; ".join(problems)
                                + "; to fix: plan for GPU type cpu in zone local")
        with self._lock:
            st = self._state()
            used = self._used_by_market()
            want: dict[str, int] = {}
            for r in requests:
                want[r.market.value] = want.get(r.market.value, 0) + r.gpus
            for m, n in want.items():
                free = int(st["capacity"].get(m, 0)) - used.get(m, 0)
                if n > free:
                    raise CapacityError(
                        f"local provider has {max(free, 0)} free {m} cpu slots, {n} requested; "
                        f"to fix: ask for fewer workers or raise that market's count in the scenario"
                    )
            now = self.clock()
            out = []
            for r in requests:
                price = float(st["prices"][r.market.value]) * r.gpus
                rec = {
                    "vm_id": f"local-{uuid.uuid4().hex[:10]}", "run_id": r.run_id, "name": r.name,
                    "gpu_type": r.gpu_type, "gpus": r.gpus, "market": r.market.value, "usd_per_hour": price,
                    "state": "planned" if dry_run else "running", "created_at": now, "seq": len(self._records(r.run_id)),
                    "pid": None, "started_at": None, "ended_at": None, "lost_reported": False, "reason": "",
                }
                if not dry_run:
                    self.slot_dir(rec["vm_id"]).mkdir(parents=True, exist_ok=True)
                    self._save(rec)
                    if r.run_id not in st["run_started"]:
                        st["run_started"][r.run_id] = now
                out.append(self._vm(rec))
            if not dry_run:
                _write_json(self._state_path, st)
            return out

    def bootstrap(self, vm: Vm, assignment: WorkerAssignment) -> None:
        with self._lock:
            rec = self._record(vm.vm_id)
            if rec is None or rec["state"] != "running":
                raise ProviderError(
                    f"cannot bootstrap {vm.vm_id}: it is {rec['state'] if rec else 'unknown'}; "
                    f"to fix: provision a new VM"
                )
            if rec["pid"] and _pid_alive(rec["pid"]):
                self._stop_group(rec["pid"], self._procs.pop(vm.vm_id, None))
            slot = self.slot_dir(vm.vm_id)
            _write_json(slot / "assignment.json", dataclasses.asdict(assignment))
            hb = slot / "heartbeat.json"
            hb.unlink(missing_ok=True)
            env = {**os.environ, **self.env, **assignment.env, "SAILOR_ASSIGNMENT_FILE": str(slot / "assignment.json"),
                   "SAILOR_HEARTBEAT_FILE": str(hb), "SAILOR_SLOT_DIR": str(slot), "SAILOR_VM_ID": vm.vm_id,
                   "OMP_NUM_THREADS": assignment.env.get("OMP_NUM_THREADS", "1")}
            argv = self.agent_command(vm, assignment, slot)
            log = open(slot / f"agent-v{assignment.plan_version}.log", "ab")
            try:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(slot),
                                        start_new_session=True)
            except OSError as e:
                raise ProviderError(f"cannot start the worker agent {argv[0]}: {e}; to fix: check the install") from e
            finally:
                log.close()
            self._procs[vm.vm_id] = proc
            rec.update(pid=proc.pid, started_at=self.clock(), lost_reported=False, plan_version=assignment.plan_version,
                       exit_code=None)
            self._save(rec)

    def list_vms(self, run_id: str | None = None) -> list[Vm]:
        return [self._vm(r) for r in self._records(run_id) if r["state"] != "planned"]

    def events(self, run_id: str, *, since: datetime | None = None) -> list[ProviderEvent]:
        with self._lock:
            self._advance(run_id)
            self._detect_lost(run_id)
            evs = self._logged_events(run_id)
        return [e for e in evs if since is None or e.at > since]

    def terminate(self, vm_ids: Sequence[str]) -> None:
        with self._lock:
            recs = [r for r in (self._record(v) for v in vm_ids) if r is not None and r["state"] not in ("terminated", "planned")]
            # All agents get their SIGTERM at once and share one grace period.
            self.stop_agents([r["vm_id"] for r in recs])
            for rec in recs:
                rec = self._record(rec["vm_id"]) or rec
                rec.update(state="terminated" if rec["state"] != "preempted" else "preempted",
                           ended_at=rec["ended_at"] or self.clock())
                self._save(rec)

    def cleanup(self, run_id: str | None = None, *, dry_run: bool = False) -> list[str]:
        removed = []
        for rec in self._records(run_id):
            # A terminated record's pid may since belong to someone else: only chase live records.
            live_proc = bool(rec["pid"]) and rec["state"] != "terminated" and _group_alive(rec["pid"])
            if rec["state"] in LIVE_STATES or live_proc:
                removed.append(rec["vm_id"])
        if removed and not dry_run:
            self.terminate(removed)
        return removed

    # -- beyond the protocol -------------------------------------------------------------------
    def stop_agents(self, vm_ids: Sequence[str]) -> None:
        """Stop the agents on these VMs (SIGTERM to all at once, SIGKILL after `stop_grace_s`), keep the VMs."""
        with self._lock:
            recs = [r for r in (self._record(v) for v in vm_ids) if r is not None and r["pid"]]
            for rec in recs:
                try:
                    os.killpg(rec["pid"], signal.SIGTERM)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + self.stop_grace_s
            for rec in recs:
                proc = self._procs.get(rec["vm_id"])
                while time.monotonic() < deadline and _group_alive(rec["pid"]):
                    if proc is not None:
                        proc.poll()
                    time.sleep(0.05)
            for rec in recs:
                self._kill_group(rec["pid"], self._procs.pop(rec["vm_id"], None))
                # Stopped on purpose: not a lost worker.
                rec.update(pid=None, exit_code=None)
                self._save(rec)

    def heartbeat(self, vm_id: str) -> dict[str, Any] | None:
        """The VM's latest heartbeat: {"time": epoch seconds, "step": training step} (None: none yet)."""
        return self._heartbeats(vm_id)

    def _file_heartbeat(self, vm_id: str) -> dict[str, Any] | None:
        p = self.slot_dir(vm_id) / "heartbeat.json"
        try:
            mtime = p.stat().st_mtime
            beat = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return {**beat, "time": mtime} if isinstance(beat, dict) else {"time": mtime}

    def agent_exit_code(self, vm_id: str) -> int | None:
        """The agent's exit status once it has exited (None while it runs or if never started)."""
        proc = self._procs.get(vm_id)
        if proc is not None:
            return proc.poll()
        rec = self._record(vm_id)
        return None if rec is None else rec.get("exit_code")

    # -- scenario and liveness ---------------------------------------------------------------
    def _run_step(self, run_id: str) -> int:
        step = 0
        for rec in self._records(run_id):
            hb = self.heartbeat(rec["vm_id"])
            if hb and isinstance(hb.get("step"), int | float):
                step = max(step, int(hb["step"]))
        return step

    def _advance(self, run_id: str) -> None:
        st = self._state()
        started = st["run_started"].get(run_id)
        if started is None:
            return
        now = self.clock()
        fired = set(st["fired"].get(run_id, []))
        step = self._run_step(run_id)
        changed = False
        for ev in self.scenario.events:
            if ev.index in fired or not ev.due(step=step, elapsed_s=now - started):
                continue
            fired.add(ev.index)
            changed = True
            trigger = {"at_step": ev.at_step} if ev.at_step is not None else {"at_s": ev.at_s}
            detail: dict[str, object] = {"scripted": True, "run_step": step, **trigger}
            if ev.kind == "price_change":
                assert ev.market is not None and ev.usd_per_gpu_hour is not None
                old = float(st["prices"].get(ev.market.value, 0.0))
                st["prices"][ev.market.value] = ev.usd_per_gpu_hour
                detail.update(old_usd_per_gpu_hour=old, new_usd_per_gpu_hour=ev.usd_per_gpu_hour)
                self._record_event(run_id, ProviderEvent(
                    kind=EventKind.PRICE_CHANGE, at=_now_dt(now), zone=ZONE, gpu_type=GPU_TYPE, market=ev.market,
                    detail=detail))
            elif ev.kind == "capacity_change":
                assert ev.market is not None and ev.count is not None
                old_count = int(st["capacity"].get(ev.market.value, 0))
                st["capacity"][ev.market.value] = ev.count
                detail.update(old_count=old_count, new_count=ev.count)
                self._record_event(run_id, ProviderEvent(
                    kind=EventKind.CAPACITY_CHANGE, at=_now_dt(now), zone=ZONE, gpu_type=GPU_TYPE, market=ev.market,
                    detail=detail))
            else:
                self._preempt(run_id, ev, st, now, detail)
        if changed:
            st["fired"][run_id] = sorted(fired)
            _write_json(self._state_path, st)
        # Notices whose grace period is over: the slot goes away now.
        for rec in self._records(run_id):
            if rec["state"] == "preempting" and now >= rec["preempt_kill_at"]:
                if rec["pid"]:
                    self._kill_group(rec["pid"], self._procs.get(rec["vm_id"]))
                rec.update(state="preempted", ended_at=now)
                self._save(rec)

    def _preempt(self, run_id: str, ev: ScenarioEvent, st: dict[str, Any], now: float,
                 detail: dict[str, object]) -> None:
        recs = [r for r in self._records(run_id) if r["state"] == "running"]
        if ev.vm is not None:
            target = next((r for r in self._records(run_id) if r["seq"] == ev.vm and r["state"] == "running"), None)
        else:
            cands = [r for r in recs if ev.market is None or r["market"] == ev.market.value]
            target = cands[-1] if cands else None
        if target is None:
            detail["skipped"] = "no running VM matched"
            return
        # A spot slot taken back is capacity the market no longer has.
        st["capacity"][target["market"]] = max(0, int(st["capacity"].get(target["market"], 0)) - target["gpus"])
        target.update(state="preempting", preempt_kill_at=now + ev.grace_s, reason="preempted (scripted)")
        self._save(target)
        if target["pid"] and _pid_alive(target["pid"]):
            try:
                os.killpg(target["pid"], self.notice_signal)  # the notice: the runtime checkpoints just in time
            except ProcessLookupError:
                pass
        detail.update(grace_s=ev.grace_s, vm_seq=target["seq"])
        self._record_event(run_id, ProviderEvent(
            kind=EventKind.PREEMPTION, at=_now_dt(now), vm_id=target["vm_id"], zone=ZONE, gpu_type=GPU_TYPE,
            market=Market(target["market"]), detail=detail))

    def _detect_lost(self, run_id: str) -> None:
        now = self.clock()
        for rec in self._records(run_id):
            if rec["lost_reported"] or not rec["pid"] or rec["state"] not in (*LIVE_STATES, "preempted"):
                continue
            proc = self._procs.get(rec["vm_id"])
            rc = proc.poll() if proc is not None else None
            alive = rc is None and (_pid_alive(rec["pid"]) if proc is None else True)
            reason = ""
            if not alive:
                if rc is None:
                    rc = rec.get("exit_code")
                rec["exit_code"] = rc
                if rc != 0 or rec["state"] in ("preempting", "preempted"):
                    reason = f"worker process exited (status {rc})" if rc is not None else "worker process is gone"
            else:
                beat = self.heartbeat(rec["vm_id"])
                last = float(beat["time"]) if beat and beat.get("time") is not None else None
                if last is not None and rec["started_at"] and last < rec["started_at"]:
                    last = None  # a beat from before this agent started
                if last is None and now - (rec["started_at"] or now) > self.startup_grace_s:
                    reason = f"no heartbeat within {self.startup_grace_s:.0f}s of start"
                elif last is not None and now - last > self.heartbeat_timeout_s:
                    reason = f"no heartbeat for {now - last:.0f}s (timeout {self.heartbeat_timeout_s:.0f}s)"
            if reason:
                if rec["state"] in ("preempting", "preempted"):
                    reason = f"preempted: {reason}"
                rec.update(lost_reported=True, reason=reason)
                self._save(rec)
                self._record_event(run_id, ProviderEvent(
                    kind=EventKind.LOST, at=_now_dt(now), vm_id=rec["vm_id"], zone=ZONE, gpu_type=GPU_TYPE,
                    market=Market(rec["market"]), detail={"reason": rec["reason"], "exit_code": rc}))
            elif not alive:
                self._save(rec)

    # -- processes ---------------------------------------------------------------------------
    def _kill_group(self, pgid: int, proc: subprocess.Popen[bytes] | None) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def _stop_group(self, pgid: int, proc: subprocess.Popen[bytes] | None) -> None:
        """SIGTERM the agent's process group, wait for it, then SIGKILL whatever is left."""
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            if proc is not None:
                proc.poll()
            return
        deadline = time.monotonic() + self.stop_grace_s
        while time.monotonic() < deadline:
            if proc is not None:
                proc.poll()
            if not _group_alive(pgid):
                break
            time.sleep(0.05)
        self._kill_group(pgid, proc)
