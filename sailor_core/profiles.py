"""ProfileBook: everything the simulator and planner know about one model on a set of GPUs and links.

Contract: an immutable, in-memory bundle of domain values (no I/O). The store builds it
(`profiles_store.ProfileStore.profile_book`), tests build it by hand. Lookups that miss raise
`MissingProfileError`, which carries the missing key in fields (`kind`, `gpu_type`, `mbs`, `tp`,
`link`) and names the command that would create it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from sailor_core.domain import (
    EgressPrice,
    GpuPrice,
    GpuType,
    IntraNodeLink,
    LayerProfile,
    LinkAllReduce,
    Market,
    ModelSpec,
    NetworkLink,
    NodeAllReduce,
)
from sailor_core.errors import MissingProfileError as MissingProfileError  # re-exported for callers

# Fixed memory the framework takes on a GPU before any tensor of the model (CUDA context, loaded
# kernels, communicator buffers). Used when the store has no measured value for a GPU type. Source:
# the Sailor artifact's GH200 figure for "fused kernels + CUDA context", 4.76e9 B. (The artifact adds
# 0.3e9 B of slack on top; our simulator models that memory explicitly instead: backward workspace
# and pipeline receive buffers. See docs/simulator.md.)
DEFAULT_FRAMEWORK_OVERHEAD_BYTES = 4_760_000_000


@dataclass(frozen=True, kw_only=True)
class ProfileBook:
    model: ModelSpec
    gpu_types: Mapping[str, GpuType]
    # (gpu_type, mbs, tp) -> one LayerProfile per layer, in layer order
    layer_profiles: Mapping[tuple[str, int, int], tuple[LayerProfile, ...]]
    framework_overhead_bytes: Mapping[str, int] = field(default_factory=dict)
    links: tuple[NetworkLink, ...] = ()
    intra_node: tuple[IntraNodeLink, ...] = ()
    # measured all-reduces within one node; where absent, all-reduces are composed from link hops
    node_allreduce: tuple[NodeAllReduce, ...] = ()
    # measured all-reduces between two machines, over their link; a ring step over a link without one is
    # timed from the link's point-to-point fit
    link_allreduce: tuple[LinkAllReduce, ...] = ()
    egress: tuple[EgressPrice, ...] = ()
    prices: tuple[GpuPrice, ...] = ()

    # Indexed once by __post_init__: the planner calls these lookups millions of times.
    _links: dict[tuple[str, str, int, str, str, int], NetworkLink] = field(init=False, repr=False, compare=False)
    _intra: dict[tuple[str, int], IntraNodeLink] = field(init=False, repr=False, compare=False)
    _node_ar: dict[tuple[str, int], NodeAllReduce] = field(init=False, repr=False, compare=False)
    _link_ar: dict[tuple[str, str, str, str], LinkAllReduce] = field(init=False, repr=False, compare=False)
    _linked: frozenset[tuple[str, str, str, str]] = field(init=False, repr=False, compare=False)
    _egress: dict[tuple[str, str], float] = field(init=False, repr=False, compare=False)
    _prices: dict[tuple[str, str, Market], float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        links = {
            (lk.sender_zone, lk.sender_gpu, lk.sender_count, lk.receiver_zone, lk.receiver_gpu, lk.receiver_count): lk
            for lk in self.links
        }
        object.__setattr__(self, "_links", links)
        object.__setattr__(self, "_intra", {(x.gpu_type, x.num_gpus): x for x in self.intra_node})
        object.__setattr__(self, "_node_ar", {(x.gpu_type, x.workers): x for x in self.node_allreduce})
        object.__setattr__(self, "_link_ar", {(x.zone_a, x.gpu_a, x.zone_b, x.gpu_b): x for x in self.link_allreduce})
        ends = {(k[0], k[1], k[3], k[4]) for k in links} | set(self._link_ar)
        object.__setattr__(self, "_linked", frozenset(ends | {(zb, gb, za, ga) for za, ga, zb, gb in ends}))
        object.__setattr__(self, "_egress", {(e.sender_zone, e.receiver_zone): e.usd_per_gb for e in self.egress})
        prices = {(p.zone, p.gpu_type, p.market): p.usd_per_gpu_hour for p in self.prices}
        object.__setattr__(self, "_prices", prices)

    # -- compute ---------------------------------------------------------------------------
    def layers(self, gpu_type: str, mbs: int, tp: int) -> tuple[LayerProfile, ...]:
        try:
            return self.layer_profiles[(gpu_type, mbs, tp)]
        except KeyError:
            raise MissingProfileError(
                f"no layer profile for (model={self.model.name}, gpu_type={gpu_type}, mbs={mbs}, tp={tp})",
                fix=f"sailor profile model --model {self.model.name} --mbs {mbs} --tp {tp} "
                f"on a {gpu_type} machine, or pick an (mbs, tp) the store has: "
                f"{sorted((m, t) for g, m, t in self.layer_profiles if g == gpu_type)[:12]}",
                kind="layers", model=self.model.name, gpu_type=gpu_type, mbs=mbs, tp=tp,
            ) from None

    def has_layers(self, gpu_type: str, mbs: int, tp: int) -> bool:
        return (gpu_type, mbs, tp) in self.layer_profiles

    def profiled_points(self, gpu_type: str) -> list[tuple[int, int]]:
        """(mbs, tp) pairs profiled for this GPU type, sorted."""
        return sorted((m, t) for g, m, t in self.layer_profiles if g == gpu_type)

    def gpu(self, name: str) -> GpuType:
        try:
            return self.gpu_types[name]
        except KeyError:
            raise MissingProfileError(
                f"unknown GPU type {name!r} (known: {sorted(self.gpu_types)})",
                fix="use one of those names or add the type to the store",
                kind="gpu-type", model=self.model.name, gpu_type=name,
            ) from None

    def overhead_bytes(self, gpu_type: str) -> int:
        return int(self.framework_overhead_bytes.get(gpu_type, DEFAULT_FRAMEWORK_OVERHEAD_BYTES))

    # -- network ---------------------------------------------------------------------------
    def link(
        self,
        sender_zone: str,
        sender_gpu: str,
        sender_count: int,
        receiver_zone: str,
        receiver_gpu: str,
        receiver_count: int,
    ) -> NetworkLink | None:
        return self._links.get((sender_zone, sender_gpu, sender_count, receiver_zone, receiver_gpu, receiver_count))

    def intra_node_link(self, gpu_type: str, num_gpus: int) -> IntraNodeLink | None:
        return self._intra.get((gpu_type, num_gpus))

    def node_allreduce_fit(self, gpu_type: str, workers: int) -> NodeAllReduce | None:
        return self._node_ar.get((gpu_type, workers))

    def linked(self, zone_a: str, gpu_a: str, zone_b: str, gpu_b: str) -> bool:
        """Whether any network profile joins a GPU of `gpu_a` in `zone_a` and one of `gpu_b` in `zone_b`: a
        link at some GPU count either way, or a measured all-reduce over it. Without one, every send and
        ring step between them is unknown (`SimModel` raises `MissingProfileError`)."""
        return (zone_a, gpu_a, zone_b, gpu_b) in self._linked

    def link_allreduce_fit(self, zone_a: str, gpu_a: str, zone_b: str, gpu_b: str) -> LinkAllReduce | None:
        return self._link_ar.get((zone_a, gpu_a, zone_b, gpu_b))

    def egress_usd_per_gb(self, sender_zone: str, receiver_zone: str) -> float:
        if sender_zone == receiver_zone:
            return 0.0
        return self._egress.get((sender_zone, receiver_zone), 0.0)

    # -- prices ----------------------------------------------------------------------------
    def price_usd_per_gpu_hour(self, zone: str, gpu_type: str, market: Market) -> float | None:
        return self._prices.get((zone, gpu_type, Market.parse(market)))


def calibrated_book(book: ProfileBook, factors: Mapping[str, float]) -> ProfileBook:
    """The book with each GPU type's layer times scaled by its online correction (measured /
    estimated iteration time), so the next plan uses what the machine really does. The flow
    (through tasks.planning) and the trace replay both call this."""
    if not factors:
        return book

    scaled = {}
    for key, layers in book.layer_profiles.items():
        f = factors.get(key[0], 1.0)
        scaled[key] = layers if f == 1.0 else tuple(
            replace(p, forward_s=p.forward_s * f, backward_s=p.backward_s * f, optimizer_s=p.optimizer_s * f)
            for p in layers)
    return replace(book, layer_profiles=scaled)
