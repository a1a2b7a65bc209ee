"""Domain types shared by every layer: GPUs, places, markets, models, profiles, prices, pools, plans.

Contract: every type is a frozen, keyword-only dataclass validated on construction; an invalid
value raises `ValidationError` naming the field and the offending value. Units are in the names
(`_s`, `_bytes`, `_gbps`, `_usd_per_hour`). Nothing here imports torch, Prefect, pyarrow or a
cloud SDK.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sailor_core.errors import SailorError, ValidationError
from sailor_core.files import shown

GIB = 2**30
# Published large runs use global batches of about 1-4 thousand sequences (GPT-3: 1536 x 2048 tokens,
# Llama 2/3: 1024 x 4096); 64 Ki sequences is already 16x past them. Above it a batch is far more
# likely a typo (a few extra zeros) than a plan: `sailor plan` and the flow refuse it unless confirmed.
MAX_PLAIN_GLOBAL_BATCH = 65536


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValidationError(msg)


class Market(enum.StrEnum):
    ON_DEMAND = "on-demand"
    SPOT = "spot"

    @classmethod
    def parse(cls, value: str | Market) -> Market:
        try:
            return cls(str(value).lower().replace("_", "-"))
        except ValueError:
            raise ValidationError(
                f"unknown market {shown(value)}; use one of: {', '.join(m.value for m in cls)}"
            ) from None


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """Where a stored row came from: the source (a dataset or a tool), the host, and when."""

    source: str
    host: str = ""
    recorded_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    settings: str = ""

    def __post_init__(self) -> None:
        _check(bool(self.source), "provenance.source must be non-empty")


@dataclass(frozen=True, kw_only=True)
class GpuType:
    """A GPU type: memory per GPU, GPUs per node (the usual VM shape), peak dense bf16 FLOP/s if known."""

    name: str
    memory_bytes: int
    gpus_per_node: int = 1
    peak_flops: float | None = None

    def __post_init__(self) -> None:
        _check(bool(self.name), "gpu_type.name must be non-empty")
        _check(self.memory_bytes > 0, f"gpu_type {self.name}: memory_bytes must be > 0, got {self.memory_bytes}")
        _check(self.gpus_per_node >= 1, f"gpu_type {self.name}: gpus_per_node must be >= 1, got {self.gpus_per_node}")


@dataclass(frozen=True, kw_only=True)
class Zone:
    """A zone, its region and its cloud. The region defaults to the zone name minus its last '-x' part."""

    name: str
    region: str = ""
    cloud: str = "gcp"

    def __post_init__(self) -> None:
        _check(bool(self.name), "zone.name must be non-empty")
        if not self.region:
            object.__setattr__(self, "region", default_region(self.name))


def default_region(zone: str) -> str:
    """GCP/AWS style: 'us-central1-a' -> 'us-central1', 'us-east-1a' -> 'us-east-1', 'local' -> 'local'."""
    parts = zone.rsplit("-", 1)
    if len(parts) == 2 and len(parts[1]) == 1 and parts[1].isalpha():
        return parts[0]
    if zone and zone[-1].isalpha() and zone[:-1] and zone[-2].isdigit():
        return zone[:-1]
    return zone


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """One layer of a model in the store's indexing: 0 embedding, 1..L blocks, L+1 final norm + head.

    Sizes are per GPU of a `tp`-way tensor-parallel group and per sequence (microbatch size 1):
    `params` elements, `act_output_elems` output elements (the pipeline message), and
    `act_memory_bytes` the activation bytes the forward pass keeps for backward.
    """

    index: int
    kind: str  # "embedding" | "block" | "head"
    tp: int
    params: int
    act_output_elems: int
    act_input_elems: int
    act_memory_bytes: int

    def __post_init__(self) -> None:
        _check(self.kind in ("embedding", "block", "head"), f"layer {self.index}: unknown kind {self.kind!r}")
        _check(self.tp >= 1, f"layer {self.index}: tp must be >= 1, got {self.tp}")
        for name in ("params", "act_output_elems", "act_input_elems", "act_memory_bytes"):
            _check(getattr(self, name) >= 0, f"layer {self.index}: {name} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer and its per-layer sizes for each TP degree it supports."""

    name: str
    num_blocks: int
    hidden_size: int
    num_heads: int
    sequence_length: int
    vocab_size: int
    ffn_hidden_size: int = 0
    layers: tuple[LayerSpec, ...] = ()
    # The output head is the embedding's weight (OPT, GPT-Neo). On different stages each keeps a copy,
    # and our runtime adds the two gradients every step (runtime/tied_weights.py). False also where
    # it is not known (models imported from the published data).
    tied_head: bool = False

    def __post_init__(self) -> None:
        _check(bool(self.name), "model.name must be non-empty")
        for n in ("num_blocks", "hidden_size", "num_heads", "sequence_length", "vocab_size"):
            _check(getattr(self, n) >= 1, f"model {self.name}: {n} must be >= 1, got {getattr(self, n)}")
        if not self.ffn_hidden_size:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        for tp in self.tp_degrees:
            idx = sorted(ly.index for ly in self.layers if ly.tp == tp)
            _check(
                idx == list(range(self.num_layers)),
                f"model {self.name}: tp={tp} layers must be exactly 0..{self.num_layers - 1}, got {idx[:5]}...",
            )

    @property
    def num_layers(self) -> int:
        """Layers in the store's indexing: embedding + blocks + head."""
        return self.num_blocks + 2

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        return tuple(sorted({ly.tp for ly in self.layers}))

    def layer(self, index: int, tp: int) -> LayerSpec:
        for ly in self.layers:
            if ly.index == index and ly.tp == tp:
                return ly
        raise SailorError(
            f"model {self.name} has no layer {index} at tp={tp} (known tp: {list(self.tp_degrees)}); "
            f"to fix: import or profile that tp degree"
        )


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """Measured time of one layer for one microbatch on one TP group of one GPU type."""

    model: str
    gpu_type: str
    mbs: int
    tp: int
    layer: int
    forward_s: float
    backward_s: float
    optimizer_s: float

    def __post_init__(self) -> None:
        _check(self.mbs >= 1 and self.tp >= 1, f"profile {self.model}/{self.gpu_type}: mbs and tp must be >= 1")
        for n in ("forward_s", "backward_s", "optimizer_s"):
            v = getattr(self, n)
            _check(v >= 0 and math.isfinite(v), f"profile {self.model}/{self.gpu_type} layer {self.layer}: {n}={v}")


# Message sizes the bandwidth micro-benchmarks sweep (the Sailor artifact's and ours): 64 KiB to 1 GiB,
# as log2 of the size in MB, the fit's variable.
FIT_MIN_LOG2_MB = math.log2(64 * 2**10 / 1e6)
FIT_MAX_LOG2_MB = math.log2(2**30 / 1e6)


@dataclass(frozen=True, kw_only=True)
class BandwidthFit:
    """Time of one transfer of x bytes: t(x) = latency_s + x / q(x), where q is the quadratic
    q_GBps(x) = a*u^2 + b*u + c with u = log2(x / 1e6) (the Sailor artifact's form, `latency_s` 0).

    `max_bytes_per_s` is the largest measured bandwidth: no transfer is predicted faster. The
    profiler may store a line instead (a = b = 0, so t = latency_s + x / c): the alpha-beta model of a
    link with a fixed cost per message. A negative `latency_s` is a link that lets a burst through at
    line rate before it holds to its rate (a token bucket: t = (x - burst) / rate), which a quadratic
    in log-size fits badly.
    """

    coeffs: tuple[float, float, float]
    max_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        _check(len(self.coeffs) == 3, f"bandwidth fit needs 3 coefficients, got {self.coeffs}")
        _check(self.max_bytes_per_s > 0, f"bandwidth fit max_bytes_per_s must be > 0, got {self.max_bytes_per_s}")
        _check(math.isfinite(self.latency_s), f"bandwidth fit latency_s must be finite, got {self.latency_s}")

    def bandwidth_bytes_per_s(self, message_bytes: float) -> float:
        """x / t(x), clamped to (0, max measured].

        The quadratic is only trusted over the sizes it was fitted on; outside them it is read at the
        nearest measured size (a quadratic extrapolated to 4 KiB can go negative).
        """
        x = max(message_bytes, 1.0)
        u = min(max(math.log2(x / 1e6), FIT_MIN_LOG2_MB), FIT_MAX_LOG2_MB)
        a, b, c = self.coeffs
        floor = self.max_bytes_per_s * 1e-3  # a fit extrapolated below zero must not divide by zero
        bw = max((a * u * u + b * u + c) * 1e9, floor)
        if self.latency_s:
            t = self.latency_s + x / bw
            bw = x / t if t > 0 else self.max_bytes_per_s  # inside a burst: the fastest measured
        return min(max(bw, floor), self.max_bytes_per_s)

    def transfer_time_s(self, message_bytes: float) -> float:
        if message_bytes <= 0:
            return 0.0
        return message_bytes / self.bandwidth_bytes_per_s(message_bytes)

    def describe(self) -> str:
        """The fit as a person reads it: the quadratic, or the line and its peak."""
        a, b, c = self.coeffs
        peak = f"peak {self.max_bytes_per_s / 1e6:.1f} MB/s"
        if a == 0 and b == 0 and self.latency_s:
            return f"t = {self.latency_s * 1e3:+.3f} ms + x / {c * 1e3:.1f} MB/s, {peak}"
        lat = f", + {self.latency_s * 1e6:.1f} us per message" if self.latency_s else ""
        return f"bw_GBps = {a:.4g}*u^2 + {b:.4g}*u + {c:.4g}, u = log2(bytes/1e6){lat}, {peak}"


@dataclass(frozen=True, kw_only=True)
class NetworkLink:
    """A measured link: sender (zone, GPU type, GPU count) -> receiver (zone, GPU type, GPU count)."""

    sender_zone: str
    sender_gpu: str
    sender_count: int
    receiver_zone: str
    receiver_gpu: str
    receiver_count: int
    fit: BandwidthFit

    def __post_init__(self) -> None:
        _check(self.sender_count >= 1 and self.receiver_count >= 1, "network link GPU counts must be >= 1")


@dataclass(frozen=True, kw_only=True)
class IntraNodeLink:
    """Collective bandwidth among `num_gpus` GPUs of one node."""

    gpu_type: str
    num_gpus: int
    fit: BandwidthFit


@dataclass(frozen=True, kw_only=True)
class NodeAllReduce:
    """A measured all-reduce among `workers` GPUs of one node, one GPU per worker: `fit` is its
    algorithm bandwidth, x / t(x) for x bytes per worker, in the same form as a link's fit."""

    gpu_type: str
    workers: int
    fit: BandwidthFit

    def __post_init__(self) -> None:
        _check(self.workers >= 2, f"an all-reduce needs at least 2 workers, got {self.workers}")


@dataclass(frozen=True, kw_only=True)
class LinkAllReduce:
    """A measured all-reduce between one GPU in `zone_a` and one in `zone_b` (a worker on each of two
    machines, over the link between them): `fit` is its algorithm bandwidth, x / t(x) for x bytes per
    worker, in the same form as a link's fit. It holds what a ring step over that link costs beyond the
    bytes a ping-pong moves: both directions at once, the collective's own chunking and the reduction."""

    zone_a: str
    gpu_a: str
    zone_b: str
    gpu_b: str
    fit: BandwidthFit


@dataclass(frozen=True, kw_only=True)
class EgressPrice:
    sender_zone: str
    receiver_zone: str
    usd_per_gb: float

    def __post_init__(self) -> None:
        _check(self.usd_per_gb >= 0, f"egress {self.sender_zone}->{self.receiver_zone}: usd_per_gb must be >= 0")


@dataclass(frozen=True, kw_only=True)
class GpuPrice:
    cloud: str
    zone: str
    gpu_type: str
    market: Market
    usd_per_gpu_hour: float
    fetched_at: datetime | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "market", Market.parse(self.market))
        _check(
            self.usd_per_gpu_hour >= 0 and math.isfinite(self.usd_per_gpu_hour),
            f"price {self.gpu_type}@{self.zone}: usd_per_gpu_hour must be >= 0, got {self.usd_per_gpu_hour}",
        )


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """Rentable capacity: `gpus` GPUs of `gpu_type` in `zone` on `market`, in VMs of `gpus_per_vm`.

    The one type for what can be rented: a pool's entries, what a provider offers now (with its
    `instance_type` and when its price was fetched), a scenario's offerings. `gpus` counts GPUs,
    never VMs; `vms` is the whole VMs they make (a per-GPU quota may leave part of one VM, which a
    TP group narrower than a VM can still use); from a VM count, `gpus=vms * gpus_per_vm`.
    """

    zone: str
    gpu_type: str
    gpus: int
    gpus_per_vm: int = 1
    market: Market = Market.ON_DEMAND
    usd_per_gpu_hour: float = 0.0
    region: str = ""  # default: the zone's (`default_region`)
    cloud: str = "gcp"
    instance_type: str = ""  # the provider's name for one VM of this shape, where it has one
    price_fetched_at: datetime | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "market", Market.parse(self.market))
        if not self.region:
            object.__setattr__(self, "region", default_region(self.zone))
        _check(self.gpus >= 0, f"capacity {self.gpu_type}@{self.zone}: gpus must be >= 0, got {self.gpus}")
        _check(self.gpus_per_vm >= 1, f"capacity {self.gpu_type}@{self.zone}: gpus_per_vm must be >= 1, "
               f"got {self.gpus_per_vm}")
        _check(0 <= self.usd_per_gpu_hour < math.inf, f"capacity {self.gpu_type}@{self.zone}: usd_per_gpu_hour "
               f"must be a finite number >= 0, got {self.usd_per_gpu_hour}")

    @property
    def vms(self) -> int:
        """Whole VMs of `gpus_per_vm` GPUs in `gpus`."""
        return self.gpus // self.gpus_per_vm

    @property
    def key(self) -> str:
        """The capacity's identity, `zone/gpu_type/market`: one (zone, GPU type, market) is one entry."""
        return capacity_key(self.zone, self.gpu_type, self.market)


def capacity_key(zone: str, gpu_type: str, market: Market | str) -> str:
    return f"{zone}/{gpu_type}/{Market.parse(market).value}"


@dataclass(frozen=True, kw_only=True)
class ResourcePool:
    """What may be rented now: one `Capacity` per (zone, GPU type, market)."""

    entries: tuple[Capacity, ...]

    def __post_init__(self) -> None:
        keys = [(e.zone, e.gpu_type, e.market) for e in self.entries]
        dup = {k for k in keys if keys.count(k) > 1}
        _check(not dup, f"pool lists the same (zone, GPU type, market) twice: {sorted(dup)}; merge the counts")

    @property
    def gpu_types(self) -> tuple[str, ...]:
        return tuple(sorted({e.gpu_type for e in self.entries}))


# ---------------------------------------------------------------------------------------------
# Plans


@dataclass(frozen=True, kw_only=True)
class Replica:
    """One data-parallel replica of a stage: a TP group of `tp` GPUs inside one node."""

    gpu_type: str
    zone: str
    tp: int = 1
    gpus_per_node: int = 1
    market: Market = Market.ON_DEMAND
    region: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "market", Market.parse(self.market))
        _check(bool(self.gpu_type) and bool(self.zone),
               f"replica gpu_type={self.gpu_type!r} zone={self.zone!r}: both must be non-empty; "
               f"to fix: name the replica's GPU type and zone")
        _check(self.tp >= 1, f"replica {self.gpu_type}@{self.zone}: tp must be >= 1, got {self.tp}; "
               f"to fix: use tp=1 for a replica without tensor parallelism")
        _check(self.gpus_per_node >= 1, f"replica {self.gpu_type}@{self.zone}: gpus_per_node must be >= 1, "
               f"got {self.gpus_per_node}; to fix: give the GPUs of one VM of this type")
        if not self.region:
            object.__setattr__(self, "region", default_region(self.zone))


@dataclass(frozen=True, kw_only=True)
class Stage:
    """Layers [first_layer, last_layer] (inclusive) and one replica per data-parallel pipeline.

    `recompute`: the stage's transformer blocks keep only their input for backward and run their
    forward again during backward (activation recomputation: less memory, one more forward)."""

    first_layer: int
    last_layer: int
    replicas: tuple[Replica, ...]
    recompute: bool = False

    def __post_init__(self) -> None:
        _check(0 <= self.first_layer <= self.last_layer,
               f"stage layers [{self.first_layer}, {self.last_layer}]: need 0 <= first_layer <= last_layer; "
               f"to fix: give the stage's first and last layer, inclusive, in order")
        _check(bool(self.replicas), f"stage layers [{self.first_layer}, {self.last_layer}] has no replicas; "
               f"to fix: give it one replica per data-parallel pipeline")

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)


@dataclass(frozen=True, kw_only=True)
class PipelineBatch:
    """The work of data-parallel pipeline j (replica j of every stage): microbatch size and count."""

    microbatch_size: int
    num_microbatches: int

    def __post_init__(self) -> None:
        _check(self.microbatch_size >= 1 and self.num_microbatches >= 1,
               f"pipeline batch microbatch_size={self.microbatch_size} num_microbatches={self.num_microbatches}: "
               f"both must be >= 1; to fix: give every pipeline at least one microbatch of at least one sample")

    @property
    def samples(self) -> int:
        return self.microbatch_size * self.num_microbatches


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """A heterogeneous PP x DP x TP plan. Pipeline j is replica j of every stage.

    The constructor raises one `ValidationError` that lists every violation of the plan's shape:
    no stages, stages that do not tile layers 0, 1, ... in order, a stage whose replica count is not
    the number of pipelines, a TP group larger than its node, pipelines whose samples do not add up
    to `global_batch_size`, an unknown schedule or precision. The plan does not know its model's
    layer count: `violations(num_layers)` adds that check (the simulator and the runtime call it).
    """

    model: str
    global_batch_size: int
    stages: tuple[Stage, ...]
    pipelines: tuple[PipelineBatch, ...]
    schedule: str = "1f1b"
    precision: str = "fp32"
    zero1: bool = False

    def __post_init__(self) -> None:
        problems = self._shape_problems()
        _check(not problems, f"invalid plan for model {self.model}: " + "; ".join(problems)
               + "; to fix: let `sailor plan` make the plan, or correct it (docs/formats.md, 'Plan files')")

    def _shape_problems(self) -> list[str]:
        if not self.stages:
            return ["plan has no stages"]
        out: list[str] = []
        dp = len(self.pipelines)
        expect = 0
        for i, st in enumerate(self.stages):
            if st.first_layer != expect:
                out.append(
                    f"stage {i} starts at layer {st.first_layer}, expected {expect} (layers must tile the model)"
                )
            expect = st.last_layer + 1
            if len(st.replicas) != dp:
                out.append(f"stage {i} has {len(st.replicas)} replicas but the plan has {dp} pipelines")
            for j, r in enumerate(st.replicas):
                if r.tp > r.gpus_per_node:
                    out.append(
                        f"stage {i} replica {j}: tp={r.tp} is larger than a node of {r.gpus_per_node} "
                        f"{r.gpu_type} GPUs (TP stays inside a node)"
                    )
        total = sum(p.samples for p in self.pipelines)
        if total != self.global_batch_size or total < 1:
            out.append(
                f"pipelines carry {total} samples per iteration but global_batch_size is {self.global_batch_size}"
            )
        if self.schedule not in ("1f1b", "gpipe"):
            out.append(f"schedule must be '1f1b' or 'gpipe', got {self.schedule!r}")
        if self.precision not in ("fp32", "bf16"):
            out.append(f"precision must be 'fp32' or 'bf16', got {self.precision!r}")
        return out

    def violations(self, num_layers: int | None = None) -> list[str]:
        """What keeps this plan from running a model of `num_layers` layers (empty: nothing)."""
        out = self._shape_problems()
        covered = self.stages[-1].last_layer + 1 if self.stages else 0
        if num_layers is not None and covered != num_layers:
            out.append(f"stages cover layers 0..{covered - 1} but model {self.model} has {num_layers} layers")
        return out

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def data_parallel(self) -> int:
        return len(self.pipelines)

    @property
    def num_gpus(self) -> int:
        return sum(r.tp for st in self.stages for r in st.replicas)

    def gpus_by_place(self) -> Mapping[tuple[str, str, Market], int]:
        """GPUs used per (zone, GPU type, market)."""
        out: dict[tuple[str, str, Market], int] = {}
        for st in self.stages:
            for r in st.replicas:
                k = (r.zone, r.gpu_type, r.market)
                out[k] = out.get(k, 0) + r.tp
        return out


def split_batch(global_batch_size: int, microbatch_sizes: Iterable[int]) -> tuple[PipelineBatch, ...]:
    """Share `global_batch_size` samples exactly over pipelines with the given microbatch sizes.

    Microbatches go round-robin to the pipelines, so counts differ by at most one (the slowest
    pipeline has ceil(n/dp) microbatches, as in the paper). Raises if the sizes cannot add up.
    """
    sizes = list(microbatch_sizes)
    _check(bool(sizes), "split_batch needs at least one pipeline")
    if len(set(sizes)) == 1:
        mbs = sizes[0]
        _check(
            global_batch_size % mbs == 0,
            f"global batch {global_batch_size} is not a multiple of microbatch size {mbs}",
        )
        n = global_batch_size // mbs
        _check(
            n >= len(sizes),
            f"global batch {global_batch_size} has {n} microbatches of {mbs}, fewer than {len(sizes)} pipelines",
        )
        base, extra = divmod(n, len(sizes))
        return tuple(
            PipelineBatch(microbatch_size=mbs, num_microbatches=base + (1 if j < extra else 0))
            for j in range(len(sizes))
        )
    # Different microbatch sizes: give each pipeline work proportional to its microbatch size.
    total = sum(sizes)
    counts = [max(1, (global_batch_size * s // total) // s) for s in sizes]
    rest = global_batch_size - sum(c * s for c, s in zip(counts, sizes, strict=True))
    j = 0
    while rest > 0 and j < 10 * len(sizes) * global_batch_size:
        k = j % len(sizes)
        if sizes[k] <= rest:
            counts[k] += 1
            rest -= sizes[k]
        j += 1
    _check(rest == 0, f"global batch {global_batch_size} cannot be split exactly into microbatches of {sizes}")
    return tuple(PipelineBatch(microbatch_size=s, num_microbatches=c) for s, c in zip(sizes, counts, strict=True))
