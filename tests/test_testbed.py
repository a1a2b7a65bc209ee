"""The local multi-zone testbed (infra/testbed.py) and the local provider on it.

Needs root, iproute2 and the cgroup v1 cpu controller (skipped otherwise, with the reason). Every
test tears down what it built in a finally and then checks that nothing of it is left: no
namespace, veth, bridge, cgroup, folder or process. Traffic goes only to addresses of namespaces
these tests create and to their bridge.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from infra import local as local_mod
from infra.local import LocalProvider
from infra.provider import EventKind, VmRequest, WorkerAssignment
from infra.scenario import parse_scenario
from infra.testbed import (
    CGROUP_CPU,
    CGROUP_PARENT,
    Testbed,
    TestbedError,
    cleanup_stale,
    leftovers,
    stale_testbeds,
    stream_bytes_per_s,
)
from infra.testbed import testbed_support as support_check
from sailor_cli.main import main
from sailor_core.domain import Market
from sailor_core.errors import ProviderError
from tests.provider_contract import ProviderContract

SUPPORTED, WHY = support_check()
needs_testbed = pytest.mark.skipif(not SUPPORTED, reason=f"the testbed needs root: {WHY}")
REPO = Path(__file__).resolve().parent.parent

BUSY = textwrap.dedent("""
    import time
    w0, c0 = time.perf_counter(), time.process_time()
    x = 0
    while time.process_time() - c0 < 0.1:
        x += 1
    print(time.perf_counter() - w0, time.process_time() - c0)
""")


@contextmanager
def built(zones: list[str], rates: dict[tuple[str, str], float] | None = None) -> Iterator[Testbed]:
    rates = rates or {}
    tb = Testbed.create(run_id="test", zones=zones, link_gbps=lambda a, b: rates.get((a, b), 1.0))
    try:
        yield tb
    finally:
        tb.teardown()
        assert leftovers(tb.tag, tb.folder) == []


def in_vm(tb: Testbed, key: str, code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(tb.command(key, [sys.executable, "-c", code, *args]), capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **tb.env(key)}, cwd=tb.vm(key).folder)


def transfer_bytes_per_s(tb: Testbed, src: str, dst: str, nbytes: int, port: int = 5301) -> float:
    return stream_bytes_per_s(tb, src, dst, nbytes, port=port)


@needs_testbed
def test_vms_are_isolated_and_reach_each_other_and_the_host_address():
    host_lo = socket.socket()
    host_lo.bind(("127.0.0.1", 0))
    host_lo.listen()
    with built(["z1", "z2"]) as tb:
        a = tb.add_vm("a", zone="z1", devices=2, cpu_cores=1.0)
        b = tb.add_vm("b", zone="z2")
        on_bridge = socket.socket()
        on_bridge.bind((tb.host_address, 0))
        on_bridge.listen()
        try:
            assert a.address.endswith(".1.2") and b.address.endswith(".2.2") and tb.host_address.endswith(".0.1")
            links = in_vm(tb, "a", "import socket; print(sorted(n for _, n in socket.if_nameindex()))").stdout
            assert links.strip() == "['eth0', 'lo']"
            probe = textwrap.dedent("""
                import socket, sys
                def ok(host, port):
                    try:
                        socket.create_connection((host, int(port)), timeout=2).close(); return True
                    except OSError:
                        return False
                print(ok("127.0.0.1", sys.argv[1]), ok(sys.argv[2], sys.argv[3]))
            """)
            out = in_vm(tb, "a", probe, str(host_lo.getsockname()[1]), tb.host_address,
                        str(on_bridge.getsockname()[1])).stdout.split()
            assert out == ["False", "True"]  # the host's loopback is not the VM's; the host address is reachable
            # VM to VM over the network, and a VM's own ranks over its loopback.
            assert transfer_bytes_per_s(tb, "a", "b", 1 << 20) > 0
            srv = tb.spawn(
                "a",
                [
                    sys.executable,
                    "-c",
                    "import socket; s = socket.socket(); s.bind(('127.0.0.1', 5302)); "
                    "s.listen(); print('ready', flush=True); s.accept()",
                ],
                log=tb.folder / "lo.log",
            )
            wait_for(lambda: "ready" in (tb.folder / "lo.log").read_text())
            lo = "import socket; socket.create_connection(('127.0.0.1', 5302), timeout=5).close()"
            assert in_vm(tb, "a", lo).returncode == 0
            srv.wait(timeout=10)
            # Its processes run in its folder and its cgroup.
            where = in_vm(tb, "a", "import os; print(os.getcwd()); print(open('/proc/self/cgroup').read())").stdout
            assert where.splitlines()[0] == a.folder and f"{CGROUP_PARENT}/{tb.tag}/a" in where
            assert not Path(a.folder).is_relative_to(REPO)
        finally:
            on_bridge.close()
            host_lo.close()


GLOO = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    rank, master = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29511", rank=rank, world_size=2)
    x = torch.full((1 << 18,), float(rank + 1))
    dist.all_reduce(x)
    print(rank, os.environ["SAILOR_VM_ADDRESS"], float(x[0]), flush=True)
    dist.destroy_process_group()
""")


@needs_testbed
def test_torch_gloo_runs_across_vms_of_two_zones():
    with built(["z1", "z2"]) as tb:
        a = tb.add_vm("a", zone="z1")
        b = tb.add_vm("b", zone="z2")
        procs = [tb.spawn(k, [sys.executable, "-c", GLOO, str(r), a.address], log=tb.folder / f"{k}.log",
                          env={"OMP_NUM_THREADS": "1"}) for r, k in enumerate(("a", "b"))]
        for p in procs:
            p.wait(timeout=120)
        out = [(tb.folder / f"{k}.log").read_text().splitlines()[-1].split() for k in ("a", "b")]
        assert out == [["0", a.address, "3.0"], ["1", b.address, "3.0"]]


@needs_testbed
def test_links_are_shaped_per_zone_pair():
    rates = {("z1", "z1"): 0.4, ("z1", "z2"): 0.08, ("z2", "z1"): 0.08, ("z2", "z2"): 0.4}
    with built(["z1", "z2"], rates) as tb:
        tb.add_vm("a1", zone="z1")
        tb.add_vm("a2", zone="z1")
        tb.add_vm("b", zone="z2")
        cross = transfer_bytes_per_s(tb, "a1", "b", 6 << 20)
        same = transfer_bytes_per_s(tb, "a1", "a2", 12 << 20)
        shaped_cross = 0.08e9 / 8
        assert 0.75 * shaped_cross < cross < 1.15 * shaped_cross, cross
        assert same > 2.5 * cross


@needs_testbed
def test_the_cpu_quota_makes_a_slow_device_type_slower():
    with built(["z1"]) as tb:
        tb.add_vm("fast", zone="z1", cpu_cores=1.0)
        tb.add_vm("slow", zone="z1", cpu_cores=0.05)
        slow_wall, slow_cpu = map(float, in_vm(tb, "slow", BUSY).stdout.split())
        fast_wall, fast_cpu = map(float, in_vm(tb, "fast", BUSY).stdout.split())
        assert slow_cpu / slow_wall < 0.05 * 1.5  # the quota caps it, however idle the machine is
        # Same work; the fast VM gets what the (shared, busy) machine gives, the slow one at most 5% of a core.
        assert slow_wall > 2 * fast_wall, (slow_wall, fast_wall)
        stat = Path(tb.vm("slow").cgroup, "cpu.stat").read_text()
        assert int(stat.split("nr_throttled")[1].split()[0]) > 0


SPIN = textwrap.dedent("""
    import os, sys, time
    if sys.argv[1] != "-":
        from sailor_core.runtime.devices import bind_device, device_share
        bind_device(int(sys.argv[1]))
        assert device_share() is not None
    w0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - w0 < 2.0:
        pass
    print((time.process_time() - c0) / (time.perf_counter() - w0), open("/proc/self/cgroup").read())
""")


@needs_testbed
def test_a_process_bound_to_a_device_gets_that_devices_cpu_share_only():
    share = 0.1  # small enough that even a busy host gives the loop more: the quota is what holds it back
    with built(["z1"]) as tb:
        vm = tb.add_vm("two", zone="z1", devices=2, cpu_cores=2 * share)
        assert tb.env("two")["SAILOR_DEVICE_CGROUP_ROOT"] == vm.cgroup
        cg = Path(vm.cgroup)
        def cores(c: Path) -> float:
            return int((c / "cpu.cfs_quota_us").read_text()) / int((c / "cpu.cfs_period_us").read_text())

        assert cores(cg) == pytest.approx(2 * share)  # the VM: both devices
        for dev in ("dev0", "dev1"):
            assert cores(cg / dev) == pytest.approx(share)
            assert int((cg / dev / "cpu.cfs_period_us").read_text()) == 10_000  # the testbed's 10 ms (1 ms of quota)
        bound = in_vm(tb, "two", SPIN, "0", timeout=30)
        assert bound.returncode == 0, bound.stderr
        rate, where = bound.stdout.split(maxsplit=1)
        assert f"{vm.cgroup.removeprefix(str(CGROUP_CPU))}/dev0" in where
        assert float(rate) <= share * 1.3, rate  # one device's share, though the VM has two
        stat = (cg / "dev0" / "cpu.stat").read_text()
        assert int(stat.split("nr_throttled")[1].split()[0]) > 0  # dev0's own quota held it back
        unbound = in_vm(tb, "two", SPIN, "-", timeout=30)
        assert unbound.returncode == 0 and "/dev" not in unbound.stdout  # the VM's whole quota is its limit
        missing = in_vm(tb, "two", SPIN, "2", timeout=30)
        assert missing.returncode != 0 and "has no device 2" in missing.stderr
    assert not cg.exists()  # the device cgroups went with the VM's (built() checks the rest)


@needs_testbed
def test_a_busy_host_does_not_slow_two_devices_of_a_vm_below_their_shares():
    # Host processes outside the testbed keep every core busy; each device of a 2-device VM must still
    # get its own share (the testbed's cgroups outweigh them). Before, the VM's group weighed as one
    # host process, and its two devices together got about what one host process gets.
    share = 0.3
    hogs = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 8: pass"])
            for _ in range(2 * (os.cpu_count() or 2))]
    try:
        with built(["z1"]) as tb:
            vm = tb.add_vm("two", zone="z1", devices=2, cpu_cores=2 * share)
            assert int((Path(vm.cgroup).parent.parent / "cpu.shares").read_text()) > 100 * 1024
            ranks = [subprocess.Popen(tb.command("two", [sys.executable, "-c", SPIN, str(d)]), text=True,
                                      stdout=subprocess.PIPE, env={**os.environ, **tb.env("two")}) for d in (0, 1)]
            rates = [float(p.communicate(timeout=30)[0].split()[0]) for p in ranks]
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert all(r > 0.75 * share for r in rates), rates  # each device near its share despite the hogs


@needs_testbed
def test_teardown_removes_everything_also_from_another_process():
    with built(["z1", "z2"]) as tb:
        tb.add_vm("a", zone="z1", cpu_cores=0.5)
        tb.add_vm("b", zone="z2")
        stubborn = tb.spawn("a", [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                  "signal.SIG_IGN); time.sleep(300)"])
        assert leftovers(tb.tag, tb.folder)
        code = f"from infra.testbed import Testbed; print(Testbed.open({str(tb.folder)!r}).teardown())"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert r.returncode == 0, r.stderr
        assert f"bridge sb{tb.tag}br" in r.stdout and "netns" in r.stdout
        stubborn.wait(timeout=5)
        assert leftovers(tb.tag, tb.folder) == []
        ip = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"sb{tb.tag}" not in ip and f"sb-{tb.tag}" not in ns
        assert not (CGROUP_CPU / CGROUP_PARENT / tb.tag).exists() and not tb.folder.exists()
        assert tb.teardown() == []  # idempotent


@needs_testbed
def test_a_removed_vm_is_gone_and_runs_nothing():
    with built(["z1"]) as tb:
        a = tb.add_vm("a", zone="z1", cpu_cores=0.5)
        p = tb.spawn("a", [sys.executable, "-c", "import time; time.sleep(300)"])
        tb.remove_vm("a")
        p.wait(timeout=5)
        assert f"netns {a.netns}" not in leftovers(tb.tag) and not Path(a.cgroup).exists()
        with pytest.raises(TestbedError, match="is gone"):
            tb.spawn("a", ["true"])


@needs_testbed
def test_stale_testbeds_of_a_dead_owner_and_unrecorded_leftovers_are_removed(capsys):
    code = textwrap.dedent("""
        import os, sys
        from infra.testbed import Testbed
        tb = Testbed.create(run_id="crashed", zones=["z1"], link_gbps=lambda a, b: 1.0)
        tb.add_vm("a", zone="z1", cpu_cores=0.3)
        p = tb.spawn("a", [sys.executable, "-c", "import time; time.sleep(300)"])
        print(tb.tag, tb.folder, p.pid, flush=True)
        os._exit(0)   # a crash: no teardown
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    tag, folder, pid = r.stdout.split()
    orphan = "f" + os.urandom(3).hex()[1:]  # resources named like ours, with no record at all
    subprocess.run(["ip", "netns", "add", f"sb-{orphan}-x"], check=True)
    subprocess.run(["ip", "link", "add", f"sb{orphan}h0", "type", "veth", "peer", "name", f"sb{orphan}p0"], check=True)
    try:
        assert leftovers(tag, Path(folder)) and leftovers(orphan)
        assert {tag, orphan} <= set(stale_testbeds())
        assert main(["infra", "cleanup", "--provider", "local", "--dry-run"]) in (0, None)
        out = capsys.readouterr().out
        if tag in stale_testbeds():  # else another test's cleanup took it meanwhile (tests run in parallel)
            assert f"would remove testbed {tag}" in out and leftovers(tag, Path(folder)), out
        removed = cleanup_stale()
        for name in (tag, orphan):  # removed here, or just before by another test's cleanup (tests run in parallel)
            assert any(name in x for x in removed) or name not in stale_testbeds(), (name, removed)
        assert leftovers(tag, Path(folder)) == [] and leftovers(orphan) == []
        assert not {tag, orphan} & set(stale_testbeds())
        end = time.monotonic() + 60  # the kill is sent; wait for it to land rather than for a fixed 0.1 s
        while not _dead_or_zombie(pid):
            assert time.monotonic() < end, f"the orphan's process {pid} still runs 60 s after cleanup"
            time.sleep(0.05)
    finally:
        subprocess.run(["ip", "netns", "del", f"sb-{orphan}-x"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"sb{orphan}h0"], capture_output=True)
        tb = Testbed.open(folder)
        if tb is not None:
            tb.teardown()


@needs_testbed
def test_a_live_owners_testbed_is_not_stale():
    with built(["z1"]) as tb:
        tb.add_vm("a", zone="z1")
        assert not any(tb.tag in x for x in cleanup_stale())
        assert leftovers(tb.tag, tb.folder)


# -- the local provider on the testbed ----------------------------------------------------------
GEO = {
    "device_types": {"cpu-fast": {"cpu_per_device": 0.3}, "cpu-slow": {"cpu_per_device": 0.2}},
    "regions": {
        "eu": {"eu-west": [{"device_type": "cpu-fast", "devices_per_vm": 2, "market": "on-demand", "count": 2,
                            "usd_per_gpu_hour": 0.3}],
               "eu-north": [{"device_type": "cpu-slow", "devices_per_vm": 1, "market": "spot", "count": 2,
                             "usd_per_gpu_hour": 0.05}]},
        "us": {"us-east": [{"device_type": "cpu-slow", "devices_per_vm": 1, "market": "on-demand", "count": 1,
                            "usd_per_gpu_hour": 0.1}]},
    },
    "links": {"same_zone_gbps": 1.0, "same_region_gbps": 0.4, "cross_region_gbps": 0.1},
    "events": [{"at_step": 5, "kind": "preemption", "zone": "eu-north", "market": "spot", "grace_s": 0.3},
               {"at_step": 8, "kind": "capacity_change", "zone": "eu-north", "market": "spot", "count": 2}],
}
HEARTBEAT_AGENT = textwrap.dedent("""
    import json, os, time
    hb = os.environ["SAILOR_HEARTBEAT_FILE"]
    step = 0
    while True:
        with open(hb + ".tmp", "w") as f:
            json.dump({"step": step, "address": os.environ.get("SAILOR_VM_ADDRESS")}, f)
        os.replace(hb + ".tmp", hb)
        step += 1
        time.sleep(0.05)
""")


def heartbeat_agent(vm, assignment, slot) -> list[str]:
    return [sys.executable, "-c", HEARTBEAT_AGENT]


def assignment(run_id: str) -> WorkerAssignment:
    return WorkerAssignment(run_id=run_id, plan_version=1, plan_json="{}", rendezvous_endpoint="127.0.0.1:1",
                            ranks=(0,), world_size=1)


def wait_for(cond, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


@needs_testbed
def test_local_provider_runs_vms_in_zones_with_devices_and_addresses(tmp_path):
    p = LocalProvider(tmp_path / "local", scenario=parse_scenario(GEO), agent_command=heartbeat_agent,
                      isolation="netns", stop_grace_s=1)
    run = "geo-test"
    try:
        offers = {(o.zone, o.gpu_type, o.market): (o.gpus, o.gpus_per_vm) for o in p.offerings()}
        assert offers[("eu-west", "cpu-fast", Market.ON_DEMAND)] == (4, 2)
        assert offers[("eu-north", "cpu-slow", Market.SPOT)] == (2, 1)
        assert [o.zone for o in p.offerings(regions=["us"])] == ["us-east"]
        vms = p.provision([
            VmRequest(run_id=run, name="w0", zone="eu-west", gpu_type="cpu-fast", gpus=2, market=Market.ON_DEMAND),
            VmRequest(run_id=run, name="w1", zone="eu-north", gpu_type="cpu-slow", gpus=1, market=Market.SPOT),
            VmRequest(run_id=run, name="w2", zone="us-east", gpu_type="cpu-slow", gpus=1, market=Market.ON_DEMAND),
        ])
        host = p.host_address(run)
        assert host != "127.0.0.1" and len({v.address for v in vms} | {host}) == 4
        assert vms[0].gpus == 2 and vms[0].usd_per_hour == pytest.approx(0.6)
        for vm in vms:
            p.bootstrap(vm, assignment(run))
        beats = [wait_for(lambda v=vm: p.heartbeat(v.vm_id)) for vm in vms]
        assert [b["address"] for b in beats] == [v.address for v in vms]  # each agent sees its own VM
        assert all(not p.slot_dir(v.vm_id).is_relative_to(tmp_path) for v in vms)  # not under the run folder
        info = p.cluster_info(run)
        assert info["isolation"] == "netns" and info["links_shaped"] and info["regions"] == ["eu", "us"]
        assert info["links_gbps"]["eu-west>us-east"] == 0.1
        assert {d["name"]: d["devices_per_vm"] for d in info["device_types"]} == {"cpu-fast": [2], "cpu-slow": [1]}
        assert [(v["zone"], v["devices"], v["address"]) for v in info["vms"]] == [
            (v.zone, v.gpus, v.address) for v in vms]
        # The scripted spot preemption takes the VM away: its namespace goes too.
        pre = wait_for(lambda: [e for e in p.events(run) if e.kind == EventKind.PREEMPTION])
        assert pre[0].vm_id == vms[1].vm_id and pre[0].zone == "eu-north"
        wait_for(lambda: p.events(run) is not None and p.list_vms(run)[1].state == "preempted")
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"-{vms[1].vm_id}" not in ns and f"-{vms[0].vm_id}" in ns
        # Capacity returns: the capacity_change says what is rentable again.
        back = wait_for(lambda: [e for e in p.events(run) if e.kind == EventKind.CAPACITY_CHANGE])
        assert back[0].detail["returned"] == 1 and back[0].detail["free_vms"] == 2
        assert [o.gpus for o in p.offerings(gpu_types=["cpu-slow"], markets=[Market.SPOT])] == [2]
        pids = [json.loads(f.read_text())["pid"] for f in (tmp_path / "local" / "vms").glob("*.json")]
    finally:
        p.cleanup(run)
    assert p.leftovers(run) == []
    assert not any(local_mod._group_alive(pid) for pid in pids if pid)
    after = p.cluster_info(run)  # the run's cluster as it ended, for its history
    assert after["isolation"] == "netns" and after["host_address"] == host and len(after["vms"]) == 3


@needs_testbed
def test_cleanup_from_another_provider_removes_the_testbed(tmp_path):
    p = LocalProvider(tmp_path / "local", scenario=parse_scenario(GEO), agent_command=heartbeat_agent,
                      isolation="netns", stop_grace_s=0.5)
    vm = p.provision([VmRequest(run_id="r", name="w0", zone="us-east", gpu_type="cpu-slow", gpus=1)])[0]
    p.bootstrap(vm, assignment("r"))
    wait_for(lambda: p.heartbeat(vm.vm_id))
    other = LocalProvider(tmp_path / "local", scenario=parse_scenario(GEO))  # e.g. the flow's cancellation hook
    assert other.cleanup("r") == [vm.vm_id]
    assert p.leftovers("r") == []


def test_without_root_the_provider_falls_back_to_processes_and_says_so_once(tmp_path):
    said: list[str] = []
    local_mod._FALLBACK_SAID.clear()
    no = lambda: (False, "not root (uid 1000)")  # noqa: E731
    p = LocalProvider(tmp_path / "a", isolation="auto", support=no, notify=said.append, agent_command=heartbeat_agent)
    q = LocalProvider(tmp_path / "b", isolation="auto", support=no, notify=said.append)
    assert p.isolation == "process" and q.isolation == "process"
    assert len(said) == 1 and "not root" in said[0]
    try:
        vm = p.provision([VmRequest(run_id="r", name="w0", zone="local", gpu_type="cpu", gpus=1)])[0]
        assert vm.address == "127.0.0.1" and p.host_address("r") == "127.0.0.1"
        p.bootstrap(vm, assignment("r"))
        wait_for(lambda: p.heartbeat(vm.vm_id))
        assert p.cluster_info("r")["isolation"] == "process" and not p.cluster_info("r")["links_shaped"]
    finally:
        p.cleanup("r")
    assert p.leftovers("r") == []
    with pytest.raises(ProviderError, match="isolation netns.*not root"):
        _ = LocalProvider(tmp_path / "c", isolation="netns", support=no).isolation


def _dead_or_zombie(pid: int) -> bool:
    try:
        return "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]
    except FileNotFoundError:
        return True


def _unreadable_by_nobody() -> str:
    """Why user nobody cannot import this checkout with this Python ('' when it can): a clone inside a
    folder only its owner may enter (`git clone ... "$(mktemp -d)/p"`: mode 700) is out of nobody's reach."""
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                        "import infra.local"], capture_output=True, text=True, cwd=REPO, timeout=60)
    if r.returncode == 0:
        return ""
    last = (r.stderr.strip().splitlines() or ["no output"])[-1]
    return (f"user nobody cannot import the checkout at {REPO} with {sys.executable} ({last}); a folder on the "
            f"way is not open to other users (e.g. a clone in a mktemp -d folder, mode 700)")


def test_a_real_user_without_root_gets_process_isolation():
    """As user nobody, for real: `auto` resolves to process, a VM runs, and the fallback is said."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to user nobody")
    unreadable = _unreadable_by_nobody()
    if unreadable:
        pytest.skip(unreadable)
    tmp_path = Path(tempfile.mkdtemp(prefix="sailor-nobody-"))
    tmp_path.chmod(0o1777)  # open to nobody, sticky as /tmp is: a folder another user could rename in is refused
    code = textwrap.dedent(f"""
        import sys, time
        from infra.local import LocalProvider
        from infra.provider import VmRequest
        p = LocalProvider({str(tmp_path / 'local')!r}, isolation="auto")
        vm = p.provision([VmRequest(run_id="r", name="w0", zone="local", gpu_type="cpu", gpus=1)])[0]
        proc = p.spawn(vm.vm_id, ["/bin/sh", "-c", "echo hello"], env={{}}, log=p.slot_dir(vm.vm_id) / "x.log")
        proc.wait()
        print(p.isolation, vm.address, (p.slot_dir(vm.vm_id) / "x.log").read_text().strip())
        p.cleanup("r")
    """)
    # its own testbed home inside this test's folder: not the machine's shared /tmp/sailor-testbed-65534,
    # which another test's cleanup may remove under it
    env = {**os.environ, "HOME": str(tmp_path), "SAILOR_TESTBED_HOME": str(tmp_path / "testbed-home")}
    try:
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                           capture_output=True, text=True, cwd=REPO, timeout=60, env=env)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["process", "127.0.0.1", "hello"]
    assert "isolation process" in r.stderr and "not root" in r.stderr


@needs_testbed
class TestLocalProviderOnTheTestbed(ProviderContract):
    @pytest.fixture
    def provider(self, tmp_path):
        p = LocalProvider(tmp_path / "local", scenario=parse_scenario(GEO), agent_command=heartbeat_agent,
                          isolation="netns", stop_grace_s=1)
        yield p
        p.cleanup()



def test_the_owners_registry_is_the_machines_whatever_tmpdir_a_command_runs_with(monkeypatch, tmp_path) -> None:
    """Namespaces and cgroups are the machine's: a cleanup run with a private TMPDIR (as tests/test_exit_codes.py
    runs `sailor`) must still see every live testbed's owner, or it takes them for orphans and kills their VMs."""
    from infra.testbed import owners_dir

    before = owners_dir()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert tempfile.gettempdir() == str(tmp_path)
    assert owners_dir() == before == Path("/tmp/sailor-testbed-owners")


def test_cfs_periods_are_10_ms_or_the_shortest_the_kernel_accepts_for_each_share():
    from infra.testbed import MIN_QUOTA_US, cfs_period_us

    assert cfs_period_us(0.2) == (10_000, 2000) and cfs_period_us(0.05) == (20_000, 1000)
    assert cfs_period_us(0.2, MIN_QUOTA_US) == (5000, 1000)  # the validation bench's
    assert cfs_period_us(0.4, MIN_QUOTA_US) == (2500, 1000)
    assert cfs_period_us(0.8, MIN_QUOTA_US) == (1250, 1000)
    assert cfs_period_us(2.0, MIN_QUOTA_US) == (1000, 2000)
