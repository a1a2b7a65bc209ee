"""The local multi-zone testbed: isolated "VMs" on this machine, joined by shaped links.

Contract:
- `testbed_support()` says whether this process may build one (root, `ip`, `tc`, the cgroup v1 cpu
  controller) and, if not, why.
- `Testbed.create(...)` builds one run's network: a Linux bridge with the host address (the
  controller and the object store bind to it) in a private /16 of its own (10.213.0.0/16 unless
  taken or configured). `add_vm()` gives a VM a network namespace (loopback up: the VM's ranks talk
  over it like NVLink; `eth0` with the address 10.X.<zone>.<n>, zone 1.. in the order given, no
  default route, so a VM reaches only the host address and the other VMs), the host end of its
  veth on the bridge, and a cpu cgroup whose quota is `cpu_cores` (devices x cpu_per_device) with one
  child per device, `dev0`, `dev1`, ..., each of quota cpu_cores / devices: a device is a CPU share,
  and a process binds itself to device i by joining `dev<i>` (sailor_core/runtime/devices.py), as a
  worker on a GPU VM selects GPU i. A process that does not bind stays in the VM's cgroup and may use
  the whole VM's quota. The testbed's cgroups outweigh the host's other processes (cpu.shares: the
  kernel's most for `sailor-testbed`, a VM's and a device's in proportion to their cores), so a busy
  host does not slow a device below its quota: without it every VM's group weighed as one host
  process, and two devices of a VM under load got no more CPU together than one (tp = 2 never paid).
  Links are shaped on the host end of each VM's veth, i.e. on traffic INTO the VM: an htb class per
  source zone, selected by the sender's zone subnet (10.X.<zone>.0/24), at the scenario's rate for
  that zone pair; traffic from the host address (controller, object store) falls into a generous
  default class. Latency is not emulated: the kernel here has no netem.
- `command(vm, argv)` is the argv that runs `argv` inside the VM (join its cgroup, then its network
  namespace with `nsenter --net`: the host's /sys stays visible, device cgroups included);
  `spawn(vm, argv, ...)` starts it in its own process group with the VM's working folder (under the
  testbed's folder, never the flow's run folder) as cwd.
- `teardown()` removes everything (processes, namespaces, veths, bridge, cgroups, folders). It is
  idempotent and works from another process: every name lives in `<home>/<tag>/testbed.json`,
  written before the resource is created. `cleanup_stale()` tears down testbeds whose owner process
  is dead, and any resource named like ours whose record is gone; `create()` calls it first.
- The home (`default_home()`: $SAILOR_TESTBED_HOME, else <tmp>/sailor-testbed-<uid>), each testbed's
  folder and each VM's folder are 0700 and this user's: the home is created so, or refused with one
  line when another user owns it or may write to it (or to a folder above it), since its records say
  which processes a cleanup kills and its VM folders hold the scripts an agent runs and the run's
  secret (`trusted_home`). Records are written 0600 through uniquely named temporary files.
- In `process` isolation (no root, no `ip`): no namespaces, cgroups or shaping; a VM is a folder
  and its processes; addresses are 127.0.0.1. The same API, the same teardown.

Names are unique to the testbed: the tag is 6 hex digits; bridge `sb<tag>br`, veth `sb<tag>h<n>`
(<= 15 characters, the kernel's limit), namespace `sb-<tag>-<vm>`, cgroup
`/sys/fs/cgroup/cpu/sailor-testbed/<tag>/<vm>` (devices: `.../<vm>/dev<i>`).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sailor_core.errors import TestbedError as TestbedError  # re-exported for tests and bench
from sailor_core.files import private_dir, write_atomic
from sailor_core.runtime.devices import CGROUP_ROOT_ENV

_log = logging.getLogger(__name__)
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_PARENT = "sailor-testbed"
DEFAULT_NETWORK = "10.213.0.0/16"
MIN_QUOTA_US = 1000  # the kernel's smallest cpu.cfs_quota_us
MIN_PERIOD_US = 10_000
_ROUNDING_US = 1e-6  # float noise in a quota's µs (0.2 x 5000 = 1000.0000000000001) is not a µs to round
TESTBED_SHARES = 262_144  # cpu.shares of the sailor-testbed group: the kernel's maximum (a host process has 1024)
HOST_CLASS_GBPS = 20.0  # the default class: traffic from the host address (controller, object store)
NETNS_PREFIX = "sb-"
NETNS_DIR = Path("/run/netns")  # where `ip netns add` puts a namespace's handle
LINK_PREFIX = "sb"
RECORD = "testbed.json"
Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


def owners_dir() -> Path:
    """Every live testbed's owner, whatever its home: a cleanup run from another home (a test, a
    benchmark) must never take a live testbed's namespaces for orphans. One folder for the machine, as
    namespaces are: not under $TMPDIR, which a command run with a private TMPDIR (tests/test_exit_codes.py)
    sees elsewhere, and whose cleanup then SIGKILLed the VMs of every live testbed."""
    return Path("/tmp") / "sailor-testbed-owners"


def _registered_live(tag: str) -> bool:
    try:
        owner = json.loads((owners_dir() / f"{tag}.json").read_text())
    except (OSError, ValueError):
        return False
    return _owner_alive(owner)


def default_home() -> Path:
    """Where testbeds keep their records and VM folders (one place per user: stale cleanup looks here)."""
    env = os.environ.get("SAILOR_TESTBED_HOME")
    return Path(env) if env else Path(tempfile.gettempdir()) / f"sailor-testbed-{os.getuid()}"


def trusted_home(home: Path) -> Path:
    """`home` made or checked as this user's own 0700 folder (sailor_core/files.py `private_dir`): its records
    name the processes a cleanup kills and its VM folders the scripts an agent runs, as root on the testbed.
    One owned by another user (or open to others) is refused with one line, never used."""
    return private_dir(home, what="testbed home ($SAILOR_TESTBED_HOME)", error=TestbedError)


def testbed_support(*, euid: int | None = None, which: Callable[[str], str | None] = shutil.which,
                    cgroup_cpu: Path = CGROUP_CPU) -> tuple[bool, str]:
    """(True, "") when namespaces, veths, tc and the cpu cgroup can be used here; else (False, why)."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return False, f"not root (uid {euid}): network namespaces and cgroups need root"
    for tool in ("ip", "tc", "nsenter"):
        if which(tool) is None:
            return False, f"`{tool}` ({'util-linux' if tool == 'nsenter' else 'iproute2'}) is not installed"
    if not (cgroup_cpu / "cpu.cfs_quota_us").exists():
        return False, f"the cgroup v1 cpu controller is not mounted at {cgroup_cpu}"
    if not os.access(cgroup_cpu, os.W_OK):
        return False, f"{cgroup_cpu} is not writable"
    return True, ""


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:  # no such tool (a user without iproute2), or hung
        return subprocess.CompletedProcess(list(argv), 127, "", str(e))


def _pid_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process); pids are reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _owner_alive(owner: Mapping[str, Any]) -> bool:
    start = _pid_start(int(owner.get("pid", 0) or 0))
    return start is not None and start == owner.get("start")


def _rate(gbps: float) -> str:
    return f"{max(1, round(gbps * 1e6))}kbit"


def _burst_bytes(gbps: float) -> int:
    # htb refills its buckets every timer tick; a burst below rate x ~2 ms starves fast classes.
    return max(32_000, int(gbps * 1e9 / 8 * 0.002))


@dataclass(frozen=True, kw_only=True)
class TestbedVm:
    """One VM of the testbed as recorded: its names, address, zone, quota and folder."""

    __test__ = False

    key: str
    index: int
    zone: str
    address: str
    netns: str
    veth: str
    cgroup: str
    folder: str
    devices: int
    cpu_cores: float | None
    interface: str = "eth0"


class Testbed:
    """One run's testbed. Build with `create`, find again with `open`; `teardown` removes it all."""

    __test__ = False

    def __init__(self, folder: Path, record: dict[str, Any], *, runner: Runner = _run) -> None:
        self.folder = folder
        self._rec = record
        self._run = runner

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def create(
        cls, *, run_id: str, zones: Sequence[str], link_gbps: Callable[[str, str], float],
        isolation: str = "netns", network: str | None = None, home: Path | None = None,
        runner: Runner = _run,
    ) -> Testbed:
        """A new testbed for `run_id` with one subnet per zone (zones in this order: 10.X.1, 10.X.2, ...)."""
        if isolation not in ("netns", "process"):
            raise TestbedError(f"isolation must be netns or process, got {isolation!r}; to fix: use one of those")
        home = trusted_home(home or default_home())  # 0700, ours: its records say what root kills and runs
        if len(zones) > 250:
            raise TestbedError(f"{len(zones)} zones do not fit in one /16 (at most 250); to fix: use fewer zones")
        cleanup_stale(home=home, runner=runner)
        rates = {f"{a}>{b}": float(link_gbps(a, b)) for a in zones for b in zones}
        record: dict[str, Any] = {
            "tag": "", "run_id": run_id, "isolation": isolation, "zones": list(zones), "rates_gbps": rates,
            "owner": {"pid": os.getpid(), "start": _pid_start(os.getpid())}, "created_at": time.time(),
            "bridge": "", "subnet": "",
            "host_address": "127.0.0.1", "vms": {}, "procs": {},
        }
        with _lock(home):
            tag = uuid.uuid4().hex[:6]
            while (home / tag).exists() or tag in stale_testbeds(home=home, runner=runner):
                tag = uuid.uuid4().hex[:6]
            folder = home / tag
            record["tag"] = tag
            if isolation == "netns":
                record["bridge"] = f"{LINK_PREFIX}{tag}br"
                subnet = _free_subnet(network or os.environ.get("SAILOR_TESTBED_NET") or DEFAULT_NETWORK, home, runner)
                record["subnet"] = str(subnet)
                record["host_address"] = str(subnet.network_address + 1)
            folder.mkdir(mode=0o700)
            (folder / "vms").mkdir(mode=0o700)
            if isolation == "netns":  # only isolated testbeds have system-wide names to protect
                private_dir(owners_dir(), what="the testbeds' owners folder", error=TestbedError)
                _write(owners_dir() / f"{tag}.json", record["owner"])
            _write(folder / RECORD, record)
        tb = cls(folder, record, runner=runner)
        if isolation == "netns":
            try:
                tb._build_bridge()
            except BaseException:
                tb.teardown()
                raise
        return tb

    @classmethod
    def open(cls, folder: str | Path, *, runner: Runner = _run) -> Testbed | None:
        folder = Path(folder)
        try:
            rec = json.loads((folder / RECORD).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return cls(folder, rec, runner=runner)

    # -- what it is --------------------------------------------------------------------------
    @property
    def tag(self) -> str:
        return str(self._rec["tag"])

    @property
    def run_id(self) -> str:
        return str(self._rec["run_id"])

    @property
    def isolation(self) -> str:
        return str(self._rec["isolation"])

    @property
    def host_address(self) -> str:
        """The address VMs reach the host at (bridge address; 127.0.0.1 in process isolation)."""
        return str(self._rec["host_address"])

    @property
    def subnet(self) -> str:
        return str(self._rec["subnet"])

    @property
    def zones(self) -> list[str]:
        return list(self._rec["zones"])

    def rate_gbps(self, src_zone: str, dst_zone: str) -> float:
        return float(self._rec["rates_gbps"][f"{src_zone}>{dst_zone}"])

    def vms(self) -> list[TestbedVm]:
        return [TestbedVm(**v) for v in sorted(self._rec["vms"].values(), key=lambda v: v["index"])]

    def vm(self, key: str) -> TestbedVm:
        try:
            return TestbedVm(**self._rec["vms"][key])
        except KeyError:
            raise TestbedError(f"testbed {self.tag} has no VM {key!r}; to fix: add_vm it first") from None

    def describe(self) -> dict[str, Any]:
        return {"isolation": self.isolation, "tag": self.tag, "subnet": self.subnet, "host_address": self.host_address,
                "folder": str(self.folder), "links_gbps": dict(self._rec["rates_gbps"])}

    # -- VMs ---------------------------------------------------------------------------------
    def add_vm(self, key: str, *, zone: str, devices: int = 1, cpu_cores: float | None = None) -> TestbedVm:
        """Create the VM `key` in `zone`: namespace, address, veth, shaping, cgroup (netns) and its folder."""
        if zone not in self.zones:
            raise TestbedError(f"zone {zone!r} is not in this testbed ({', '.join(self.zones)}); to fix: "
                               f"create the testbed with every zone of the scenario")
        if key in self._rec["vms"]:
            return self.vm(key)
        index = 1 + max((v["index"] for v in self._rec["vms"].values()), default=-1)
        zone_no = self.zones.index(zone) + 1
        folder = self.folder / "vms" / key
        if self.isolation == "netns":
            net = ipaddress.ip_network(self.subnet)
            in_zone = sum(1 for v in self._rec["vms"].values() if v["zone"] == zone)
            if in_zone >= 253:
                raise TestbedError(f"zone {zone} has 253 VMs already; to fix: use fewer VMs per zone")
            address = str(net.network_address + zone_no * 256 + in_zone + 2)
            vm = TestbedVm(
                key=key,
                index=index,
                zone=zone,
                address=address,
                netns=f"{NETNS_PREFIX}{self.tag}-{key}",
                veth=f"{LINK_PREFIX}{self.tag}h{index}",
                cgroup=str(CGROUP_CPU / CGROUP_PARENT / self.tag / key),
                folder=str(folder),
                devices=devices,
                cpu_cores=cpu_cores,
            )
        else:
            vm = TestbedVm(key=key, index=index, zone=zone, address="127.0.0.1", netns="", veth="", cgroup="",
                           folder=str(folder), devices=devices, cpu_cores=cpu_cores)
        if len(vm.veth) > 15:
            raise TestbedError(f"veth name {vm.veth} is longer than 15 characters; to fix: fewer VMs per testbed")
        self._rec["vms"][key] = asdict(vm)
        self._save()  # the record first: a crash from here on leaves names a teardown can find
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # the VM's assignment (its run's secret) goes here
        if self.isolation == "netns":
            try:
                self._build_vm(vm, zone_no)
            except BaseException:
                self.remove_vm(key)
                raise
        return vm

    def remove_vm(self, key: str, *, keep_folder: bool = True) -> None:
        """The VM goes away: its processes, namespace, veth and cgroup (its folder stays unless asked)."""
        raw = self._rec["vms"].get(key)
        if raw is None:
            return
        vm = TestbedVm(**raw)
        self.kill_processes(key)
        if vm.veth:
            self._ip("link", "del", vm.veth, ok_missing=True)
        if vm.netns:
            self._ip("netns", "del", vm.netns, ok_missing=True)
        if vm.cgroup:
            _rmdir_cgroup(Path(vm.cgroup))
        if not keep_folder:
            shutil.rmtree(vm.folder, ignore_errors=True)
        # The VM's record stays (teardown walks it again, harmlessly); `removed` marks it gone.
        self._rec.setdefault("removed", [])
        if key not in self._rec["removed"]:
            self._rec["removed"].append(key)
        self._save()

    def command(self, key: str, argv: Sequence[str]) -> list[str]:
        """The argv that runs `argv` inside VM `key`: join its cgroup, then its network namespace."""
        vm = self.vm(key)
        if key in self._rec.get("removed", []):
            raise TestbedError(f"VM {key} of testbed {self.tag} is gone (preempted or terminated); to fix: "
                               f"provision a new VM")
        if self.isolation != "netns":
            return list(argv)
        # nsenter --net, not `ip netns exec`: that one mounts a fresh /sys, which hides the cgroup
        # folders a process joins to bind itself to one of the VM's devices.
        nsenter = shutil.which("nsenter") or "nsenter"
        return ["/bin/sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sailor-vm",
                f"{vm.cgroup}/cgroup.procs", nsenter, f"--net={NETNS_DIR / vm.netns}", *argv]

    def env(self, key: str) -> dict[str, str]:
        """What a process in the VM should see: its identity, address, interface and scratch folder."""
        vm = self.vm(key)
        out = {"SAILOR_VM_DIR": vm.folder, "SAILOR_VM_ADDRESS": vm.address, "SAILOR_VM_ZONE": vm.zone,
               "SAILOR_VM_DEVICES": str(vm.devices), "SAILOR_HOST_ADDRESS": self.host_address,
               "TMPDIR": str(Path(vm.folder) / "tmp")}
        if self.isolation == "netns":
            # gloo binds the interface's address; the VM's own ranks still meet over loopback.
            out["GLOO_SOCKET_IFNAME"] = vm.interface
            out[CGROUP_ROOT_ENV] = vm.cgroup  # where `dev<i>` lives: bind_device(i) joins it
        return out

    def spawn(self, key: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              log: Path | None = None) -> subprocess.Popen[bytes]:
        """Start `argv` inside VM `key` as its own process group, cwd its folder; the pid is recorded."""
        vm = self.vm(key)
        (Path(vm.folder) / "tmp").mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **(env or {}), **self.env(key)}
        out = open(log, "ab") if log is not None else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(self.command(key, argv), env=full_env, cwd=vm.folder, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
        self._rec["procs"].setdefault(key, []).append({"pid": proc.pid, "start": _pid_start(proc.pid)})
        self._save()
        return proc

    def kill_processes(self, key: str, *, timeout_s: float = 5.0) -> None:
        """SIGKILL every process of the VM: its namespace's, its cgroup's and the process groups it spawned."""
        raw = self._rec["vms"].get(key)
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self._vm_pids(key, raw)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for p in self._rec["procs"].get(key, []):
                if _pid_start(p["pid"]) == p["start"] and p["start"] is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p["pid"], signal.SIGKILL)
            if not pids or time.monotonic() > deadline:
                break
            time.sleep(0.02)

    def _vm_pids(self, key: str, raw: Mapping[str, Any] | None) -> set[int]:
        pids: set[int] = set()
        if raw and raw.get("netns"):
            r = self._run(["ip", "netns", "pids", raw["netns"]])
            pids |= {int(x) for x in r.stdout.split() if x.isdigit()}
        if raw and raw.get("cgroup"):
            for cg in _device_cgroups(Path(raw["cgroup"])) + [Path(raw["cgroup"])]:
                pids |= set(_cgroup_pids(cg))
        return {p for p in pids if _pid_start(p) is not None}

    # -- teardown ----------------------------------------------------------------------------
    def teardown(self) -> list[str]:
        """Remove everything this testbed made; return what was removed. Safe to call twice."""
        removed = []
        for key in list(self._rec["vms"]):
            self.kill_processes(key)
        for raw in list(self._rec["vms"].values()):
            vm = TestbedVm(**raw)
            if vm.veth and self._ip("link", "del", vm.veth, ok_missing=True):
                removed.append(f"veth {vm.veth}")
            if vm.netns and self._ip("netns", "del", vm.netns, ok_missing=True):
                removed.append(f"netns {vm.netns}")
            if vm.cgroup and _rmdir_cgroup(Path(vm.cgroup)):
                removed.append(f"cgroup {vm.cgroup}")
        if self._rec.get("bridge") and self._ip("link", "del", self._rec["bridge"], ok_missing=True):
            removed.append(f"bridge {self._rec['bridge']}")
        tag_cg = CGROUP_CPU / CGROUP_PARENT / self.tag
        if self.isolation == "netns" and _rmdir_cgroup(tag_cg):
            removed.append(f"cgroup {tag_cg}")
        with contextlib.suppress(OSError):
            (CGROUP_CPU / CGROUP_PARENT).rmdir()  # only when no other testbed uses it
        if self.folder.exists():
            # The record goes last: if anything above failed half-way, a later teardown still finds it.
            with contextlib.suppress(FileNotFoundError):  # another process's teardown may race this one
                for child in self.folder.iterdir():
                    if child.name != RECORD:
                        shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
            (self.folder / RECORD).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.folder.rmdir()
            removed.append(f"folder {self.folder}")
        with contextlib.suppress(OSError):
            (owners_dir() / f"{self.tag}.json").unlink(missing_ok=True)
        return removed

    # -- building ----------------------------------------------------------------------------
    def _build_bridge(self) -> None:
        br = self._rec["bridge"]
        prefix = ipaddress.ip_network(self.subnet).prefixlen
        self._ip("link", "add", br, "type", "bridge")
        _no_ipv6(br)
        self._ip("addr", "add", f"{self.host_address}/{prefix}", "dev", br)
        self._ip("link", "set", br, "up")

    def _build_vm(self, vm: TestbedVm, zone_no: int) -> None:
        tmp_peer = f"{LINK_PREFIX}{self.tag}p{vm.index}"
        prefix = ipaddress.ip_network(self.subnet).prefixlen
        self._ip("netns", "add", vm.netns)
        # IPv4 only: gloo takes the first address of GLOO_SOCKET_IFNAME, which must not be a link-local v6 one.
        self._ip("netns", "exec", vm.netns, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                 "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6")
        self._ip("link", "add", vm.veth, "type", "veth", "peer", "name", tmp_peer)
        _no_ipv6(vm.veth)
        self._ip("link", "set", tmp_peer, "netns", vm.netns)
        self._ip("-n", vm.netns, "link", "set", tmp_peer, "name", vm.interface)
        self._ip("-n", vm.netns, "addr", "add", f"{vm.address}/{prefix}", "dev", vm.interface)
        self._ip("-n", vm.netns, "link", "set", "lo", "up")
        self._ip("-n", vm.netns, "link", "set", vm.interface, "up")
        self._ip("link", "set", vm.veth, "master", self._rec["bridge"])
        self._ip("link", "set", vm.veth, "up")
        self._shape(vm)
        cg = Path(vm.cgroup)
        cg.mkdir(parents=True, exist_ok=True)
        (CGROUP_CPU / CGROUP_PARENT / "cpu.shares").write_text(str(TESTBED_SHARES))
        set_cpu_share(cg, vm.cpu_cores)  # the VM's limit: every device's share together
        for i in range(vm.devices):  # removed by _rmdir_cgroup, children first
            (cg / f"dev{i}").mkdir(exist_ok=True)
            set_cpu_share(cg / f"dev{i}", None if vm.cpu_cores is None else vm.cpu_cores / vm.devices, child=True)

    def _shape(self, vm: TestbedVm) -> None:
        """htb on the host end of the VM's veth (traffic into the VM): one class per source zone."""
        dev = vm.veth
        net = ipaddress.ip_network(self.subnet)
        self._tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
        self._htb_class(dev, "1:1", HOST_CLASS_GBPS)
        for n, src in enumerate(self.zones, start=1):
            gbps = self.rate_gbps(src, vm.zone)
            cls = f"1:{n + 10:x}"
            self._htb_class(dev, cls, gbps)
            src_net = ipaddress.ip_network(f"{net.network_address + n * 256}/24")
            self._tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                     "match", "ip", "src", str(src_net), "flowid", cls)

    def _htb_class(self, dev: str, classid: str, gbps: float) -> None:
        # cburst as well as burst: a packet leaves only when both buckets allow, and the default
        # ceil bucket is too small at Gbit/s rates (measured ~10% short of the rate without it).
        burst = str(_burst_bytes(gbps))
        self._tc("class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb", "rate", _rate(gbps),
                 "burst", burst, "cburst", burst, "quantum", "60000")

    def _ip(self, *args: str, ok_missing: bool = False) -> bool:
        return self._tool("ip", args, ok_missing)

    def _tc(self, *args: str) -> bool:
        return self._tool("tc", args, False)

    def _tool(self, tool: str, args: Sequence[str], ok_missing: bool) -> bool:
        r = self._run([tool, *args])
        if r.returncode == 0:
            return True
        err = (r.stderr or r.stdout).strip()
        if ok_missing and any(s in err for s in ("Cannot find device", "No such file", "does not exist",
                                                 "Invalid argument", "Cannot open network namespace")):
            return False
        raise TestbedError(f"`{tool} {' '.join(args)}` failed: {err}; to fix: run as root with iproute2 "
                           f"installed, or use isolation=process")

    def _save(self) -> None:
        if self.folder.exists():
            _write(self.folder / RECORD, self._rec)


_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); s.settimeout(60)
print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += len(d)
print(n, n / (time.perf_counter() - t0), flush=True)
"""
_SENDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
s.sendall(b"x" * int(sys.argv[3])); s.close()
"""


def stream_bytes_per_s(tb: Testbed, src: str, dst: str, nbytes: int, *, port: int = 5301,
                       python: str = sys.executable) -> float:
    """One TCP stream of `nbytes` from VM `src` to VM `dst` (the shaped direction: into `dst`), in bytes
    per second as the receiver saw it from its first byte to its last."""
    log = tb.folder / f"stream-{src}-{dst}-{port}.log"
    log.unlink(missing_ok=True)
    recv = tb.spawn(dst, [python, "-c", _RECEIVER, str(port)], log=log)
    try:
        deadline = time.monotonic() + 30
        while "ready" not in (log.read_text() if log.exists() else ""):
            if time.monotonic() > deadline or recv.poll() is not None:
                raise TestbedError(f"the receiver in {dst} did not start: {log.read_text() if log.exists() else ''}")
            time.sleep(0.02)
        send = subprocess.run(tb.command(src, [python, "-c", _SENDER, tb.vm(dst).address, str(port), str(nbytes)]),
                              capture_output=True, text=True, timeout=120, cwd=tb.vm(src).folder,
                              env={**os.environ, **tb.env(src)})
        if send.returncode != 0:
            raise TestbedError(f"sending from {src} to {dst} failed: {send.stderr.strip()[-300:]}")
        recv.wait(timeout=60)
    finally:
        if recv.poll() is None:
            recv.kill()
        recv.wait()
    got, rate = log.read_text().split()[-2:]
    if int(got) != nbytes:
        raise TestbedError(f"{dst} received {got} of {nbytes} bytes from {src}")
    return float(rate)


def stale_testbeds(*, home: Path | None = None, runner: Runner = _run) -> list[str]:
    """The tags `cleanup_stale` would remove: testbeds of a dead owner, and our names without a record."""
    home = home or default_home()
    if home.is_dir():
        trusted_home(home)  # its records are read and acted on
    parent = CGROUP_CPU / CGROUP_PARENT
    tags = {n[len(LINK_PREFIX):len(LINK_PREFIX) + 6] for n in _our_links(runner)}
    tags |= {n[len(NETNS_PREFIX):len(NETNS_PREFIX) + 6] for n in _our_namespaces(runner)}
    tags |= {p.name for p in parent.iterdir() if p.is_dir() and _is_hex(p.name)} if parent.is_dir() else set()
    live: set[str] = set()
    for folder in sorted(home.iterdir()) if home.is_dir() else []:
        tb = Testbed.open(folder, runner=runner)
        if tb is not None:
            (live if _owner_alive(tb._rec.get("owner", {})) else tags).add(tb.tag)
    live |= {t for t in tags if _registered_live(t)}
    return sorted(tags - live)


def cleanup_stale(*, home: Path | None = None, runner: Runner = _run) -> list[str]:
    """Tear down testbeds whose owner process is dead, and resources named like ours that have no record."""
    home = home or default_home()
    if home.is_dir():
        trusted_home(home)  # its records name processes to kill: never another user's
    removed: list[str] = []
    # Resources first, records second: a testbed made in between has written its record already.
    links = _our_links(runner)
    namespaces = _our_namespaces(runner)
    parent = CGROUP_CPU / CGROUP_PARENT
    cgroups = [p.name for p in parent.iterdir() if p.is_dir() and _is_hex(p.name)] if parent.is_dir() else []
    known: set[str] = set()
    if home.is_dir():
        for folder in sorted(home.iterdir()):
            tb = Testbed.open(folder, runner=runner)
            if tb is None:
                continue
            known.add(tb.tag)
            if not _owner_alive(tb._rec.get("owner", {})):
                try:
                    removed += tb.teardown()
                except (OSError, TestbedError) as e:  # a stale testbed must not stop the next run
                    _log.warning("could not remove stale testbed %s: %s", tb.tag, e)
    # a testbed of another home whose owner lives is not ours to judge
    known |= {t for t in {n[len(LINK_PREFIX):len(LINK_PREFIX) + 6] for n in links}
              | {n[len(NETNS_PREFIX):len(NETNS_PREFIX) + 6] for n in namespaces} | set(cgroups) if _registered_live(t)}
    for name in links:
        tag = name[len(LINK_PREFIX):len(LINK_PREFIX) + 6]
        if tag not in known and runner(["ip", "link", "del", name]).returncode == 0:
            removed.append(f"veth/bridge {name}")
    for ns in namespaces:
        tag = ns[len(NETNS_PREFIX):len(NETNS_PREFIX) + 6]
        if tag not in known:
            for pid_s in runner(["ip", "netns", "pids", ns]).stdout.split():
                with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                    os.kill(int(pid_s), signal.SIGKILL)
            if runner(["ip", "netns", "del", ns]).returncode == 0:
                removed.append(f"netns {ns}")
    for tag in cgroups:
        base = CGROUP_CPU / CGROUP_PARENT / tag
        if tag not in known and _rmdir_cgroup(base):  # kills what is left in it first
            removed.append(f"cgroup {base}")
    return removed


def leftovers(tag: str, folder: Path | None = None, *, runner: Runner = _run) -> list[str]:
    """What of testbed `tag` still exists: processes, namespaces, links, cgroups, its folder (empty: nothing)."""
    namespaces = [ns for ns in _our_namespaces(runner) if ns.startswith(f"{NETNS_PREFIX}{tag}-")]
    out = [f"netns {ns}" for ns in namespaces]
    for ns in namespaces:
        out += [f"process {p} in netns {ns}" for p in runner(["ip", "netns", "pids", ns]).stdout.split()]
    out += [f"link {name}" for name in _our_links(runner) if name.startswith(f"{LINK_PREFIX}{tag}")]
    cg = CGROUP_CPU / CGROUP_PARENT / tag
    if cg.exists():
        out.append(f"cgroup {cg}")
    if folder is not None and folder.exists():
        out.append(f"folder {folder}")
    rec = Testbed.open(folder) if folder is not None else None
    for key, procs in (rec._rec.get("procs", {}) if rec else {}).items():
        out += [
            f"process {p['pid']} of {key}"
            for p in procs
            if p["start"] is not None and _pid_start(p["pid"]) == p["start"]
        ]
    return out


def _our_links(runner: Runner) -> list[str]:
    r = runner(["ip", "-o", "link", "show"])
    names = []
    for line in r.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@", 1)[0]
        # Our names: sb + 6 hex + (br | h<n> | p<n>).
        if name.startswith(LINK_PREFIX) and len(name) > 9 and _is_hex(name[2:8]) and name[8] in "bhp":
            names.append(name)
    return names


def _our_namespaces(runner: Runner) -> list[str]:
    r = runner(["ip", "netns", "list"])
    out = []
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(NETNS_PREFIX) and _is_hex(name[3:9]) and name[9:10] == "-":
            out.append(name)
    return out


def _is_hex(s: str) -> bool:
    return len(s) == 6 and all(c in "0123456789abcdef" for c in s)


def _no_ipv6(dev: str) -> None:
    with contextlib.suppress(OSError):
        Path(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6").write_text("1")


def cfs_period_us(cores: float, shortest_us: int = MIN_PERIOD_US, *, child: bool = False) -> tuple[int, int]:
    """(period, quota) in µs for a CPU share: the shortest period at least `shortest_us` whose quota the
    kernel accepts (1 ms at least), with quota / period = cores: 10 ms by default, 5 ms for 0.2 cores
    and 2.5 ms for 0.4 with `shortest_us=MIN_QUOTA_US`.

    A quota is a duty cycle, not a slower device: a rank that waited (a pipeline stage between
    microbatches, a stage of a one-microbatch step) finds its period's quota unspent and runs at full
    speed until it is spent, while back to back (what the profiler measures) every period gives the
    share. The shorter the period, the less a stage that waits runs faster than its profile: with the
    kernel's 100 ms, the geo demo's 4-stage plan of 0.2-core stages (one sample per step) ran at 0.47x
    its estimate, and with 10 ms the validation bench's single-layer stages still ran ~25 % faster
    than profiled. Shorter than 10 ms, a busy host takes its toll instead: a device waiting for a core
    loses part of a 3 ms period's quota (0.3-core devices got 0.22 with host processes spinning on
    every core), so only the bench, which has the host to itself, asks for the shortest.

    Rounding: the kernel (cgroup v1) refuses a quota / period above the parent group's (EINVAL), and a
    share that is not 1 ms over a whole number of µs (0.15 cores: 1000.05 µs of a 6667 µs period) rounds
    either way. So a VM's quota rounds up (at least its devices' share) and a device's (`child`) down
    (at most its VM's), whatever their periods; the period is long enough that the rounded-down quota
    is still the kernel's 1 ms. Either is off by under 1 µs a period."""
    if cores <= 0:
        return shortest_us, MIN_QUOTA_US
    period = max(shortest_us, MIN_QUOTA_US, math.ceil(MIN_QUOTA_US / cores - _ROUNDING_US))
    exact = cores * period
    quota = math.floor(exact + _ROUNDING_US) if child else math.ceil(exact - _ROUNDING_US)
    return period, max(MIN_QUOTA_US, quota)


def set_cpu_share(cg: Path, cores: float | None, shortest_period_us: int = MIN_PERIOD_US, *,
                  child: bool = False) -> None:
    """The group may use `cores` (a quota per CFS period, `cfs_period_us`; None: no limit), and weighs that
    much against its siblings when they contend (cpu.shares of 1024 per core, the weight of one host
    process). `child`: a device's group inside a VM's, whose quota rounds down so that it never exceeds
    the VM's, which rounds up (the kernel refuses a child above its parent), before or after either's
    period changes."""
    (cg / "cpu.cfs_quota_us").write_text("-1")  # no limit while the period changes under it
    if cores is not None:
        period, quota = cfs_period_us(cores, shortest_period_us, child=child)
        (cg / "cpu.cfs_period_us").write_text(str(period))
        (cg / "cpu.cfs_quota_us").write_text(str(quota))
    (cg / "cpu.shares").write_text(str(1024 if cores is None else max(2, int(cores * 1024))))


def _device_cgroups(vm_cgroup: Path) -> list[Path]:
    try:
        return sorted(p for p in vm_cgroup.iterdir() if p.is_dir() and p.name.startswith("dev"))
    except OSError:
        return []


def _cgroup_pids(cg: Path) -> list[int]:
    try:
        return [int(x) for x in (cg / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _rmdir_cgroup(cg: Path) -> bool:
    """Remove a cgroup folder (its processes must be gone; retried briefly while the kernel reaps them)."""
    try:
        subs = [p for p in cg.iterdir() if p.is_dir()]
    except OSError:
        return False
    for sub in subs:
        _rmdir_cgroup(sub)
    for _ in range(100):
        try:
            cg.rmdir()
            return True
        except (FileNotFoundError, PermissionError):  # gone, or not ours to remove (not root)
            return False
        except OSError:  # EBUSY: processes still in it
            for pid in _cgroup_pids(cg):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
    return False


def _free_subnet(first: str, home: Path, runner: Runner) -> ipaddress.IPv4Network:
    """The first /16 from `first` on (second octet upward) that no testbed record and no host address uses."""
    try:
        net = ipaddress.ip_network(first)
    except ValueError as e:
        raise TestbedError(
            f"testbed network {first!r} is not a network: {e}; to fix: give one like 10.213.0.0/16"
        ) from None
    if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen != 16 or not net.is_private:
        raise TestbedError(f"testbed network {first} must be a private IPv4 /16; to fix: give one like 10.213.0.0/16")
    used: set[ipaddress.IPv4Network] = set()
    for folder in home.iterdir() if home.is_dir() else []:
        with contextlib.suppress(OSError, json.JSONDecodeError, ValueError):
            sub = json.loads((folder / RECORD).read_text()).get("subnet")
            if sub:
                used.add(ipaddress.IPv4Network(sub))
    routes = runner(["ip", "-o", "-4", "addr", "show"]).stdout + runner(["ip", "-4", "route", "show"]).stdout
    for tok in routes.split():
        with contextlib.suppress(ValueError):
            used.add(ipaddress.IPv4Network(tok, strict=False))
    candidate = net
    for _ in range(64):
        if not any(candidate.overlaps(u) for u in used if u.prefixlen > 0):
            return candidate
        nxt = int(candidate.network_address) + (1 << 16)
        candidate = ipaddress.IPv4Network((nxt, 16))
        if not candidate.is_private:
            break
    raise TestbedError(f"no free private /16 from {first} on; to fix: set SAILOR_TESTBED_NET to a free one")


@contextlib.contextmanager
def _lock(home: Path):  # type: ignore[no-untyped-def]
    with open(home / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write(path: Path, obj: Any) -> None:
    write_atomic("testbed record", path, json.dumps(obj, indent=1).encode(), error=TestbedError, mode=0o600)
