"""The simulator against measured runs that span slow links: plans trained on the local testbed.

Builds the scenario's testbed (infra/testbed.py; needs root): every offered VM of the scenario
(zones in two regions, two device types by CPU quota, 1- and 2-device VMs), and a controller on the
testbed's bridge address. Then, as the flow's profile subflow does on rented VMs:

- layers: `sailor profile model` ON a VM of each device type (tp 1 on a 1-device VM, tp 2 on a
  2-device VM, so each rank runs at the quota it trains at);
- links: `sailor profile link` between two VMs of every zone pair (and of one zone where it has two
  VMs), meeting through the controller; the node's own link (`sailor profile network --workers 2`)
  on a 2-device VM;
- imported into a fresh profile store with their provenance (VM, zone), as flows/profiling.py does.

Then it trains each plan below on the testbed VMs through per-VM agents (`sailor worker`) and one
ControlServer (a generation per run), `--sweeps` times (a pass over the list, then one backwards),
and takes the median iteration time of the steps after `--warmup` over its runs (rank 0's metrics list).

The testbed's devices are CPU quotas of a host whose speed moves by up to ~40 % within minutes (a
GPU's clock does not), so one profile taken at the start stands for none of the runs. Every run is
bracketed by short rounds of layer profiles on the testbed's VMs (`sailor profile model`, only the
device types, TP degrees and microbatch sizes of the plans on either side of the round): one round
ends before the run's agents start, the next starts after they have exited, and that round is also
the one before the next run. A run is simulated from the mean of its two adjacent rounds
(`estimate`), from nothing measured while it ran: no step time, no clock reading of its window. A
run whose window saw the host drift is run again between fresh rounds (at most `--repeats` repeats
in all): drift is the simulations from the round before and from the round after alone disagreeing
by more than `--max-drift-pct`, or a host clock beside the testbed (`HostClock`: a fixed unit of CPU
work timed every 0.1 s, outside the VMs) reading more than that apart during the run's kept steps
and during its two rounds; no run is repeated once the bench has run `--budget-min` minutes. The
clock decides repeats and is printed; it never enters an estimate.
A plan's simulated time is the mean of its runs' (each run keeps as many steps); links are shaped by
`tc` and measured once, before the runs. Everything is torn down at the end, also on an error or
Ctrl-C. The last line:

    mean_abs_error_pct=X worst_abs_error_pct=Y plans=N

    sudo .venv/bin/python bench/validate_testbed.py [--scenario bench/validate_testbed.yaml] [--model gpt-tiny]
        [--steps 9] [--warmup 3] [--sweeps 2] [--max-drift-pct 10] [--repeats 4] [--budget-min 25]
        [--store DIR (reuse the
        links and device types measured before)] [--only NAME,...] [--dry (build the testbed, print its
        VMs and quotas, tear it down)]

Without root (no network namespaces or cgroups) it prints `skipped: needs root: ...` and exits 0.
The quotas of every VM together are the scenario's `cpu_budget_cores` (2 on geo.yaml). The machine
is shared: other jobs on its cores slow a VM below its quota, which neither the profiles nor the
simulator know about.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.scenario import load_scenario  # noqa: E402
from infra.testbed import (  # noqa: E402
    MIN_QUOTA_US,
    Testbed,
    TestbedError,
    TestbedVm,
    set_cpu_share,
    testbed_support,
)
from profiles_store import open_store  # noqa: E402
from profiles_store.tables import (  # noqa: E402
    FRAMEWORK_OVERHEAD,
    GPU_TYPES,
    INTRA_NODE_LINKS,
    LAYER_PROFILES,
    LINK_ALLREDUCE,
    MODELS,
    NETWORK_LINKS,
    NODE_ALLREDUCE,
)
from sailor_core.domain import LayerProfile, Market, ParallelPlan, PipelineBatch, Provenance, Replica, Stage  # noqa: E402
from sailor_core.plan_format import plan_to_dict  # noqa: E402
from sailor_core.profiles import ProfileBook  # noqa: E402
from sailor_core.runtime.protocol import SECRET_ENV, ControlServer, assign_generation, metrics_key, status_key  # noqa: E402
from sailor_core.simulator import place_nodes, simulate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAILOR = str(ROOT / ".venv" / "bin" / "sailor")
PROFILE_MBS = "1,2,4,8"


class TestbedLost(RuntimeError):
    """The VMs of a plan vanished under it (their agents exited without a word)."""


@dataclass(frozen=True)
class VmInfo:
    key: str
    zone: str
    region: str
    gpu_type: str
    devices: int
    market: str
    vm: TestbedVm


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------
# the host's speed

# A fixed unit of the work the devices do (a gpt-tiny-sized MLP's forward and backward on 64 tokens,
# one thread, about 2 ms), timed in thread CPU seconds every 0.1 s: a CPU second of this VM does more
# or less of it as the host's other tenants come and go, which wall time, CPU time and CFS quotas (all
# counted in those seconds) cannot tell apart; the unit's CPU time can. Torch's kernels, not a Python
# loop: the two did not move together (a pure-Python unit read 2-3x slower for minutes in which the
# layer profiles and the plans ran at their usual speed).
_CLOCK_SRC = """
import os, sys, time
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
x = torch.randn(64, 128)
def unit():
    mlp.zero_grad(set_to_none=True)
    mlp(x).square().sum().backward()
for _ in range(20):
    unit()
out = open(sys.argv[1], "w", buffering=1)
parent = os.getppid()
while os.getppid() == parent:  # ends with the bench, also when the bench is killed
    c0 = time.thread_time()
    unit()
    out.write(f"{time.time():.3f} {(time.thread_time() - c0) * 1e3:.4f}\\n")
    time.sleep(0.1)
"""
MIN_CLOCK_SAMPLES = 10


class HostClock:
    """The host's speed over the bench, read beside the testbed: a process outside the VMs (~2 % of a
    core) times `_CLOCK_SRC`'s unit of work every 0.1 s into `path`.

    The testbed's devices are CPU quotas of a 2-vCPU VM on a shared host: the same work takes more
    or fewer CPU seconds from one second to the next, and its mean over the seconds of a plan's kept
    steps or the seconds of a profile round moves by tens of percent within minutes. A GPU's clock
    does not. `speed_over` reads the unit's mean CPU time in given windows; the bench reads it to
    decide whether a run is repeated (`drift`) and prints it, never to estimate a run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-c", _CLOCK_SRC, str(path)])

    def samples(self) -> list[tuple[float, float]]:
        """(wall time, CPU ms of one unit) of every sample so far."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                out.append((float(parts[0]), float(parts[1])))
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def speed_over(samples: Sequence[tuple[float, float]], windows: Sequence[tuple[float, float]]) -> float | None:
    """The unit's mean CPU ms over the samples inside any of `windows` ((start, end) wall times); None
    when fewer than MIN_CLOCK_SAMPLES fall inside (too little to tell)."""
    inside = [c for t, c in samples if any(a <= t <= b for a, b in windows)]
    return statistics.mean(inside) if len(inside) >= MIN_CLOCK_SAMPLES else None


# ------------------------------------------------------------------------------------------
# testbed


def build(tb: Testbed, sc: Any) -> list[VmInfo]:
    out = []
    for o in sc.offerings:
        quota = sc.device_type(o.gpu_type).cpu_per_device
        for i in range(o.vms):
            key = f"{o.zone.replace('-', '')[:6]}{o.gpu_type[4:5]}{o.gpus_per_vm}{i}"
            vm = tb.add_vm(key, zone=o.zone, devices=o.gpus_per_vm,
                           cpu_cores=None if quota is None else quota * o.gpus_per_vm)
            if vm.cgroup and vm.cpu_cores is not None:
                _shortest_periods(Path(vm.cgroup), vm.cpu_cores, vm.devices)
            out.append(VmInfo(key, o.zone, o.region, o.gpu_type, o.gpus_per_vm, o.market.value, vm))
    return out


def _shortest_periods(cgroup: Path, cores: float, devices: int) -> None:
    """The same CPU shares in the shortest CFS periods the kernel allows (5 ms for 0.2 cores, 2.5 ms for
    0.4) instead of the testbed's 10 ms, for the VM and each device (`dev<i>`, which ranks bind to):
    after a wait a period gives at most one quota at full speed, so the shorter the period, the less
    a stage that waits often runs faster than its profile (10 ms periods left single-layer stages of
    a 4-stage pipeline ~25 % faster than profiled). The testbed keeps 10 ms because shorter periods
    lose quota on a busy host (infra.testbed.cfs_period_us); this bench has the host to itself."""
    set_cpu_share(cgroup, cores, MIN_QUOTA_US)
    for i in range(devices):
        set_cpu_share(cgroup / f"dev{i}", cores / devices, MIN_QUOTA_US, child=True)


def run_on(tb: Testbed, jobs: Sequence[tuple[VmInfo, list[str]]], logs: Path, env: dict[str, str] | None = None,
           timeout_s: float = 900.0) -> None:
    """Run one command per VM at once (sailor CLI argv), wait for all; fail loudly with the log tail."""
    procs = []
    for v, argv in jobs:
        lg = logs / f"{v.key}-{argv[1]}-{len(list(logs.iterdir()))}.log"
        penv = {"OMP_NUM_THREADS": "1", "SAILOR_ADVERTISE_ADDR": v.vm.address, **(env or {})}
        procs.append((v, argv, lg, tb.spawn(v.key, [SAILOR, *argv], env=penv, log=lg)))
    deadline = time.monotonic() + timeout_s
    for v, argv, lg, p in procs:
        try:
            rc = p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = -1
        if rc != 0:
            tail = lg.read_text(errors="replace")[-2000:] if lg.exists() else ""
            raise RuntimeError(f"{' '.join(argv[:2])} on {v.key} exited {rc}:\n{tail}")


# ------------------------------------------------------------------------------------------
# profiling on the testbed's VMs


def _prov(v: VmInfo, run: str, peer: VmInfo | None = None) -> Provenance:
    info = {"vm": v.key, "zone": v.zone, "gpu_type": v.gpu_type, "run": run}
    if peer is not None:
        info.update(peer_vm=peer.key, peer_zone=peer.zone, peer_gpu_type=peer.gpu_type)
    return Provenance(source="sailor-profile-on-vm", host=v.key, recorded_at=datetime.now(UTC),
                      settings=json.dumps(info, sort_keys=True))


@dataclass(frozen=True)
class LayerRound:
    """One round of layer profiles: (VM, device type, store folder) per job, and when it ran (wall time)."""

    jobs: list[tuple[VmInfo, str, Path]]
    start: float
    end: float


Point = tuple[str, int, int]  # a layer profile's (device type, tp, microbatch size)


def plan_points(plan: ParallelPlan) -> set[Point]:
    """The (device type, tp, microbatch size) whose layer profiles the plan's simulation reads."""
    return {(r.gpu_type, r.tp, pb.microbatch_size) for st in plan.stages for r in st.replicas for pb in plan.pipelines}


def measure_layers(tb: Testbed, vms: list[VmInfo], model: str, work: Path, tag: str,
                   points: set[Point] | None = None) -> LayerRound:
    """One round of layer profiles, all at once as the flow's profile subflow runs them: tp 1 on a
    1-device VM of each type, tp 2 on a 2-device VM, at every microbatch size of PROFILE_MBS, or only
    the device types, TP degrees and microbatch sizes of `points` (a short round). Every rank is bound
    to its own device's CPU share (sailor_core/runtime/devices.py), and the profiler's times are that
    device's. Returns (VM, type, store folder) per job, and the round's start and end."""
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    jobs, where = [], []
    for g in sorted({v.gpu_type for v in vms}):
        one = next((v for v in vms if v.gpu_type == g and v.devices == 1), None)
        two = next((v for v in vms if v.gpu_type == g and v.devices >= 2), None)
        for v, tp in ((one, 1), (two, 2)):
            mbs = PROFILE_MBS if points is None else ",".join(
                str(m) for m in sorted({m for gg, t, m in points if (gg, t) == (g, tp)}))
            if v is None or not mbs:
                continue
            dest = work / f"layers-{tag}-{g}-tp{tp}"
            jobs.append((v, ["profile", "model", "--model", model, "--device", "cpu", "--gpu-type", g, "--tp", str(tp),
                             "--mbs", mbs, "--json", "--store", str(dest)]))
            where.append((v, g, dest))
    missing = {(g, tp) for g, tp, _ in points or ()} - {(g, int(a[a.index("--tp") + 1])) for (_, g, _), (_, a)
                                                       in zip(where, jobs, strict=True)}
    if missing:
        raise SystemExit(f"no VM to profile {sorted(missing)} on (tp 1 needs a 1-device VM of the type, tp 2 a "
                         f"2-device one); to fix: add such VMs to the scenario")
    t0 = time.time()
    run_on(tb, jobs, logs)
    t1 = time.time()
    log(f"layer profiles ({tag}) on {[f'{v.key} {g}' for v, g, _ in where]} in {t1 - t0:.0f} s")
    return LayerRound(where, t0, t1)


def median_profiles(rounds: Sequence[Sequence[LayerProfile]]) -> list[LayerProfile]:
    """Per (mbs, tp, layer), the median of each time over the rounds that measured it (of two rounds,
    the round before a run and the round after it: their mean)."""
    by_key: dict[tuple[str, str, int, int, int], list[LayerProfile]] = {}
    for r in rounds:
        for p in r:
            by_key.setdefault((p.model, p.gpu_type, p.mbs, p.tp, p.layer), []).append(p)
    return [replace(ps[0], forward_s=statistics.median(p.forward_s for p in ps),
                    backward_s=statistics.median(p.backward_s for p in ps),
                    optimizer_s=statistics.median(p.optimizer_s for p in ps))
            for _, ps in sorted(by_key.items())]


def round_profiles(model: str, rnd: LayerRound) -> list[LayerProfile]:
    """The layer profiles one round measured (every job's store folder)."""
    out: list[LayerProfile] = []
    for _, g, dest in rnd.jobs:
        # seconds of the bound device
        out += open_store(str(dest), seed=False).read(LAYER_PROFILES, {"model": model, "gpu_type": g})
    return out


def import_types(store: Any, rnd: LayerRound, run: str) -> None:
    """Writes the device types and framework memory one round of layer profiles measured, as
    flows/profiling.py imports a VM's store."""
    for v, g, dest in rnd.jobs:
        src = open_store(str(dest), seed=False)
        store.write(GPU_TYPES, [src.gpu_types()[g]], provenance=_prov(v, run))
        if v.devices == 1:
            store.write(FRAMEWORK_OVERHEAD, [o for o in src.read(FRAMEWORK_OVERHEAD) if o[0] == g],
                        provenance=_prov(v, run))


def import_layers(store: Any, model: str, rnd: LayerRound, run: str) -> None:
    """Writes the layer profiles of one round into the store (the device types: `import_types`) and logs
    the round's forward + backward of the whole model at microbatch 4."""
    measured = round_profiles(model, rnd)
    for g in sorted({g for _, g, _ in rnd.jobs}):
        new = [p for p in measured if p.gpu_type == g]
        tps = {p.tp for p in new}
        old = [p for p in store.read(LAYER_PROFILES, {"model": model, "gpu_type": g}) if p.tp not in tps]
        v0 = next(v for v, gg, _ in rnd.jobs if gg == g)
        store.replace_layer_profiles(model, g, old + new, provenance=_prov(v0, run))
        for tp in sorted(tps):
            total = sum(p.forward_s + p.backward_s for p in new if (p.tp, p.mbs) == (tp, 4))
            log(f"{g} tp {tp}: model fwd+bwd at mbs 4 {total:.3f} s")


def book_with(book: ProfileBook, profiles: Sequence[LayerProfile]) -> ProfileBook:
    """`book` with the layer profiles of (gpu type, mbs, tp) that `profiles` has replaced by them."""
    grouped: dict[tuple[str, int, int], list[LayerProfile]] = {}
    for p in profiles:
        grouped.setdefault((p.gpu_type, p.mbs, p.tp), []).append(p)
    return replace(book, layer_profiles={**book.layer_profiles,
                                         **{k: tuple(sorted(v, key=lambda x: x.layer)) for k, v in grouped.items()}})


def profile(tb: Testbed, vms: list[VmInfo], model: str, store: Any, work: Path, server: ControlServer,
            sc: Any) -> None:
    """The node links and the zone-pair links of the testbed into the store (the layers: `measure_layers`)."""
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    # the node's own link on each 2-device VM (not at the same time as a layer profile)
    node_jobs: list[tuple[VmInfo, list[str], Path]] = []
    for v in vms:
        if v.devices >= 2 and not any(n[0].gpu_type == v.gpu_type for n in node_jobs):
            dest = work / f"node-{v.gpu_type}"
            node_jobs.append((v, ["profile", "network", "--workers", "2", "--zone", v.zone, "--gpu-type", v.gpu_type,
                                  "--max-bytes", str(8 << 20), "--store", str(dest)], dest))
    log(f"node links on {[v.key for v, _, _ in node_jobs]}")
    run_on(tb, [(v, a) for v, a, _ in node_jobs], logs)
    for v, _, dest in node_jobs:
        src = open_store(str(dest), seed=False)
        store.write(INTRA_NODE_LINKS, [x for x in src.read(INTRA_NODE_LINKS) if x.gpu_type == v.gpu_type],
                                     provenance=_prov(v, "validate-testbed"))
        store.write(NODE_ALLREDUCE, [x for x in src.read(NODE_ALLREDUCE) if x.gpu_type == v.gpu_type],
                                   provenance=_prov(v, "validate-testbed"))
    # one link per zone pair (and inside a zone with two VMs), measured alone
    zones = list(dict.fromkeys(v.zone for v in vms))
    pairs = [(a, b) for i, a in enumerate(zones) for b in zones[i:]]
    for za, zb in pairs:
        a = next((v for v in vms if v.zone == za), None)
        b = next((v for v in vms if v.zone == zb and v is not a), None)
        if a is None or b is None:
            continue
        key = f"links/{za}/{zb}"
        dest = work / f"link-{za}-{zb}"
        ends = (f"{za}:{a.gpu_type}", f"{zb}:{b.gpu_type}")
        t0 = time.monotonic()
        run_on(tb, [(v, ["profile", "link", "--rank", str(r), "--from", ends[0], "--to", ends[1], "--key", key,
                         "--store", str(dest)]) for r, v in enumerate((a, b))],
               logs, env={"SAILOR_CONTROL": server.endpoint, SECRET_ENV: server.secret})
        src = open_store(str(dest), seed=False)
        measured = next(lk for lk in src.read(NETWORK_LINKS) if (lk.sender_zone, lk.receiver_zone) == (za, zb))
        rows = []
        for ga in sorted({v.gpu_type for v in vms if v.zone == za}):
            for gb in sorted({v.gpu_type for v in vms if v.zone == zb}):
                fwd = replace(measured, sender_zone=za, sender_gpu=ga, receiver_zone=zb, receiver_gpu=gb)
                rows += [fwd, replace(fwd, sender_zone=zb, sender_gpu=gb, receiver_zone=za, receiver_gpu=ga)]
        store.write(NETWORK_LINKS, rows, provenance=_prov(a, "validate-testbed", peer=b))
        ar = next(x for x in src.read(LINK_ALLREDUCE) if (x.zone_a, x.zone_b) == (za, zb))
        ars = [replace(ar, zone_a=r.sender_zone, gpu_a=r.sender_gpu, zone_b=r.receiver_zone, gpu_b=r.receiver_gpu)
               for r in rows]
        store.write(LINK_ALLREDUCE, ars, provenance=_prov(a, "validate-testbed", peer=b))
        shaped = tb.rate_gbps(za, zb) * 1e9 / 8
        fit = measured.fit
        log(f"link {za} <-> {zb}: fit at 256 KiB {fit.bandwidth_bytes_per_s(256 << 10) / 1e6:.1f} MB/s, "
            f"4 MiB {fit.bandwidth_bytes_per_s(4 << 20) / 1e6:.1f} MB/s (shaped {shaped / 1e6:.1f}) "
            f"in {time.monotonic() - t0:.0f} s")


# ------------------------------------------------------------------------------------------
# plans


def plans(vms: list[VmInfo], model: str) -> dict[str, ParallelPlan]:
    """Plans over the VMs of the geo scenario: names are (zone, type, devices) roles."""

    def find(zone_region: str, g: str, devices: int) -> VmInfo:
        for v in vms:
            if v.gpu_type == g and v.devices == devices and zone_region in (v.zone, v.region):
                return v
        raise SystemExit(f"the scenario has no {devices}-device {g} VM in {zone_region}; to fix: use geo-like "
                         f"scenarios (scenarios/geo.yaml)")

    def rep(v: VmInfo, tp: int = 1) -> Replica:
        return Replica(gpu_type=v.gpu_type, zone=v.zone, tp=tp, gpus_per_node=v.devices, market=Market.parse(v.market),
                       region=v.region)

    zones = list(dict.fromkeys(v.zone for v in vms))
    fast2 = find(zones[0], "cpu-fast", 2)
    slow_a = [v for v in vms if v.gpu_type == "cpu-slow" and v.region == fast2.region]
    slow_b = [v for v in vms if v.gpu_type == "cpu-slow" and v.region != fast2.region]
    fast1 = find(slow_b[0].region, "cpu-fast", 1)
    n1, n2 = rep(slow_a[0]), rep(slow_a[1])
    e1, e2 = rep(slow_b[0]), rep(slow_b[1])
    w2, w1 = rep(fast2, 2), rep(fast2)
    f1 = rep(fast1)

    def p(stages: list[tuple[tuple[int, int], list[Replica]]], pipes: Sequence[tuple[int, int]]) -> ParallelPlan:
        pb = tuple(PipelineBatch(microbatch_size=m, num_microbatches=n) for m, n in pipes)
        return ParallelPlan(model=model, global_batch_size=sum(x.samples for x in pb),
                            stages=tuple(Stage(first_layer=a, last_layer=b, replicas=tuple(r)) for (a, b), r in stages),
                            pipelines=pb)

    return {
        # tp 2 inside the 2-device VM, then across a region boundary to the other device type
        "tp2-west|fast-east": p([((0, 2), [w2]), ((3, 5), [f1])], [(4, 4)]),
        # three stages over three zones, both regions, mixed device types
        "tp2-west|slow-north|slow-east": p([((0, 2), [w2]), ((3, 4), [n1]), ((5, 5), [e1])], [(4, 4)]),
        # a data-parallel ring across the region boundary, mixed device types
        "dp2 north+east": p([((0, 5), [n1, f1])], [(4, 2), (4, 2)]),
        # two stages per pipeline, each stage's ring inside a zone, the pipeline across regions
        "2 stages x dp2, north|east": p([((0, 2), [n1, n2]), ((3, 5), [e1, e2])], [(4, 2), (4, 2)]),
        # two stages over two 1-device VMs of one zone (the shape a held-out testbed scenario ran at x1.32
        # of the flow's estimate)
        "2 stages north|north": p([((0, 2), [n1]), ((3, 5), [n2])], [(4, 4)]),
        # four stages over two regions, uneven
        "4 stages north,north|east,east": p([((0, 1), [n1]), ((2, 2), [n2]), ((3, 3), [e1]), ((4, 5), [e2])],
                                            [(4, 4)]),
        # dp 3 across both regions (ring crosses the boundary twice), mixed types
        "dp3 east+north+east": p([((0, 5), [f1, n1, e1])], [(4, 2), (4, 2), (4, 2)]),
        # two replicas inside the 2-device VM (node all-reduce), next stage across a zone boundary
        "dp2 in west VM|north": p([((0, 2), [w1, w1]), ((3, 5), [n1, n2])], [(4, 2), (4, 2)]),
        # fast east first, slow north second: the cross-region pipeline the other way round
        "fast-east|slow-north": p([((0, 3), [f1]), ((4, 5), [n1])], [(8, 3)]),
        # two replicas in the 2-device VM, then a ring over both device types in the other region
        "2 stages x dp2 mixed, west|east": p([((0, 2), [w1, w1]), ((3, 5), [e1, f1])], [(2, 4), (2, 4)]),
    }


def assign(plan: ParallelPlan, vms: list[VmInfo]) -> list[tuple[str, int, tuple[int, ...]]]:
    """VM ranks of the plan as the flow places it (tasks/jobs.nodes): node ids from place_nodes,
    ranks laid out stage by stage, replica by replica, TP rank by TP rank."""
    ids = place_nodes(plan)
    rank = 0
    node_ranks: dict[int, list[int]] = {}
    node_spec: dict[int, Replica] = {}
    for s, st in enumerate(plan.stages):
        for j, r in enumerate(st.replicas):
            node_ranks.setdefault(ids[s][j], []).extend(range(rank, rank + r.tp))
            node_spec[ids[s][j]] = r
            rank += r.tp
    free = list(vms)
    out = []
    for n in sorted(node_ranks):
        r = node_spec[n]
        v = next((v for v in free if v.zone == r.zone and v.gpu_type == r.gpu_type and v.devices == r.gpus_per_node
                  and v.market == r.market.value), None)
        if v is None:
            raise SystemExit(f"no free VM for node {n} ({r}); to fix: adjust the plan to the scenario's VMs")
        free.remove(v)
        out.append((v.key, v.devices, tuple(node_ranks[n])))
    return out


def train(tb: Testbed, server: ControlServer, gen: int, plan: ParallelPlan, vms: list[VmInfo], steps: int,
          work: Path, timeout_s: float) -> list[tuple[float, float]]:
    """(seconds, wall time it ended) of each step of the plan trained on the testbed (rank 0's metrics)."""
    placed = assign(plan, vms)
    settings = {"model": plan.model, "steps": steps, "timeout_s": 120, "plan_version": gen}
    members = assign_generation(server, gen, plan=plan_to_dict(plan), settings=settings, resume=False, vms=placed)
    by_key = {v.key: v for v in vms}
    procs = []
    try:
        for key, devices, _ in placed:
            v = by_key[key]
            run_dir = work / "runs" / f"g{gen}" / key
            run_dir.mkdir(parents=True, exist_ok=True)
            env = {SECRET_ENV: server.secret, "SAILOR_ADVERTISE_ADDR": v.vm.address, "OMP_NUM_THREADS": "1"}
            procs.append(tb.spawn(key, [SAILOR, "worker", "--control", server.endpoint, "--vm-id", key, "--devices",
                                        str(devices), "--first-generation", str(gen), "--run-dir", str(run_dir),
                                        "--heartbeat", "2", "--grace", "10"],
                                  env=env, log=work / "logs" / f"agent-g{gen}-{key}.log"))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = [server.get(status_key(gen, w)) for w in members]
            if all(status):
                break
            if any(s and s != "done" for s in status):
                break
            if all(pr.poll() is not None for pr in procs):
                time.sleep(1.0)  # the last status may still be on its way
                if not all(server.get(status_key(gen, w)) for w in members):
                    raise TestbedLost(f"generation {gen}: every agent exited before its workers reported "
                                       f"(was the testbed removed under us?); see {work / 'logs'}")
            time.sleep(0.5)
        status = [server.get(status_key(gen, w)) for w in members]
        if not all(s == "done" for s in status):
            raise RuntimeError(f"generation {gen} did not finish: {dict(zip(members, status, strict=True))}; "
                               f"see {work / 'logs'}")
        rows = sorted((json.loads(x) for x in server.read_list(metrics_key(gen))), key=lambda r: r["step"])
        log(f"generation {gen}: rank 0's step, median after the first: {step_parts(rows[1:])}")
        return [(float(r["iteration_time_s"]), float(r["time"])) for r in rows]
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.terminate()
        for pr in procs:
            try:
                pr.wait(15)
            except subprocess.TimeoutExpired:
                pr.kill()
                pr.wait()
        for key, _, _ in placed:
            tb.kill_processes(key)


# ------------------------------------------------------------------------------------------


class _Bed:
    """The testbed, its controller and its VMs; created again whole when another job's cleanup removed it."""

    def __init__(self, sc: Any) -> None:
        self.sc = sc
        self.tb = Testbed.create(run_id="validate-testbed", zones=[z for z, _ in sc.zones], link_gbps=sc.link_gbps)
        self.server = ControlServer(host=self.tb.host_address)
        self.vms: list[VmInfo] = []

    def recreate(self) -> None:
        """Tears the testbed and controller down and creates them again (same scenario); the VMs stay to build."""
        self.server.close()
        self.tb.teardown()
        time.sleep(5)
        self.tb = Testbed.create(run_id="validate-testbed", zones=[z for z, _ in self.sc.zones],
                                 link_gbps=self.sc.link_gbps)
        self.server = ControlServer(host=self.tb.host_address)


def main(argv: list[str] | None = None) -> int:
    """Profiles the testbed, trains each plan on it between short profile rounds, prints measured
    against simulated (see the module)."""
    args = _args(argv)
    if args.steps <= args.warmup:
        print(f"--steps {args.steps} leaves no step after --warmup {args.warmup}; to fix: --steps > --warmup",
              file=sys.stderr)
        return 2
    ok, why = testbed_support()
    if not ok:
        print(f"skipped: needs root: {why}", flush=True)
        return 0
    # `timeout` and the checks stop the bench with SIGTERM: leave through `finally`, which tears the testbed
    # down and removes the work folder (a killed pass left its folder in /tmp)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sc = load_scenario(args.scenario)
    work = Path(tempfile.mkdtemp(prefix="sailor-validate-testbed-"))
    (work / "logs").mkdir()
    store_dir = Path(args.store) if args.store else work / "store"
    store_dir.mkdir(parents=True, exist_ok=True)
    bed = _Bed(sc)
    clock: HostClock | None = None
    try:
        bed.vms = build(bed.tb, sc)
        cores = sum((sc.device_type(v.gpu_type).cpu_per_device or 0) * v.devices for v in bed.vms)
        log(f"testbed {bed.tb.tag}: {len(bed.vms)} VMs ({cores:.2f} cores of quota in all) in {len(sc.zones)} zones; "
            f"work folder {work}")
        if args.dry:
            describe(bed.vms, args.model)
            return 0
        chosen = plans(bed.vms, args.model)
        if args.only:
            names = [n.strip() for n in args.only.split(",")]
            unknown = [n for n in names if n not in chosen]
            if unknown:
                print(f"unknown plan(s) {unknown}; to fix: one of {list(chosen)}", file=sys.stderr)
                return 2
            chosen = {n: chosen[n] for n in names}
        clock = HostClock(work / "host-clock.txt")
        store, types = _profiled_store(bed, args.model, store_dir, work)
        runs = _measure(bed, chosen, store.profile_book(args.model, types), args, work, clock)
        compare(chosen, runs, clock.samples(), args.max_drift_pct)
        return 0
    finally:
        if clock is not None:
            clock.close()
        bed.server.close()
        bed.tb.teardown()
        if os.environ.get("SAILOR_KEEP_WORK") != "1":
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"kept {work}")


def describe(vms: Sequence[VmInfo], model: str) -> None:
    """Prints every VM with the CFS period and quota of its cgroup and of each device's, and which
    plans fit the scenario (`--dry`)."""
    print(f"{'vm':<12} {'zone':<10} {'type':<10} {'devices':>7}  cgroup period/quota us (VM; devices)")
    for v in vms:
        groups = [Path(v.vm.cgroup)] + [Path(v.vm.cgroup) / f"dev{i}" for i in range(v.devices)] if v.vm.cgroup else []
        cfs = [f"{(g / 'cpu.cfs_period_us').read_text().strip()}/{(g / 'cpu.cfs_quota_us').read_text().strip()}"
               for g in groups]
        print(f"{v.key:<12} {v.zone:<10} {v.gpu_type:<10} {v.devices:>7}  {cfs[0] if cfs else '-'}; "
              f"{' '.join(cfs[1:])}")
    try:
        print(f"plans that fit: {', '.join(plans(list(vms), model))}")
    except SystemExit as e:
        print(f"plans that fit: none ({e})")


def _args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module's usage)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default=str(ROOT / "bench" / "validate_testbed.yaml"))
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    ap.add_argument("--store", default=None, help="a profile store folder: reuse its links and device types if it "
                                                  "has them, else measure into it (default: a fresh temporary one)")
    ap.add_argument("--only", default="", help="comma-separated plan names (default: all)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per plan")
    ap.add_argument("--sweeps", type=int, default=2,
                    help="runs of each plan, in passes over the list (every other one backwards); the median "
                         "step is taken over all of them (default 2)")
    ap.add_argument("--max-drift-pct", type=float, default=10.0,
                    help="a run is repeated when its rounds before and after simulate it this many %% apart, or "
                         "the host clock during its steps reads this many %% off its rounds' (default 10)")
    ap.add_argument("--repeats", type=int, default=4,
                    help="runs repeated for drift, in all (default 4; 0: keep every run, flagged)")
    ap.add_argument("--budget-min", type=float, default=25.0,
                    help="no run is repeated for drift once the bench has run this long (default 25: the whole "
                         "bench ends within about half an hour on a 2-core machine whatever the host does)")
    ap.add_argument("--dry", action="store_true", help="build the testbed, print its VMs, quotas and the plans "
                                                       "that fit, and tear it down")
    args = ap.parse_args(argv)
    args.started_at = time.time()
    return args


def _profiled_store(bed: _Bed, model: str, store_dir: Path, work: Path) -> tuple[Any, list[str]]:
    """(the store at store_dir with the model, the device types and the links; the VM types): found there,
    they are reused, else one full round of layers is taken (the device types and framework memory come
    from it) and the links are measured into it. The rounds each run is simulated from come later."""
    from sailor_core.models.config import get_config, model_spec

    store = open_store(str(store_dir), seed=False)
    if model not in store.model_names():
        store.write(MODELS, [model_spec(get_config(model))])
    types = sorted({v.gpu_type for v in bed.vms})
    have = {p.gpu_type for p in store.read(LAYER_PROFILES, {"model": model, "gpu_type": types})}
    if have == set(types) and store.read(NETWORK_LINKS):
        log(f"profiles of {types} and {len(store.read(NETWORK_LINKS))} links found in {store_dir}: reused")
        return store, types
    first = measure_layers(bed.tb, bed.vms, model, work, "round0")
    import_types(store, first, "validate-testbed")  # before the links name them
    import_layers(store, model, first, "validate-testbed")
    profile(bed.tb, bed.vms, model, store, work, bed.server, bed.sc)
    return store, types


def sweep_order(names: list[str], sweeps: int) -> list[str]:
    """The order the plans train in: `sweeps` passes over them, every other one backwards, so each
    plan's runs lie at different times of the bench (minutes apart) and its median step spans them."""
    return [n for k in range(max(1, sweeps)) for n in (names if k % 2 == 0 else names[::-1])]


def _train_retrying(bed: _Bed, gen: int, plan: ParallelPlan, steps: int, work: Path, timeout: float
                    ) -> list[tuple[float, float]]:
    """The plan's step times, trained up to three times: another testbed's stale cleanup on this shared
    machine can remove ours, which is then built again (same scenario, VM names and quotas)."""
    for _ in range(2):
        try:
            return train(bed.tb, bed.server, gen, plan, bed.vms, steps, work, timeout)
        except (TestbedLost, TestbedError) as e:
            log(f"{e}; building the testbed again")
            bed.recreate()
            try:
                bed.vms = build(bed.tb, bed.sc)
            except TestbedError as again:
                log(f"building it failed too ({again}); next attempt")
    return train(bed.tb, bed.server, gen, plan, bed.vms, steps, work, timeout)  # the last try: a failure ends it


# ------------------------------------------------------------------------------------------
# runs between rounds


@dataclass(frozen=True)
class Estimate:
    """A run's simulated iteration time from the mean of its adjacent rounds, and from each alone."""

    iteration_s: float
    before_s: float
    after_s: float
    p2p_s: float = 0.0
    dp_exposed_s: float = 0.0

    @property
    def rounds_apart_pct(self) -> float:
        """How far the round before and the round after alone simulate the run apart (% of the lower)."""
        return abs(self.after_s - self.before_s) / min(self.after_s, self.before_s) * 100


@dataclass(frozen=True)
class Run:
    """One kept run of a plan: its steps after the warm-up ((seconds, wall time it ended) each), when it
    started and ended (wall time: before its agents started, after they exited), the rounds of layer
    profiles just before and just after it, the estimate from them, the runs of it thrown away for drift
    before this one, and the drift it was kept with when no repeat was left ('' when none)."""

    name: str
    steps: list[tuple[float, float]]
    start: float
    end: float
    before: Any  # a LayerRound (anything with .start and .end in the tests)
    after: Any
    sim: Estimate
    discarded: int = 0
    drift: str = ""

    @property
    def steps_window(self) -> tuple[float, float]:
        """From the first kept step's start to the last one's end (wall time)."""
        return min(end - dt for dt, end in self.steps), max(end for _, end in self.steps)


def estimate(plan: ParallelPlan, book: ProfileBook, before: Sequence[LayerProfile], after: Sequence[LayerProfile]
             ) -> Estimate:
    """The plan simulated from the mean of two rounds' layer profiles (`median_profiles` of two), and from
    each round alone; links, device types and the rest from `book`. Nothing else: not the run's steps,
    not the host clock. Every (type, tp, microbatch) the plan reads must be in both rounds."""
    for which, profiles in (("before", before), ("after", after)):
        lacking = plan_points(plan) - {(p.gpu_type, p.tp, p.mbs) for p in profiles}
        if lacking:
            raise ValueError(f"the round {which} the run lacks the layer profiles of {sorted(lacking)}")
    sim = simulate(plan, book_with(book, median_profiles([before, after])))
    return Estimate(iteration_s=sim.iteration_time_s,
                    before_s=simulate(plan, book_with(book, before)).iteration_time_s,
                    after_s=simulate(plan, book_with(book, after)).iteration_time_s,
                    p2p_s=sim.breakdown.pipeline_p2p_s, dp_exposed_s=sim.breakdown.dp_sync_exposed_s)


def clock_apart_pct(samples: Sequence[tuple[float, float]], run: Run) -> float | None:
    """How far the host clock during the run's kept steps reads from the clock during its two rounds
    (% of the latter); None when either window has too few samples."""
    during = speed_over(samples, [run.steps_window])
    rounds = speed_over(samples, [(run.before.start, run.before.end), (run.after.start, run.after.end)])
    return None if during is None or rounds is None else abs(during / rounds - 1) * 100


def step_parts(rows: Sequence[dict[str, Any]]) -> str:
    """Where rank 0's steps went (the runtime's per-step parts, median over `rows`): printed beside a run,
    never read by an estimate."""
    parts = ("pipeline_s", "grad_sync_s", "agree_s", "optimizer_s")
    if not rows or any(p not in rows[0] for p in parts):
        return "-"
    return " ".join(f"{p[:-2]} {statistics.median(float(r[p]) for r in rows):.3f}" for p in parts)


def drift(run: Run, samples: Sequence[tuple[float, float]], bound_pct: float) -> str:
    """Why the host drifted beyond `bound_pct` over the run ('' if it did not): its rounds disagree on
    it, or the clock during its steps is off the clock during its rounds."""
    why = []
    if run.sim.rounds_apart_pct > bound_pct:
        why.append(f"rounds {run.sim.rounds_apart_pct:.0f} % apart ({run.sim.before_s:.3f} / {run.sim.after_s:.3f} s)")
    off = clock_apart_pct(samples, run)
    if off is not None and off > bound_pct:
        why.append(f"host clock {off:.0f} % off its rounds'")
    return ", ".join(why)


def measure_runs(queue: Sequence[str], *, train_run: Callable[[str], list[tuple[float, float]]],
                 take_round: Callable[[Sequence[str]], Any], estimate_run: Callable[[str, Any, Any], Estimate],
                 drifted: Callable[[Run], str], repeats: int, now: Callable[[], float] = time.time,
                 repeat_until: float = float("inf")) -> list[Run]:
    """Runs the plans of `queue` in order, each between two rounds of layer profiles: `take_round(names)`
    profiles what the named plans read, once before the first run and once after each run (for it and
    the next in line: the round after one run is the round before the next). Each run is estimated from
    its two rounds (`estimate_run(name, before, after)`), never from what was measured during it. A run
    `drifted` says drifted is thrown away and run again between fresh rounds, `repeats` times in all and
    only while `now()` is before `repeat_until` (the bench's time budget: a host that drifts all along
    must not keep it running); after that, runs are kept with their drift noted. Returns the kept runs,
    in order."""
    runs: list[Run] = []
    if not queue:
        return runs
    left, thrown = repeats, 0
    before = take_round([queue[0]])
    k = 0
    while k < len(queue):
        name = queue[k]
        t0 = now()
        steps = train_run(name)
        t1 = now()
        after = take_round([name, *queue[k + 1:k + 2]])
        run = Run(name, steps, t0, t1, before, after, estimate_run(name, before, after), discarded=thrown)
        why = drifted(run)
        if why and left > 0 and now() < repeat_until:
            left, thrown = left - 1, thrown + 1
            log(f"{name}: {why}; run again between fresh rounds ({left} repeats left)")
        else:
            runs.append(replace(run, drift=why))
            k, thrown = k + 1, 0
        before = after
    return runs


def _measure(bed: _Bed, chosen: dict[str, ParallelPlan], book: ProfileBook, args: argparse.Namespace, work: Path,
             clock: HostClock) -> list[Run]:
    """`measure_runs` on the testbed: the plans trained in sweeps, short rounds of what they read."""
    gens = iter(range(1_000_000))
    rounds = iter(range(1, 1_000_000))

    def train_run(name: str) -> list[tuple[float, float]]:
        steps = _train_retrying(bed, next(gens), chosen[name], args.steps, work, args.timeout)[args.warmup:]
        log(f"{name}: median step {statistics.median(dt for dt, _ in steps):.3f} s")
        return steps

    def take_round(names: Sequence[str]) -> LayerRound:
        points = set().union(*(plan_points(chosen[n]) for n in names))
        return measure_layers(bed.tb, bed.vms, args.model, work, f"round{next(rounds)}", points)

    def estimate_run(name: str, before: LayerRound, after: LayerRound) -> Estimate:
        est = estimate(chosen[name], book, round_profiles(args.model, before), round_profiles(args.model, after))
        log(f"{name}: simulated {est.iteration_s:.3f} s (round before {est.before_s:.3f}, after {est.after_s:.3f})")
        return est

    return measure_runs(sweep_order(list(chosen), args.sweeps), train_run=train_run, take_round=take_round,
                        estimate_run=estimate_run, drifted=lambda r: drift(r, clock.samples(), args.max_drift_pct),
                        repeats=args.repeats, repeat_until=args.started_at + 60.0 * args.budget_min)


def compare(chosen: dict[str, ParallelPlan], runs: Sequence[Run], samples: Sequence[tuple[float, float]],
            bound_pct: float) -> None:
    """Prints every plan's measured median step (over the kept steps of all its runs) against its
    simulation (the mean of its runs' estimates, each from the rounds around that run), then the last
    line. Beside them, printed only: the most its runs' rounds disagreed, the host clock during its
    steps, the runs thrown away for drift, and the drift a run was kept with when no repeat was left."""
    print(f"{'plan':<34} {'stages':>6} {'dp':>3} {'measured s':>10} {'sim s':>8} {'err%':>7}  (sim: p2p dp-exposed)"
          f"  rounds apart %  clock ms  repeated  steps")
    errors = []
    for name, plan in chosen.items():
        mine = [r for r in runs if r.name == name]
        real = statistics.median(dt for r in mine for dt, _ in r.steps)
        sim = statistics.mean(r.sim.iteration_s for r in mine)
        errors.append((sim - real) / real * 100)
        speed = speed_over(samples, [r.steps_window for r in mine])
        kept = "; ".join(f"kept with {r.drift}" for r in mine if r.drift)
        print(f"{name:<34} {len(plan.stages):>6} {len(plan.pipelines):>3} {real:>10.3f} {sim:>8.3f} {errors[-1]:>+7.1f}"
              f"  ({statistics.mean(r.sim.p2p_s for r in mine):.3f} "
              f"{statistics.mean(r.sim.dp_exposed_s for r in mine):.3f})"
              f"  {max(r.sim.rounds_apart_pct for r in mine):>14.1f}  {f'{speed:.3f}' if speed else '-':>8}"
              f"  {sum(r.discarded for r in mine):>8}  {' '.join(f'{dt:.2f}' for r in mine for dt, _ in r.steps)}"
              f"{'  (' + kept + ')' if kept else ''}", flush=True)
    over = sum(1 for r in runs if r.drift)
    print(f"runs: {len(runs)} kept, {sum(r.discarded for r in runs)} repeated for drift over {bound_pct:g} %, "
          f"{over} kept beyond it (no repeat left)")
    print(f"mean_abs_error_pct={statistics.mean(map(abs, errors)):.1f} "
          f"worst_abs_error_pct={max(map(abs, errors)):.1f} plans={len(errors)}")


if __name__ == "__main__":
    sys.exit(main())
