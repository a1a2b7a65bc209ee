"""Network profiler: point-to-point and all-reduce time between local workers, fitted as the store wants.

Contract: `profile_network(settings, progress=None) -> NetworkProfile` spawns `settings.workers`
processes joined by torch.distributed (gloo on CPU, nccl on CUDA, one GPU per worker) and, for
message sizes from `min_bytes` to `max_bytes` (each step x`factor`), times
- point-to-point: a ping-pong between ranks 0 and 1, half the round trip (one send as a pipeline
  stage sees it; timing one side of a one-way send would time the local copy into the socket);
- all-reduce: a sum over all workers, started right after a barrier.
Warm-up repetitions are excluded and each size repeats until its relative standard error is small
or its time cap is spent (timing.RepeatPolicy); rank 0 decides and broadcasts when to stop so every
worker runs the same number of collectives. Each size is summarised by a low percentile of its
repetitions (`statistic`, see DEFAULT_STATISTIC: the 20th), and fitted:
- `link`: a `NetworkLink` (both ends labelled with zone, GPU type and count 1 GPU per worker) whose
  `BandwidthFit` predicts one point-to-point transfer of x bytes: the store's quadratic in
  u = log2(x/1e6) (fit.fit_bandwidth) or a line t = alpha + x / beta (fit.fit_line), whichever
  follows the measured sizes better (`best_fit`);
- `intra_node`: the same fit as an `IntraNodeLink` for 2 GPUs of the node, since the workers share
  one machine and the simulator reads a same-node transfer (pipeline send or ring all-reduce hop)
  from the 2-GPU intra-node fit as a GPU pair's bandwidth;
- `node_allreduce` (its fit also as `allreduce_fit`): the measured all-reduce of x bytes over all workers in the
  same form (algorithm bandwidth x / time), stored as the node's all-reduce for that many workers:
  the simulator uses it for a data-parallel group inside one node of this GPU type (elsewhere it
  composes rings from pair hops, 2(D-1) t(x/D), which on gloo is 1.5-2x optimistic, except over a link
  whose own all-reduce `sailor profile link` measured: `measure_link` with `allreduce` on);
- alpha-beta (latency, bandwidth) for both, kept with the profile and in its provenance.
Nothing is written anywhere: the caller stores the result (see sailor_core.profiler.save).
Labels: two local workers are one zone and one GPU type. `network_worker` takes its rendezvous
(`init_method`) as an argument, so a link between two machines is measured by running it on each
(`measure_link`, which `sailor profile link` calls).
"""

from __future__ import annotations

import json
import math
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any

from sailor_core.domain import (
    FIT_MAX_LOG2_MB,
    BandwidthFit,
    IntraNodeLink,
    NetworkLink,
    NodeAllReduce,
    Provenance,
)
from sailor_core.errors import SailorError
from sailor_core.profiler.env import check_device, default_gpu_type, provenance
from sailor_core.profiler.fit import AlphaBeta, fit_alpha_beta, fit_bandwidth, fit_line, max_abs, relative_errors
from sailor_core.profiler.spawn import run_workers
from sailor_core.profiler.timing import Measurement, RepeatPolicy, StopRule, check_statistic
from sailor_core.runtime.devices import bind_device

if TYPE_CHECKING:  # torch is imported in the workers only
    from torch import Tensor
    from torch import device as TorchDevice

_Row = tuple[int, Measurement, Measurement]  # message bytes, point-to-point, all-reduce

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
DEFAULT_MIN_BYTES = 64 * KIB  # the range: 64 KiB ...
DEFAULT_MAX_BYTES_CUDA = 1 * GIB  # ... to 1 GiB on GPUs
# On CPU the models a CPU plan trains (gpt-tiny, gpt-small) never send more than ~20 MB at once
# (gpt-small's whole gradient); 64 MiB covers that with margin, reaches the DRAM-bound part of the
# loopback curve, and keeps the profile near 15 s on a shared 2-core machine (256 MiB took 45 s).
DEFAULT_MAX_BYTES_CPU = 64 * MIB
# Per size: `warmup` unrecorded repetitions at each visit, then REPS_PER_VISIT recorded ones; stop at
# min_reps..max_reps recorded repetitions, a 1% relative standard error, or 3 s spent on the size.
# A percentile needs samples: on the dev box, three profiles with at most 60 repetitions per size
# fitted their own points within 12-15 % at worst; with up to 150, within 9-11 % (18 s in all).
DEFAULT_POLICY = RepeatPolicy(warmup=1, min_reps=30, max_reps=150, rel_err=0.01, time_cap_s=3.0)
# Between two rented VMs, over links as slow as 100 Mbit/s: fewer repetitions, a shorter cap per size.
LINK_POLICY = RepeatPolicy(warmup=1, min_reps=6, max_reps=60, rel_err=0.02, time_cap_s=1.5)
REPS_PER_VISIT = 3
# The statistic a size is summarised by: the 20th percentile of its repetitions. On a shared host a
# transfer larger than the socket buffer needs both workers on a core at once; when they are not,
# it waits a scheduler time slice (~1 ms here) and the samples turn bimodal (on the 2-core dev box,
# at 1 MiB, the quartiles were 0.42 and 2.0 ms), so the median and the mean flip between the link's
# speed and the scheduler's. The low end measures the link; the fastest single repetition is too
# lucky to repeat. Three back-to-back profiles on the dev box: a quadratic fitted to each run's
# fastest repetitions missed that run by up to 13-19 % and the other runs by up to 34 %; fitted to
# the 20th percentiles, 8-12 % and 20 %.
DEFAULT_STATISTIC = "p20"


@dataclass(frozen=True, kw_only=True)
class NetworkSettings:
    workers: int = 2
    device: str = "cpu"
    min_bytes: int = DEFAULT_MIN_BYTES
    max_bytes: int | None = None  # None: the device's default above
    factor: int = 2
    zone: str = "local"
    gpu_type: str | None = None  # None: derived from the device (env.default_gpu_type)
    policy: RepeatPolicy = field(default_factory=lambda: DEFAULT_POLICY)
    statistic: str = DEFAULT_STATISTIC  # of each size's repetitions: mean, median or pNN
    timeout_s: float = 1800.0
    allreduce: bool = True  # False: point-to-point only

    def resolved_max_bytes(self) -> int:
        if self.max_bytes is not None:
            return self.max_bytes
        return DEFAULT_MAX_BYTES_CUDA if self.device == "cuda" else DEFAULT_MAX_BYTES_CPU

    def sizes(self) -> list[int]:
        lo, hi = self.min_bytes, self.resolved_max_bytes()
        if lo < 4 or hi < lo:
            raise SailorError(f"message sizes need 4 <= min_bytes <= max_bytes, got {lo} and {hi}")
        if self.factor < 2:
            raise SailorError(f"size factor must be >= 2, got {self.factor}")
        out, x = [], lo
        while x <= hi:
            out.append(x - x % 4)  # whole fp32 elements
            x *= self.factor
        if len(out) < 3:
            raise SailorError(
                f"{len(out)} message sizes between {lo} and {hi} bytes are too few to fit a bandwidth curve; "
                f"to fix: use a range spanning at least {self.factor**2}x (e.g. --max-bytes {lo * self.factor**2})"
            )
        return out

    def validate(self) -> None:
        check_device(self.device)
        check_statistic(self.statistic)
        if self.workers < 2:
            raise SailorError(f"the network profiler needs at least 2 workers, got {self.workers}; to fix: --workers 2")
        if self.device == "cuda":
            import torch

            n = torch.cuda.device_count()
            if self.workers > n:
                raise SailorError(
                    f"--workers {self.workers} needs {self.workers} GPUs (one per worker) but this node has {n}; "
                    f"to fix: use --workers {n} or fewer (at least 2), or --device cpu"
                )
        self.sizes()


@dataclass(frozen=True, kw_only=True)
class SizePoint:
    message_bytes: int
    p2p: Measurement
    allreduce: Measurement
    statistic: str

    @property
    def p2p_s(self) -> float:
        return self.p2p.stat_s(self.statistic)

    @property
    def allreduce_s(self) -> float:
        return self.allreduce.stat_s(self.statistic)


@dataclass(frozen=True, kw_only=True)
class NetworkProfile:
    link: NetworkLink
    intra_node: IntraNodeLink
    node_allreduce: NodeAllReduce
    p2p_alpha_beta: AlphaBeta
    allreduce_alpha_beta: AlphaBeta
    points: tuple[SizePoint, ...]
    provenance: Provenance

    @property
    def allreduce_fit(self) -> BandwidthFit:
        return self.node_allreduce.fit

    def p2p_errors(self) -> list[float]:
        """Relative error of the link fit's predicted time against the measured time, per size."""
        return relative_errors(
            self.link.fit.transfer_time_s, [p.message_bytes for p in self.points], [p.p2p_s for p in self.points]
        )

    def allreduce_errors(self) -> list[float]:
        return relative_errors(
            self.allreduce_fit.transfer_time_s,
            [p.message_bytes for p in self.points],
            [p.allreduce_s for p in self.points],
        )


# ----------------------------------------------------------------------------------------------
# Worker side (runs in each spawned process)


def network_worker(
    rank: int, world_size: int, init_method: str, emit: Callable[[Any], None], settings: NetworkSettings
) -> list[_Row] | None:
    """Measure every size; rank 0 returns [(bytes, p2p Measurement, all-reduce Measurement)].

    Sizes are visited round-robin, a few repetitions per visit (the first of each visit is a
    warm-up, since the caches and socket buffers were just used by another size), until every size
    is stable or capped. Why round-robin: on a shared host the background load drifts over seconds;
    measuring each size in its own burst turns that drift into bumps in the curve, while
    interleaving gives every size the same mix of conditions.
    """
    import torch
    import torch.distributed as dist

    dev = _join_group(torch, dist, rank, world_size, init_method, settings)
    try:
        sizes = settings.sizes()
        # One buffer, viewed at each size: no size pays for a fresh allocation, memory stays at the max.
        storage = torch.zeros(max(sizes) // 4, dtype=torch.float32, device=dev)
        steps = _timed_steps(torch, dist, rank, settings.device == "cuda")[: 2 if settings.allreduce else 1]
        spent = [0.0] * len(sizes)
        rules = {
            (i, kind): StopRule(replace(settings.policy, warmup=0), clock=_time_spent(spent, i))
            for i in range(len(sizes))
            for kind in ("p2p", "ar")
        }
        done = torch.zeros(len(sizes), dtype=torch.int32, device=dev)
        reported: set[int] = set()
        while not bool(done.all()):
            _visit_sizes(storage, sizes, done, steps, rules, spent, settings.policy)
            if rank == 0:
                for i in range(len(sizes)):
                    if not int(done[i]) and rules[i, "p2p"].done() and (
                            rules[i, "ar"].done() or not settings.allreduce):
                        done[i] = 1
            dist.broadcast(done, src=0)  # every rank follows rank 0's schedule
            if rank == 0:
                _report_done(emit, sizes, done, rules, reported, settings)
        if rank != 0:
            return None
        ar = "ar" if settings.allreduce else "p2p"
        return [(size, rules[i, "p2p"].result(), rules[i, ar].result()) for i, size in enumerate(sizes)]
    finally:
        dist.destroy_process_group()


def _time_spent(spent: list[float], i: int) -> Callable[[], float]:
    """The clock of size i's stop rule: the seconds spent measuring that size so far."""
    return lambda: spent[i]


def _join_group(
    torch: ModuleType, dist: ModuleType, rank: int, world_size: int, init_method: str, settings: NetworkSettings
) -> TorchDevice:
    """This rank's device, after joining the process group. CUDA: the GPU the process bound itself to
    (bind_device: GPU `rank` under run_workers, GPU 0 for one end of a link), made current then."""
    cuda = settings.device == "cuda"
    dev: TorchDevice = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=settings.timeout_s),
    )
    return dev


def _timed_steps(
    torch: ModuleType, dist: ModuleType, rank: int, cuda: bool
) -> tuple[tuple[str, Callable[[Tensor], float]], ...]:
    """(("p2p", one-way seconds of a ping-pong between ranks 0 and 1), ("ar", seconds of an all-reduce))."""

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def ping_pong(buf: Tensor) -> float:
        if rank > 1:
            return 0.0
        sync()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, dst=1)
            dist.recv(buf, src=1)
        else:
            dist.recv(buf, src=0)
            dist.send(buf, dst=0)
        sync()
        return (time.perf_counter() - t0) / 2

    def all_reduce(buf: Tensor) -> float:
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        sync()
        return time.perf_counter() - t0

    return ("p2p", ping_pong), ("ar", all_reduce)


def _visit_sizes(storage: Tensor, sizes: list[int], done: Tensor,
                 steps: Sequence[tuple[str, Callable[[Tensor], float]]],
                 rules: dict[tuple[int, str], StopRule], spent: list[float], policy: RepeatPolicy) -> None:
    """One round-robin visit of every unfinished size: a warm-up then REPS_PER_VISIT timed reps of each step."""

    for i, size in enumerate(sizes):
        if int(done[i]):
            continue
        buf = storage[: size // 4]
        t_visit = time.perf_counter()
        for kind, step in steps:
            for rep in range(policy.warmup + REPS_PER_VISIT):
                seconds = step(buf)
                if rep >= policy.warmup:
                    rules[i, kind].add(seconds)
        spent[i] += time.perf_counter() - t_visit


def _report_done(emit: Callable[[Any], None], sizes: list[int], done: Tensor, rules: dict[tuple[int, str], StopRule],
                 reported: set[int], settings: NetworkSettings) -> None:
    """Emits each newly finished size once (rank 0's progress), and adds it to `reported`."""
    for i in range(len(sizes)):
        if int(done[i]) and i not in reported:
            reported.add(i)
            emit(
                {
                    "done": len(reported),
                    "total": len(sizes),
                    "bytes": sizes[i],
                    "p2p_s": rules[i, "p2p"].result().stat_s(settings.statistic),
                    "allreduce_s": rules[i, "ar" if settings.allreduce else "p2p"].result().stat_s(
                        settings.statistic),
                }
            )


# ----------------------------------------------------------------------------------------------
# Parent side


def profile_network(
    settings: NetworkSettings, progress: Callable[[dict[str, Any]], None] | None = None
) -> NetworkProfile:
    """Measure and fit the network between `settings.workers` local workers; writes nothing."""
    settings.validate()
    gpu_type = settings.gpu_type or default_gpu_type(settings.device)
    rows = run_workers(
        network_worker,
        settings.workers,
        (settings,),
        device=settings.device,
        on_message=progress,
        timeout_s=settings.timeout_s,
    )
    return fit_network(rows, settings, gpu_type)


def fit_network(rows: Sequence[_Row], settings: NetworkSettings, gpu_type: str) -> NetworkProfile:
    points = tuple(SizePoint(message_bytes=b, p2p=p, allreduce=a, statistic=settings.statistic) for b, p, a in rows)
    sizes = [p.message_bytes for p in points]
    p2p_t = [p.p2p_s for p in points]
    ar_t = [p.allreduce_s for p in points]
    link = NetworkLink(
        sender_zone=settings.zone,
        sender_gpu=gpu_type,
        sender_count=1,
        receiver_zone=settings.zone,
        receiver_gpu=gpu_type,
        receiver_count=1,
        fit=best_fit(sizes, p2p_t),
    )
    intra = IntraNodeLink(gpu_type=gpu_type, num_gpus=2, fit=link.fit)
    ar_fit = best_fit(sizes, ar_t)
    p2p_ab = fit_alpha_beta(sizes, p2p_t)
    ar_ab = fit_alpha_beta(sizes, ar_t)
    prov = provenance(
        "sailor-profiler-network",
        settings.device,
        {
            "workers": settings.workers,
            "zone": settings.zone,
            "gpu_type": gpu_type,
            "sizes_bytes": sizes,
            "policy": asdict(settings.policy),
            "statistic": settings.statistic,
            "p2p_alpha_beta": asdict(p2p_ab),
            "allreduce_alpha_beta": asdict(ar_ab),
            "allreduce_fit": {"coeffs": list(ar_fit.coeffs), "max_bytes_per_s": ar_fit.max_bytes_per_s},
            "p2p_s": p2p_t,
            "allreduce_s": ar_t,
        },
    )
    return NetworkProfile(
        link=link,
        intra_node=intra,
        node_allreduce=NodeAllReduce(gpu_type=gpu_type, workers=settings.workers, fit=ar_fit),
        p2p_alpha_beta=p2p_ab,
        allreduce_alpha_beta=ar_ab,
        points=points,
        provenance=prov,
    )


def saturated(sizes: list[int], times: list[float]) -> tuple[list[float], list[float]]:
    """The measured (size, seconds) points plus a tail at the largest size's bandwidth, every 4x up to
    the largest size a fit is read at (1 GiB, `FIT_MAX_LOG2_MB`).

    The store's curve is a quadratic in log2(size) that the simulator reads from 64 KiB to 1 GiB.
    A link's bandwidth does not grow past what its largest measured transfer reached, but a
    quadratic fitted only to the measured sizes keeps its curvature beyond them: on the testbed
    (htb lets a burst of ~100 KiB through at line rate, so small messages look fast and the curve
    is convex) fits measured up to 4 MiB read 1.4x the shaped rate at 16 MiB and 1.7x at 64 MiB
    (12.5 MB/s links fitted at 17 and 21 MB/s), which is where gradient buckets and ring chunks
    sit. The tail pins the curve to the sustained rate there.
    """
    xs = [float(x) for x in sizes]
    ts = [float(t) for t in times]
    if not xs:
        return xs, ts
    big = max(range(len(xs)), key=lambda i: xs[i])
    bw = xs[big] / ts[big]
    x = xs[big] * 4
    while math.log2(x / 1e6) <= FIT_MAX_LOG2_MB + 1e-9:
        xs.append(x)
        ts.append(x / bw)
        x *= 4
    return xs, ts


def _fit_pinned(sizes: list[int], times: list[float]) -> BandwidthFit:
    """The measured points' fit, unless somewhere beyond the measured sizes it climbs more than 10 % past
    the largest transfer's bandwidth or falls more than 10 % below it: then the fit with the `saturated`
    tail (a worse fit of the measured sizes, 9-13 % on the testbed's links, against 1.4-1.7x too fast
    at 16-64 MiB; a loopback link measured up to 4 MiB whose concave fit read 1/1000 of its peak at
    16 MiB)."""
    plain = fit_bandwidth(sizes, times)
    top = max(sizes) / times[sizes.index(max(sizes))]
    beyond = [max(sizes) * 4**k for k in range(1, 12) if math.log2(max(sizes) * 4**k / 1e6) <= FIT_MAX_LOG2_MB]
    if all(0.9 * top <= plain.bandwidth_bytes_per_s(x) <= 1.1 * top for x in beyond):
        return plain
    return fit_bandwidth(*saturated(sizes, times))


def best_fit(sizes: list[int], times: list[float]) -> BandwidthFit:
    """Of the store's two forms, the one with the smaller worst relative error over the measured sizes:
    the quadratic in log-size (`_fit_pinned`, the artifact's form) or the line t = alpha + x / beta
    (`fit_line`). A line holds its last bandwidth beyond the measured sizes by construction. On the
    testbed's htb links (a burst at line rate, then the shaped rate) the line follows every size within
    a few %, where the quadratic missed by 9-13 %; on a link whose curve bends in log-size the quadratic
    stays, as it does when no line with a positive bandwidth fits at all (`fit_line` raises)."""
    quad = _fit_pinned(sizes, times)
    try:
        line = fit_line(sizes, times)
    except SailorError:
        return quad
    if max_abs(relative_errors(line.transfer_time_s, sizes, times)) < max_abs(
            relative_errors(quad.transfer_time_s, sizes, times)):
        return line
    return quad


def summary_rows(profile: NetworkProfile) -> list[dict[str, Any]]:
    """Per size: measured and predicted p2p and all-reduce times (for tables and benches)."""
    out = []
    for p, e_p, e_a in zip(profile.points, profile.p2p_errors(), profile.allreduce_errors(), strict=True):
        out.append(
            {
                "bytes": p.message_bytes,
                "p2p_measured_s": p.p2p_s,
                "p2p_median_s": p.p2p.median_s,
                "p2p_predicted_s": profile.link.fit.transfer_time_s(p.message_bytes),
                "p2p_err": e_p,
                "p2p_alpha_beta_s": profile.p2p_alpha_beta.transfer_time_s(p.message_bytes),
                "p2p_reps": p.p2p.reps,
                "allreduce_measured_s": p.allreduce_s,
                "allreduce_median_s": p.allreduce.median_s,
                "allreduce_predicted_s": profile.allreduce_fit.transfer_time_s(p.message_bytes),
                # the simulator's composition for a 2-worker ring: 2(D-1) hops of x/D bytes each
                "allreduce_ring_s": _ring_allreduce_s(profile, p.message_bytes),
                "allreduce_err": e_a,
                "allreduce_reps": p.allreduce.reps,
            }
        )
    return out


def _ring_allreduce_s(profile: NetworkProfile, message_bytes: int) -> float:
    d = int(json.loads(profile.provenance.settings)["workers"])
    return 2 * (d - 1) * profile.link.fit.transfer_time_s(message_bytes / d)


def to_json(profile: NetworkProfile) -> str:
    return json.dumps(
        {
            "link": {"coeffs": profile.link.fit.coeffs, "max_bytes_per_s": profile.link.fit.max_bytes_per_s},
            "allreduce": {
                "coeffs": profile.allreduce_fit.coeffs,
                "max_bytes_per_s": profile.allreduce_fit.max_bytes_per_s,
            },
            "p2p_alpha_beta": asdict(profile.p2p_alpha_beta),
            "allreduce_alpha_beta": asdict(profile.allreduce_alpha_beta),
            "points": summary_rows(profile),
        },
        indent=1,
    )


# ----------------------------------------------------------------------------------------------
# Between two machines (VMs): one process on each, meeting through the run's controller


def measure_link(settings: NetworkSettings, *, rank: int, rendezvous: Any, key: str, advertise_addr: str,
                 ends: tuple[tuple[str, str], tuple[str, str]]) -> NetworkProfile | None:
    """Measure the link between this machine and one other; rank 0 returns the fitted profile.

    `rendezvous` is the run's control client (sailor_core/runtime/protocol.py): rank 0 picks a port
    on `advertise_addr` and announces `tcp://addr:port` under `key`; rank 1 waits for it. `ends`:
    ((zone, gpu type) of rank 0, (zone, gpu type) of rank 1), the labels of the link.
    """

    if rank == 0:
        with socket.socket() as s:
            s.bind((advertise_addr, 0))
            port = s.getsockname()[1]
        init = f"tcp://{advertise_addr}:{port}"
        rendezvous.set(key, init)
    else:
        init = rendezvous.wait(key, settings.timeout_s)
    bind_device(0, settings.device)  # the one process of this machine: its first device (GPU 0, CPU share 0)
    rows = network_worker(rank, 2, init, lambda msg: None, settings)
    if rank != 0:
        return None
    if rows is None:
        raise SailorError("network_worker returned no rows on rank 0 (it returns them there); a bug")
    (za, ga), (zb, gb) = ends
    prof = fit_network(rows, replace(settings, zone=za), ga)
    link = replace(prof.link, sender_zone=za, sender_gpu=ga, receiver_zone=zb, receiver_gpu=gb)
    return replace(prof, link=link)
