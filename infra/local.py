"""The local provider: "VMs" on this machine, in the zones, device types and markets of a scenario.

Contract (the Provider protocol of infra/provider.py):
- `offerings()` reports free VMs per zone, device type and market at the current scripted price
  (a scenario file, infra/scenario.py, sets zones, capacities, prices and links and scripts
  preemptions and changes); `gpus_per_node` is the offering's devices per VM.
- Isolation (`isolation=`): `netns` makes each VM a testbed VM (infra/testbed.py: its own network
  namespace and address, cpu cgroup at its device type's quota, links shaped per zone pair); `process`
  makes it a folder and a process group, as before; `auto` takes `netns` where `testbed_support()`
  allows and otherwise says once why it falls back to `process`. Either way a VM's working folder
  lives in the run's testbed folder (infra/testbed.py `default_home()`), never under `root`.
- `provision()` reserves VMs (a VM record and a testbed VM); `bootstrap()` writes the worker
  assignment into the slot and starts the worker agent there as its own process group, with
  SAILOR_ASSIGNMENT_FILE, SAILOR_HEARTBEAT_FILE and SAILOR_SLOT_DIR in its environment.
- `events(run_id)` advances the scenario (triggers by the run's highest reported step or by seconds
  since its first VM) and detects lost workers. A scripted preemption sends the agent a notice
  (SIGUSR1 by default: the runtime checkpoints just in time), waits its grace period, then the VM goes
  away with everything running in it (and its namespace); its offering's capacity shrinks by one
  until a `capacity_change` returns it. A worker is then reported LOST by the same check that finds
  a real one: its process exited without finishing (exit status not 0), or it is alive but its
  heartbeat has not moved for `heartbeat_timeout_s`.
- `terminate()` stops the agents (SIGTERM, then SIGKILL after `stop_grace_s`) and removes the VMs
  (namespace, veth, cgroup); `cleanup(run_id)` does that for everything a run left and tears down its
  testbed (bridge, folders), also from another process, because all state lives as JSON files under
  `root` (one record per VM, one event log per run) and the testbed's own record. Idempotent.
- `host_address(run_id)` is where the run's VMs reach this machine (the bridge address; 127.0.0.1 in
  process isolation): the controller and the object store bind it. `cluster_info(run_id)` describes
  the cluster (isolation, zones, regions, device types, per VM its devices and address).

Side effects come in through the constructor: the state folder, the scenario, the clock and the
command that starts an agent (default: the runtime's `sailor worker --assignment FILE`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from infra.bootstrap import AGENT_SCRIPT, assignment_json
from infra.provider import (
    EventKind,
    ProviderEvent,
    Vm,
    VmRequest,
    WorkerAssignment,
)
from infra.scenario import Scenario, ScenarioEvent, default_scenario
from infra.testbed import Testbed, TestbedVm, cleanup_stale, leftovers, testbed_support
from sailor_core.domain import Capacity, GpuType, Market, capacity_key
from sailor_core.errors import CapacityError, ProviderError, TestbedError
from sailor_core.files import private_dir, write_atomic

AgentCommand = Callable[[Vm, WorkerAssignment, Path], list[str]]
LIVE_STATES = ("running", "preempting")
ISOLATIONS = ("auto", "netns", "process")
_log = logging.getLogger(__name__)
_FALLBACK_SAID: list[str] = []  # the fallback to process isolation is said once per process


def resolve_isolation(isolation: str, *, support: Callable[[], tuple[bool, str]] = testbed_support,
                      notify: Callable[[str], None] = _log.warning) -> str:
    """`netns` or `process` for `auto`/`netns`/`process`; `auto` falls back (and says why, once) without root."""
    if isolation not in ISOLATIONS:
        raise ProviderError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}; to fix: use one")
    if isolation == "process":
        return "process"
    ok, why = support()
    if ok:
        return "netns"
    if isolation == "netns":
        raise ProviderError(f"the testbed (isolation netns) cannot run here: {why}; to fix: run as root with "
                            f"iproute2 and the cgroup v1 cpu controller, or use isolation auto/process")
    if not _FALLBACK_SAID:
        _FALLBACK_SAID.append(why)
        notify(f"local provider: VMs run as plain processes (isolation process), not isolated testbed VMs: {why}")
    return "process"


def default_agent_command(vm: Vm, assignment: WorkerAssignment, slot: Path) -> list[str]:
    """The VM bootstrap every provider runs (infra/bootstrap.py AGENT_SCRIPT, written into the VM's
    folder): install the run's wheel, then `sailor worker` with one worker per device."""
    return ["bash", str(slot / "sailor-agent.sh")]


def prepare_vm_folder(folder: Path, vm: Vm, assignment: WorkerAssignment) -> dict[str, str]:
    """Put on a VM's own disk what a cloud VM gets from SSM or its instance metadata (the assignment)
    and its startup script (the bootstrap, infra/bootstrap.py); return the environment the bootstrap
    runs with. On this machine the VM's Python is this one and its image's packages are this venv's."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    # the assignment holds the run's secret (who has it may stop the run): 0600 from its first byte
    write_atomic("assignment", folder / "assignment.json", assignment_json(assignment, vm.vm_id).encode(),
                 error=ProviderError, mode=0o600)
    write_atomic("agent script", folder / "sailor-agent.sh", AGENT_SCRIPT.encode(), error=ProviderError, mode=0o700)
    return {**assignment.env, "SAILOR_ASSIGNMENT_FILE": str(folder / "assignment.json"), "SAILOR_VM_ID": vm.vm_id,
            "SAILOR_HOME": str(folder / "sailor"), "SAILOR_PYTHON": sys.executable, "SAILOR_DEPS_SITE": _deps_site(),
            "OMP_NUM_THREADS": assignment.env.get("OMP_NUM_THREADS", "1")}


def _deps_site() -> str:
    """This interpreter's site-packages: the testbed VMs' stand-in for an image with the dependencies."""

    return sysconfig.get_paths()["purelib"]


def _rec_key(rec: dict[str, Any]) -> str:
    return capacity_key(rec.get("zone", "local"), rec["gpu_type"], rec["market"])


def _instance_type(o: Capacity) -> str:
    return f"local-{o.gpus_per_vm}x{o.gpu_type}"


def _scripted(ev: ScenarioEvent) -> str:
    """A scripted event as the scenario file states it, e.g. `preemption (spot) scripted at step 20`."""
    about = " ".join(x for x in (ev.market.value if ev.market else "", ev.zone or "", ev.gpu_type or "") if x)
    when = f"at step {ev.at_step}" if ev.at_step is not None else f"at {ev.at_s:g}s"
    return f"the scenario's {ev.kind.replace('_', ' ')}{f' ({about})' if about else ''} scripted {when}"


def _now_dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _write_json(path: Path, obj: Any) -> None:
    write_atomic("provider record", path, json.dumps(obj, indent=1, default=str).encode(), error=ProviderError,
                 mode=0o600)


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
        isolation: str = "process",
        testbed_network: str | None = None,
        support: Callable[[], tuple[bool, str]] = testbed_support,
        notify: Callable[[str], None] = _log.warning,
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
        self._testbeds: dict[str, Testbed] = {}
        self._isolation_asked = isolation
        self._isolation: str | None = None  # resolved on first use: `auto` checks the machine
        self._support = support
        self._notify = notify
        self.testbed_network = testbed_network
        # its records say which process groups a cleanup kills: this user's own folder, 0700 (files.private_dir)
        private_dir(self.root, what="local provider folder", error=ProviderError)
        for d in ("vms", "events"):
            (self.root / d).mkdir(mode=0o700, exist_ok=True)
        if not self._state_path.exists():
            # Capacity counts VMs per offering (zone/device type/market); prices are per device and hour.
            _write_json(self._state_path, {
                "prices": {o.key: o.usd_per_gpu_hour for o in self.scenario.offerings},
                "capacity": {o.key: o.vms for o in self.scenario.offerings},
                "fired": {},
                "run_started": {},
                "testbeds": {},
            })

    @property
    def isolation(self) -> str:
        """`netns` (testbed VMs) or `process` (plain processes): what this provider's new VMs get."""
        if self._isolation is None:
            self._isolation = resolve_isolation(self._isolation_asked, support=self._support, notify=self._notify)
        return self._isolation

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
            vm_id=rec["vm_id"], run_id=rec["run_id"], name=rec["name"], zone=rec.get("zone", "local"),
            gpu_type=rec["gpu_type"], gpus=rec["gpus"], market=Market(rec["market"]),
            address=rec.get("address") or "127.0.0.1", state=rec["state"], usd_per_hour=rec["usd_per_hour"],
        )

    def slot_dir(self, vm_id: str) -> Path:
        """The VM's working folder (in its testbed's folder, not under `root`)."""
        rec = self._record(vm_id)
        if rec is not None and rec.get("slot"):
            return Path(rec["slot"])
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
    ) -> list[Capacity]:
        wanted_markets = None if markets is None else {Market.parse(m) for m in markets}
        with self._lock:
            st = self._state()
            used = self._used_vms()
        now = _now_dt(self.clock())
        out = []
        for o in self.scenario.offerings:
            if regions is not None and o.region not in regions:
                continue
            if gpu_types is not None and o.gpu_type not in gpu_types:
                continue
            if wanted_markets is not None and o.market not in wanted_markets:
                continue
            free_vms = max(0, int(st["capacity"].get(o.key, 0)) - used.get(o.key, 0))
            out.append(replace(
                o, gpus=free_vms * o.gpus_per_vm, usd_per_gpu_hour=float(st["prices"].get(o.key, o.usd_per_gpu_hour)),
                instance_type=_instance_type(o), price_fetched_at=now,
            ))
        return out

    def _used_vms(self) -> dict[str, int]:
        # A VM under a preemption notice no longer counts: its capacity left with the notice.
        used: dict[str, int] = {}
        for rec in self._records():
            if rec["state"] == "running":
                key = _rec_key(rec)
                used[key] = used.get(key, 0) + 1
        return used

    def _offering_for(self, r: VmRequest) -> tuple[Capacity | None, str]:
        key = capacity_key(r.zone, r.gpu_type, r.market)
        try:
            o = self.scenario.offering(key)
        except KeyError:
            offered = ", ".join(f"{x.gpu_type} in {x.zone} ({x.market.value})" for x in self.scenario.offerings)
            return None, f"{r.name}: {r.gpu_type} in zone {r.zone} on {r.market.value} is not offered here ({offered})"
        if not 1 <= r.gpus <= o.gpus_per_vm:
            return None, (f"{r.name}: {o.gpu_type} VMs in {o.zone} have {o.gpus_per_vm} device(s), "
                          f"{r.gpus} requested")
        return o, ""

    def provision(self, requests: Sequence[VmRequest], *, dry_run: bool = False) -> list[Vm]:
        problems = []
        chosen: list[Capacity] = []
        for r in requests:
            o, why = self._offering_for(r)
            if o is None:
                problems.append(why)
            else:
                chosen.append(o)
        if problems:
            raise ProviderError("local provider cannot provision: " + "; ".join(problems)
                                + "; to fix: plan with the zones, device types and VM sizes of the offerings")
        with self._lock:
            st = self._state()
            used = self._used_vms()
            want: dict[str, int] = {}
            for o in chosen:
                want[o.key] = want.get(o.key, 0) + 1
            for key, n in want.items():
                free = int(st["capacity"].get(key, 0)) - used.get(key, 0)
                if n > free:
                    o = self.scenario.offering(key)
                    raise CapacityError(
                        f"local provider has {max(free, 0)} free {o.market.value} {o.gpu_type} VMs in {o.zone}, "
                        f"{n} requested; to fix: ask for fewer VMs or raise that offering's count in the scenario"
                    )
            now = self.clock()
            out = []
            for r, o in zip(requests, chosen, strict=True):
                rec: dict[str, Any] = {
                    "vm_id": f"local-{uuid.uuid4().hex[:10]}", "run_id": r.run_id, "name": r.name, "zone": o.zone,
                    "region": o.region, "gpu_type": o.gpu_type, "gpus": o.gpus_per_vm, "market": o.market.value,
                    "usd_per_hour": float(st["prices"].get(o.key, o.usd_per_gpu_hour)) * o.gpus_per_vm,
                    "state": "planned" if dry_run else "running", "created_at": now,
                    "seq": len(self._records(r.run_id)), "pid": None, "started_at": None, "ended_at": None,
                    "lost_reported": False, "reason": "", "address": "", "slot": "",
                }
                if not dry_run:
                    self._save(rec)  # the record first: a cleanup finds the VM even if what follows fails
                    tvm = self._create_vm(r.run_id, str(rec["vm_id"]), o)
                    rec.update(address=tvm.address, slot=tvm.folder, isolation=self._testbed(r.run_id).isolation)
                    self._save(rec)
                    if r.run_id not in st["run_started"]:
                        st["run_started"][r.run_id] = now
                out.append(self._vm(rec))
            if not dry_run:
                st = {**self._state(), "run_started": st["run_started"]}
                _write_json(self._state_path, st)
            return out

    # -- the testbed -------------------------------------------------------------------------
    def _testbed(self, run_id: str) -> Testbed:
        """The run's testbed, built on first use (all zones of the scenario, its links)."""
        with self._lock:
            tb = self._testbeds.get(run_id)
            if tb is not None:
                return tb
            st = self._state()
            folder = st.get("testbeds", {}).get(run_id, {}).get("folder")
            tb = Testbed.open(folder) if folder else None
            if tb is None:  # a TestbedError is a ProviderError: it leaves as it is
                tb = Testbed.create(run_id=run_id, zones=[z for z, _ in self.scenario.zones],
                                    link_gbps=self.scenario.link_gbps, isolation=self.isolation,
                                    network=self.testbed_network)
                st = self._state()
                # Kept after teardown: cluster_info still describes the run, leftovers still finds its names.
                st.setdefault("testbeds", {})[run_id] = {"folder": str(tb.folder), "tag": tb.tag,
                                                         "isolation": tb.isolation, "subnet": tb.subnet,
                                                         "host_address": tb.host_address}
                _write_json(self._state_path, st)
            self._testbeds[run_id] = tb
            return tb

    def _create_vm(self, run_id: str, vm_id: str, o: Capacity) -> TestbedVm:
        cpu = self.scenario.device_type(o.gpu_type).cpu_per_device
        return self._testbed(run_id).add_vm(vm_id, zone=o.zone, devices=o.gpus_per_vm,
                                            cpu_cores=None if cpu is None else cpu * o.gpus_per_vm)

    def device_types(self) -> list[GpuType]:
        """The scenario's device types as GPU types (memory per device, the largest VM offered), for the
        store (`store.write(GPU_TYPES, ...)`) and the planner."""
        out = []
        for d in self.scenario.device_types:
            sizes = [o.gpus_per_vm for o in self.scenario.offerings if o.gpu_type == d.name]
            out.append(
                GpuType(name=d.name, memory_bytes=int(d.memory_gib * 2**30), gpus_per_node=max(sizes, default=1))
            )
        return out

    def host_address(self, run_id: str) -> str:
        """Where the run's VMs reach this machine (bridge address, or 127.0.0.1): bind the controller there."""
        return self._testbed(run_id).host_address

    def cluster_info(self, run_id: str) -> dict[str, Any]:
        """The run's cluster for `sailor runs show --json`: isolation, what is offered, per VM its devices."""
        st = self._state()
        info = st.get("testbeds", {}).get(run_id)
        tb = self._testbeds.get(run_id) or (Testbed.open(info["folder"]) if info else None)
        offered = self.scenario.offerings
        isolation = tb.isolation if tb else (info or {}).get("isolation", self.isolation)
        return {
            "isolation": isolation,
            # Only isolated VMs have shaped links and cpu quotas; plain processes share this machine freely.
            "links_shaped": isolation == "netns",
            "regions": list(self.scenario.regions),
            "zones": [{"zone": z, "region": r} for z, r in self.scenario.zones],
            "device_types": [
                {"name": d.name, "cpu_per_device": d.cpu_per_device, "memory_gib": d.memory_gib,
                 "devices_per_vm": sorted({o.gpus_per_vm for o in offered if o.gpu_type == d.name})}
                for d in self.scenario.device_types],
            "host_address": tb.host_address if tb else (info or {}).get("host_address", ""),
            "subnet": tb.subnet if tb else (info or {}).get("subnet", ""),
            "links_gbps": {f"{a}>{b}": self.scenario.link_gbps(a, b)
                           for a, _ in self.scenario.zones for b, _ in self.scenario.zones},
            "vms": [{"vm_id": r["vm_id"], "name": r["name"], "zone": r.get("zone"), "region": r.get("region"),
                     "device_type": r["gpu_type"], "devices": r["gpus"], "market": r["market"],
                     "address": r.get("address") or "127.0.0.1", "state": r["state"]}
                    for r in self._records(run_id) if r["state"] != "planned"],
        }

    def leftovers(self, run_id: str) -> list[str]:
        """What of the run's testbed still exists on this machine (namespaces, links, cgroups, folder)."""
        info = self._state().get("testbeds", {}).get(run_id)
        return leftovers(info["tag"], Path(info["folder"])) if info else []

    def spawn(self, vm_id: str, argv: Sequence[str], *, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start `argv` on the VM (inside its namespace and cgroup, or as a plain process group) with its
        folder as working directory, stdout and stderr appended to `log`."""
        rec = self._record(vm_id)
        if rec is None:
            raise ProviderError(f"unknown VM {vm_id}; to fix: provision it first")
        tb = self._testbed(rec["run_id"])
        try:
            return tb.spawn(vm_id, argv, env=env, log=log)
        except (OSError, TestbedError) as e:
            raise ProviderError(
                f"cannot start the worker agent {argv[0]} on {vm_id}: {e}; to fix: check the install"
            ) from e

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
            hb = slot / "heartbeat.json"
            hb.unlink(missing_ok=True)
            env = {**os.environ, **self.env, **prepare_vm_folder(slot, vm, assignment),
                   "SAILOR_HEARTBEAT_FILE": str(hb), "SAILOR_SLOT_DIR": str(slot)}
            if rec.get("isolation") == "netns":
                env["GLOO_SOCKET_IFNAME"] = "eth0"  # the VM's one interface to the other VMs
            argv = self.agent_command(vm, assignment, slot)
            proc = self.spawn(vm.vm_id, argv, env=env, log=slot / f"agent-v{assignment.plan_version}.log")
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
            recs = [
                r
                for r in (self._record(v) for v in vm_ids)
                if r is not None and r["state"] not in ("terminated", "planned")
            ]
            # All agents get their SIGTERM at once and share one grace period.
            self.stop_agents([r["vm_id"] for r in recs])
            for rec in recs:
                rec = self._record(rec["vm_id"]) or rec
                self._remove_testbed_vm(rec)
                rec.update(state="terminated" if rec["state"] != "preempted" else "preempted",
                           ended_at=rec["ended_at"] or self.clock())
                self._save(rec)

    def _remove_testbed_vm(self, rec: dict[str, Any]) -> None:
        """The VM goes away: everything still running in it, its namespace, veth and cgroup."""
        info = self._state().get("testbeds", {}).get(rec["run_id"])
        tb = self._testbeds.get(rec["run_id"]) or (Testbed.open(info["folder"]) if info else None)
        if tb is not None:
            tb.remove_vm(rec["vm_id"])

    def cleanup(self, run_id: str | None = None, *, dry_run: bool = False) -> list[str]:
        removed = []
        for rec in self._records(run_id):
            # A terminated record's pid may since belong to someone else: only chase live records.
            live_proc = bool(rec["pid"]) and rec["state"] != "terminated" and _group_alive(rec["pid"])
            if rec["state"] in LIVE_STATES or live_proc:
                removed.append(rec["vm_id"])
        if dry_run:
            return removed
        if removed:
            self.terminate(removed)
        with self._lock:
            st = self._state()
            for rid, info in st.get("testbeds", {}).items():
                if run_id is not None and rid != run_id:
                    continue
                tb = self._testbeds.pop(rid, None) or Testbed.open(info["folder"])
                if tb is not None:
                    tb.teardown()
        cleanup_stale()  # and whatever a killed run of any provider left behind
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
    def scripted_steps(self, run_id: str) -> list[int]:
        """The training steps of this run's scripted events that have not fired yet."""
        with self._lock:
            fired = set(self._state()["fired"].get(run_id, []))
        return sorted({ev.at_step for ev in self.scenario.events if ev.at_step is not None and ev.index not in fired})

    def missed_events(self, run_id: str, *, last_step: int) -> list[str]:
        """Scripted events that did not happen in this run: skipped when they fired (no running VM matched
        a preemption) or never due (the run ended at `last_step`, before their step)."""
        with self._lock:
            st = self._state()
        fired = set(st["fired"].get(run_id, []))
        out = [str(x["what"]) for x in st.get("skipped", {}).get(run_id, [])]
        for ev in self.scenario.events:
            if ev.index in fired or ev.at_step is None:
                continue
            out.append(f"{_scripted(ev)} did not happen: the run ended at step {last_step}; to fix: script it at a "
                       f"step the run reaches, or train more steps")
        return out

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
        due = [ev for ev in self.scenario.events
               if ev.index not in fired and ev.due(step=step, elapsed_s=now - started)]
        # Events at different steps are different changes, each to be seen on its own: a run that trains
        # faster than the flow polls gets the earliest step's events now and the next step's at the next
        # poll, instead of all of them folded into one change.
        first_step = min((ev.at_step for ev in due if ev.at_step is not None), default=None)
        for ev in due:
            if ev.at_step is not None and ev.at_step != first_step:
                continue
            fired.add(ev.index)
            changed = True
            trigger = {"at_step": ev.at_step} if ev.at_step is not None else {"at_s": ev.at_s}
            detail: dict[str, object] = {"scripted": True, "run_step": step, **trigger}
            if ev.kind == "price_change":
                assert ev.usd_per_gpu_hour is not None
                for o in [o for o in self.scenario.offerings if ev.matches(o)]:  # one event per offering
                    old = float(st["prices"].get(o.key, o.usd_per_gpu_hour))
                    st["prices"][o.key] = ev.usd_per_gpu_hour
                    self._record_event(run_id, ProviderEvent(
                        kind=EventKind.PRICE_CHANGE, at=_now_dt(now), zone=o.zone, gpu_type=o.gpu_type,
                        market=o.market, detail={**detail, "old_usd_per_gpu_hour": old,
                                                 "new_usd_per_gpu_hour": ev.usd_per_gpu_hour}))
            elif ev.kind == "capacity_change":
                assert ev.vms is not None
                o = next(o for o in self.scenario.offerings if ev.matches(o))  # the scenario checked: exactly one
                old_count = int(st["capacity"].get(o.key, 0))
                st["capacity"][o.key] = ev.vms
                free_vms = max(0, ev.vms - self._used_vms().get(o.key, 0))
                # What is rentable now, so a replan can weigh capacity that returned (new > old) too.
                detail.update(old_count=old_count, new_count=ev.vms, returned=max(0, ev.vms - old_count),
                              free_vms=free_vms, free_gpus=free_vms * o.gpus_per_vm, gpus_per_node=o.gpus_per_vm,
                              region=o.region)
                self._record_event(run_id, ProviderEvent(
                    kind=EventKind.CAPACITY_CHANGE, at=_now_dt(now), zone=o.zone, gpu_type=o.gpu_type,
                    market=o.market, detail=detail))
            else:
                self._preempt(run_id, ev, st, now, detail)
        if changed:
            st["fired"][run_id] = sorted(fired)
            _write_json(self._state_path, st)
        # Notices whose grace period is over: the VM goes away now, with everything running in it.
        for rec in self._records(run_id):
            if rec["state"] == "preempting" and now >= rec["preempt_kill_at"]:
                if rec["pid"]:
                    self._kill_group(rec["pid"], self._procs.get(rec["vm_id"]))
                self._remove_testbed_vm(rec)
                rec.update(state="preempted", ended_at=now)
                self._save(rec)

    def _preempt(self, run_id: str, ev: ScenarioEvent, st: dict[str, Any], now: float,
                 detail: dict[str, object]) -> None:
        recs = [r for r in self._records(run_id) if r["state"] == "running"]
        if ev.vm is not None:
            target = next((r for r in self._records(run_id) if r["seq"] == ev.vm and r["state"] == "running"), None)
        else:
            cands = [r for r in recs if (ev.market is None or r["market"] == ev.market.value)
                     and (ev.zone is None or r.get("zone") == ev.zone)
                     and (ev.gpu_type is None or r["gpu_type"] == ev.gpu_type)]
            target = cands[-1] if cands else None
        if target is None:
            detail["skipped"] = "no running VM matched"
            what = (f"{_scripted(ev)} did not happen: no running VM of the run matched it at step "
                    f"{detail['run_step']}; to fix: match a market, zone or device type the run's plan uses")
            st.setdefault("skipped", {}).setdefault(run_id, []).append({"index": ev.index, "what": what})
            return
        # A spot VM taken back is capacity its offering no longer has (until a capacity_change returns it).
        key = _rec_key(target)
        st["capacity"][key] = max(0, int(st["capacity"].get(key, 0)) - 1)
        target.update(state="preempting", preempt_kill_at=now + ev.grace_s, reason="preempted (scripted)")
        self._save(target)
        if target["pid"] and _pid_alive(target["pid"]):
            try:
                os.killpg(target["pid"], self.notice_signal)  # the notice: the runtime checkpoints just in time
            except ProcessLookupError:
                pass
        detail.update(grace_s=ev.grace_s, vm_seq=target["seq"])
        self._record_event(run_id, ProviderEvent(
            kind=EventKind.PREEMPTION, at=_now_dt(now), vm_id=target["vm_id"], zone=target.get("zone", ""),
            gpu_type=target["gpu_type"], market=Market(target["market"]), detail=detail))

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
                    kind=EventKind.LOST, at=_now_dt(now), vm_id=rec["vm_id"], zone=rec.get("zone", ""),
                    gpu_type=rec["gpu_type"], market=Market(rec["market"]),
                    detail={"reason": rec["reason"], "exit_code": rc}))
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
