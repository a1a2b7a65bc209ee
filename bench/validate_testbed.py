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
takes the median iteration time of the steps after `--warmup` over its runs (rank 0's metrics list),
simulates the same plan from the store, and prints the error. The layer profiles are taken again
between and after the sweeps (`--profile-rounds`).

The testbed's devices are CPU quotas of a host whose speed moves by up to ~40 % within minutes (a
GPU's clock does not). A host clock beside the testbed (`HostClock`: a fixed unit of CPU work timed
every 0.1 s) reads that speed during each profile round and each plan's kept steps, and each plan is
simulated from the layer profiles at the speed its steps ran at (`unit_speed_profiles`, `at_speed`):
each round's times divided by the clock during the round, their median, times the clock during the
plan's steps. Only compute is scaled; links are shaped by `tc` and measured once. Beside each error
the bench prints the error of the profiles as measured (the rounds' median, the host's speed left as
it was), and their mean and worst before the last line.
Everything is torn down at the end, also on an error or Ctrl-C. The last line:

    mean_abs_error_pct=X worst_abs_error_pct=Y plans=N

    sudo .venv/bin/python bench/validate_testbed.py [--scenario bench/validate_testbed.yaml] [--model gpt-tiny]
        [--steps 9] [--warmup 3] [--sweeps 2] [--profile-rounds 3] [--store DIR (reuse profiles measured
        before)] [--only NAME,...]

The quotas of every VM together are the scenario's `cpu_budget_cores` (2 on geo.yaml). The machine
is shared: other jobs on its cores slow a VM below its quota, which neither the profiles nor the
simulator know about.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
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
    steps or the minute of a profile round moves by tens of percent within minutes. A GPU's clock
    does not. `speed_over` reads the unit's mean CPU time in given windows."""

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


def at_speed(profiles: Sequence[LayerProfile], factor: float) -> list[LayerProfile]:
    """The layer profiles' times (forward, backward, optimizer: CPU work) with the host `factor` times
    slower than when they were measured."""
    return [replace(p, forward_s=p.forward_s * factor, backward_s=p.backward_s * factor,
                    optimizer_s=p.optimizer_s * factor) for p in profiles]


# ------------------------------------------------------------------------------------------
# testbed


def build(tb: Testbed, sc: Any) -> list[VmInfo]:
    out = []
    for o in sc.offerings:
        quota = sc.device_type(o.gpu_type).cpu_per_device
        for i in range(o.count):
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
        set_cpu_share(cgroup / f"dev{i}", cores / devices, MIN_QUOTA_US)


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


def measure_layers(tb: Testbed, vms: list[VmInfo], model: str, work: Path, tag: str) -> LayerRound:
    """One round of layer profiles, all at once as the flow's profile subflow runs them: tp 1 on a
    1-device VM of each type, tp 2 on a 2-device VM. Every rank is bound to its own device's CPU share
    (sailor_core/runtime/devices.py), and the profiler's times are that device's. Returns (VM, type,
    store folder) per job, and the round's start and end."""
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    jobs, where = [], []
    for g in sorted({v.gpu_type for v in vms}):
        one = next((v for v in vms if v.gpu_type == g and v.devices == 1), None)
        two = next((v for v in vms if v.gpu_type == g and v.devices >= 2), None)
        for v, tp in ((one, "1"), (two, "2")):
            if v is None:
                continue
            dest = work / f"layers-{tag}-{g}-tp{tp}"
            jobs.append((v, ["profile", "model", "--model", model, "--device", "cpu", "--gpu-type", g, "--tp", tp,
                             "--mbs", PROFILE_MBS, "--json", "--store", str(dest)]))
            where.append((v, g, dest))
    t0 = time.time()
    run_on(tb, jobs, logs)
    t1 = time.time()
    log(f"layer profiles ({tag}) on {[f'{v.key} {g}' for v, g, _ in where]} in {t1 - t0:.0f} s")
    return LayerRound(where, t0, t1)


def median_profiles(rounds: Sequence[Sequence[LayerProfile]]) -> list[LayerProfile]:
    """Per (mbs, tp, layer), the median of each time over the rounds that measured it.

    The testbed's devices are CPU quotas of a shared host whose speed wanders by 10-15 % over minutes
    (docs/simulator.md): one round, taken in one minute, stands for runs over the next ten. Rounds
    before, between and after the plans, and their median, keep one slow or fast minute from
    deciding every plan's simulation. A GPU keeps its speed; the flow profiles once."""
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
        out += open_store(str(dest), seed=False).layer_profiles(model, [g])  # seconds of the bound device
    return out


def import_types(store: Any, rnd: LayerRound, run: str) -> None:
    """Writes the device types and framework memory one round of layer profiles measured, as
    flows/profiling.py imports a VM's store."""
    for v, g, dest in rnd.jobs:
        src = open_store(str(dest), seed=False)
        store.write_gpu_types([src.gpu_types()[g]], provenance=_prov(v, run))
        if g in src.framework_overhead() and v.devices == 1:
            store.write_framework_overhead({g: src.framework_overhead()[g]}, provenance=_prov(v, run))


def import_layers(store: Any, model: str, rounds: Sequence[LayerRound], run: str) -> None:
    """Writes the layer profiles of every round into the store (their median per point, `median_profiles`;
    the device types: `import_types`) and logs each round's forward + backward of the whole model at
    microbatch 4."""
    measured = [round_profiles(model, r) for r in rounds]
    for g in sorted({g for _, g, _ in rounds[0].jobs}):
        new = median_profiles([[p for p in r if p.gpu_type == g] for r in measured])
        tps = {p.tp for p in new}
        old = [p for p in store.layer_profiles(model, [g]) if p.tp not in tps]
        v0 = next(v for v, gg, _ in rounds[0].jobs if gg == g)
        prov = _prov(v0, f"{run}, median of {len(rounds)} rounds")
        store.replace_layer_profiles(model, g, old + new, provenance=prov)
        for tp in sorted(tps):
            each = [sum(p.forward_s + p.backward_s for p in r if (p.gpu_type, p.tp, p.mbs) == (g, tp, 4))
                    for r in measured]
            log(f"{g} tp {tp}: model fwd+bwd at mbs 4 per round {' '.join(f'{x:.3f}' for x in each)} s")


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
        store.write_intra_node_links([x for x in src.intra_node_links() if x.gpu_type == v.gpu_type],
                                     provenance=_prov(v, "validate-testbed"))
        store.write_node_allreduce([x for x in src.node_allreduce() if x.gpu_type == v.gpu_type],
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
        measured = next(lk for lk in src.network_links() if (lk.sender_zone, lk.receiver_zone) == (za, zb))
        rows = []
        for ga in sorted({v.gpu_type for v in vms if v.zone == za}):
            for gb in sorted({v.gpu_type for v in vms if v.zone == zb}):
                fwd = replace(measured, sender_zone=za, sender_gpu=ga, receiver_zone=zb, receiver_gpu=gb)
                rows += [fwd, replace(fwd, sender_zone=zb, sender_gpu=gb, receiver_zone=za, receiver_gpu=ga)]
        store.write_network_links(rows, provenance=_prov(a, "validate-testbed", peer=b))
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
        rows = [json.loads(x) for x in server.read_list(metrics_key(gen))]
        return [(float(r["iteration_time_s"]), float(r["time"])) for r in sorted(rows, key=lambda r: r["step"])]
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
    """Profiles the testbed, trains each plan on it, prints measured against simulated (see the module)."""
    args = _args(argv)
    if args.steps <= args.warmup:
        print(f"--steps {args.steps} leaves no step after --warmup {args.warmup}; to fix: --steps > --warmup",
              file=sys.stderr)
        return 2
    ok, why = testbed_support()
    if not ok:
        print(f"cannot build the testbed here: {why}; to fix: run as root", file=sys.stderr)
        return 2
    sc = load_scenario(args.scenario)
    work = Path(tempfile.mkdtemp(prefix="sailor-validate-testbed-"))
    (work / "logs").mkdir()
    store_dir = Path(args.store) if args.store else work / "store"
    store_dir.mkdir(parents=True, exist_ok=True)
    bed = _Bed(sc)
    clock = HostClock(work / "host-clock.txt")
    try:
        bed.vms = build(bed.tb, sc)
        cores = sum((sc.device_type(v.gpu_type).cpu_per_device or 0) * v.devices for v in bed.vms)
        log(f"testbed {bed.tb.tag}: {len(bed.vms)} VMs ({cores:.1f} cores of quota in all) in {len(sc.zones)} zones; "
            f"work folder {work}")
        store, types, rounds = _profiled_store(bed, args.model, store_dir, work)
        chosen = plans(bed.vms, args.model)
        if args.only:
            names = [n.strip() for n in args.only.split(",")]
            unknown = [n for n in names if n not in chosen]
            if unknown:
                print(f"unknown plan(s) {unknown}; to fix: one of {list(chosen)}", file=sys.stderr)
                return 2
            chosen = {n: chosen[n] for n in names}
        runs = sweep_order(list(chosen), args.sweeps)
        later = profile_points(len(runs), args.profile_rounds) if rounds else set()
        kept: dict[str, list[tuple[float, float]]] = {name: [] for name in chosen}
        for gen, name in enumerate(runs):
            steps = _train_retrying(bed, gen, chosen[name], args.steps, work, args.timeout)[args.warmup:]
            kept[name] += steps
            speed = speed_over(clock.samples(), [(end - dt, end) for dt, end in steps])
            log(f"{name}: median step {statistics.median(dt for dt, _ in steps):.3f} s, host clock unit "
                f"{speed or float('nan'):.3f} ms")
            if gen in later:
                rounds.append(measure_layers(bed.tb, bed.vms, args.model, work, f"round{len(rounds)}"))
        if rounds:
            import_layers(store, args.model, rounds, "validate-testbed")
        compare(chosen, store.profile_book(args.model, types), kept, rounds, clock.samples())
        return 0
    finally:
        clock.close()
        bed.server.close()
        bed.tb.teardown()
        if os.environ.get("SAILOR_KEEP_WORK") != "1":
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"kept {work}")


def _args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module's usage)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default=str(ROOT / "bench" / "validate_testbed.yaml"))
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    ap.add_argument("--store", default=None, help="a profile store folder: reuse its profiles if it has them, "
                                                  "else measure into it (default: a fresh temporary one)")
    ap.add_argument("--only", default="", help="comma-separated plan names (default: all)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per plan")
    ap.add_argument("--sweeps", type=int, default=2,
                    help="runs of each plan, in passes over the list (every other one backwards); the median "
                         "step is taken over all of them (default 2)")
    ap.add_argument("--profile-rounds", type=int, default=3,
                    help="rounds of layer profiles (before, between and after the plans), their median "
                         "simulated (default 3; 1: before the plans only)")
    return ap.parse_args(argv)


def _profiled_store(bed: _Bed, model: str, store_dir: Path, work: Path
                    ) -> tuple[Any, list[str], list[LayerRound]]:
    """(the store at store_dir with the model and the links, the VM types, the layer-profile rounds
    measured so far): profiles found there are reused (no rounds: the store's layers are used as they
    are), else the links are measured into it and the first round of layers is taken."""
    from sailor_core.models.config import get_config, model_spec

    store = open_store(str(store_dir), seed=False)
    if model not in store.model_names():
        store.write_model(model_spec(get_config(model)))
    types = sorted({v.gpu_type for v in bed.vms})
    have = {p.gpu_type for p in store.layer_profiles(model, types)}
    if have == set(types) and store.network_links():
        log(f"profiles of {types} and {len(store.network_links())} links found in {store_dir}: reused")
        return store, types, []
    first = measure_layers(bed.tb, bed.vms, model, work, "round0")
    import_types(store, first, "validate-testbed")  # before the links name them
    import_layers(store, model, [first], "validate-testbed")
    profile(bed.tb, bed.vms, model, store, work, bed.server, bed.sc)
    return store, types, [first]


def sweep_order(names: list[str], sweeps: int) -> list[str]:
    """The order the plans train in: `sweeps` passes over them, every other one backwards, so each
    plan's runs lie at different times of the bench (minutes apart) and its median step spans them."""
    return [n for k in range(max(1, sweeps)) for n in (names if k % 2 == 0 else names[::-1])]


def profile_points(plans: int, rounds: int) -> set[int]:
    """Indices of the plans after which another round of layer profiles is taken: `rounds` in all
    with the one before the first plan, spread evenly, the last after the last plan."""
    if rounds <= 1 or plans == 0:
        return set()
    return {max(0, round(i * plans / (rounds - 1)) - 1) for i in range(1, rounds)}


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


def unit_speed_profiles(model: str, rounds: Sequence[LayerRound], samples: Sequence[tuple[float, float]]
                        ) -> list[LayerProfile] | None:
    """The layer times on a host of unit speed: each round's profiles divided by the host clock's unit
    during that round (`speed_over` its window), their median per point (`median_profiles`). None
    without rounds or when a round has too few clock samples."""
    scaled = []
    for r in rounds:
        k = speed_over(samples, [(r.start, r.end)])
        if k is None:
            return None
        scaled.append(at_speed(round_profiles(model, r), 1.0 / k))
    return median_profiles(scaled) if scaled else None


def compare(chosen: dict[str, ParallelPlan], book: ProfileBook, kept: dict[str, list[tuple[float, float]]],
            rounds: Sequence[LayerRound], samples: Sequence[tuple[float, float]]) -> None:
    """Prints every plan's measured median step against its simulation, then the last line.

    The simulation takes the layer profiles at the host's speed during the plan's kept steps: the
    unit-speed profiles (`unit_speed_profiles`) times the clock's unit over those steps. Beside it,
    the error of the profiles as measured (the rounds' median, the host's speed left as it was).
    Without the clock (a reused store, too few samples) only the latter is printed and used."""
    unit = unit_speed_profiles(book.model.name, rounds, samples)
    print(f"{'plan':<34} {'stages':>6} {'dp':>3} {'measured s':>10} {'sim s':>8} {'err%':>7}  "
          f"(sim: p2p {'':>1}dp-exposed){'  host clock ms, err% as measured' if unit else ''}")
    errors, raw = [], []
    for name, plan in chosen.items():
        real = statistics.median(dt for dt, _ in kept[name])
        as_measured = simulate(plan, book)
        raw.append((as_measured.iteration_time_s - real) / real * 100)
        speed = speed_over(samples, [(end - dt, end) for dt, end in kept[name]]) if unit else None
        sim = simulate(plan, book_with(book, at_speed(unit, speed))) if unit and speed else as_measured
        errors.append((sim.iteration_time_s - real) / real * 100)
        b = sim.breakdown
        beside = "" if not unit else f"  {speed:.3f} {raw[-1]:+7.1f}" if speed else "  (too few clock samples)"
        print(f"{name:<34} {len(plan.stages):>6} {len(plan.pipelines):>3} {real:>10.3f} "
              f"{sim.iteration_time_s:>8.3f} {errors[-1]:>+7.1f}  ({b.pipeline_p2p_s:.3f} {b.dp_sync_exposed_s:.3f})"
              f"{beside} steps {' '.join(f'{dt:.2f}' for dt, _ in kept[name])}", flush=True)
    if unit:
        print(f"profiles as measured, without the host clock: mean |error| {statistics.mean(map(abs, raw)):.1f} %, "
              f"worst {max(map(abs, raw)):.1f} %")
    print(f"mean_abs_error_pct={statistics.mean(map(abs, errors)):.1f} "
          f"worst_abs_error_pct={max(map(abs, errors)):.1f} plans={len(errors)}")


if __name__ == "__main__":
    sys.exit(main())
