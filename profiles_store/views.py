"""What the store answers from several tables at once: a model's profile book, quotas as a pool,
the profiled (model, GPU type) pairs, and the checks a layer profile passes before it is written.

Contract: pure compositions over what a store reads (`Reads`: `ProfileStore` is one); nothing here
writes. `profile_book` raises the store's one-line errors for an unknown model or GPU type; a known
GPU type without layer profiles is not an error (`ProfileBook.layers` says what is missing).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

import pyarrow as pa

from profiles_store.tables import (
    EGRESS_PRICES,
    FRAMEWORK_OVERHEAD,
    GPU_PRICES,
    INTRA_NODE_LINKS,
    LAYER_PROFILES,
    LINK_ALLREDUCE,
    NETWORK_LINKS,
    NODE_ALLREDUCE,
    QUOTAS,
    Table,
)
from sailor_core.domain import Capacity, GpuType, LayerProfile, ModelSpec
from sailor_core.errors import SailorError
from sailor_core.profiles import ProfileBook

T = TypeVar("T")


class Reads(Protocol):
    """What these compositions read of a store."""

    def read(self, table: Table[T], where: Mapping[str, str | Sequence[str]] | None = None, *,
             latest: bool = True) -> tuple[T, ...]: ...

    def model(self, name: str) -> ModelSpec: ...

    def gpu_types(self) -> dict[str, GpuType]: ...

    def require_gpu_types(self, names: Iterable[str],
                          known: Mapping[str, GpuType] | None = None) -> dict[str, GpuType]: ...


def profile_book(store: Reads, model: str, gpu_types: Sequence[str] | None = None) -> ProfileBook:
    """Everything known about `model` on `gpu_types` (default: every GPU type the store knows)."""
    spec = store.model(model)
    known = store.gpu_types()
    wanted = set(known) if gpu_types is None else set(gpu_types)
    if gpu_types is not None:
        store.require_gpu_types(wanted, known)
    grouped: dict[tuple[str, int, int], list[LayerProfile]] = {}
    for p in store.read(LAYER_PROFILES, {"model": model, "gpu_type": sorted(wanted)}):
        grouped.setdefault((p.gpu_type, p.mbs, p.tp), []).append(p)
    return ProfileBook(
        model=spec,
        gpu_types={g: t for g, t in known.items() if g in wanted},
        layer_profiles={k: tuple(sorted(v, key=lambda x: x.layer)) for k, v in grouped.items()},
        framework_overhead_bytes={g: b for g, b in store.read(FRAMEWORK_OVERHEAD) if g in wanted},
        links=tuple(lk for lk in store.read(NETWORK_LINKS) if lk.sender_gpu in wanted and lk.receiver_gpu in wanted),
        intra_node=tuple(x for x in store.read(INTRA_NODE_LINKS) if x.gpu_type in wanted),
        node_allreduce=tuple(x for x in store.read(NODE_ALLREDUCE) if x.gpu_type in wanted),
        link_allreduce=tuple(x for x in store.read(LINK_ALLREDUCE) if x.gpu_a in wanted and x.gpu_b in wanted),
        egress=store.read(EGRESS_PRICES),
        prices=tuple(p for p in store.read(GPU_PRICES) if p.gpu_type in wanted),
    )


def quota_pool(store: Reads) -> tuple[Capacity, ...]:
    """Quotas as pool entries: GPUs per VM from the GPU types, price from the current prices."""
    types = store.gpu_types()
    price = {(p.cloud, p.zone, p.gpu_type, p.market): p.usd_per_gpu_hour for p in store.read(GPU_PRICES)}
    return tuple(
        Capacity(zone=q.zone, region=q.region, gpu_type=q.gpu_type, gpus=q.max_gpus, market=q.market,
                 gpus_per_vm=types[q.gpu_type].gpus_per_node if q.gpu_type in types else 1,
                 usd_per_gpu_hour=price.get((q.cloud, q.zone, q.gpu_type, q.market), 0.0), cloud=q.cloud)
        for q in store.read(QUOTAS))


def checked_profiles(model: ModelSpec, gpu_type: str, profiles: Iterable[LayerProfile]) -> list[LayerProfile]:
    """`profiles` as a replace of (model, gpu_type) takes them: each row of that pair, on a layer of the model."""
    out = []
    for p in profiles:
        if p.model != model.name or p.gpu_type != gpu_type:
            raise SailorError(
                f"profile row for ({p.model}, {p.gpu_type}) given to replace ({model.name}, {gpu_type}); "
                f"to fix: write each (model, GPU type) separately"
            )
        if not 0 <= p.layer < model.num_layers:
            raise SailorError(
                f"profile row layer {p.layer} is outside model {model.name}'s layers 0..{model.num_layers - 1}"
            )
        out.append(p)
    return out


@dataclass(frozen=True, kw_only=True)
class PairSummary:
    """What the store holds for one (model, GPU type)."""

    model: str
    gpu_type: str
    rows: int
    layers: int
    mbs: tuple[int, ...]
    tp: tuple[int, ...]
    source: str
    host: str
    recorded_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "gpu_type": self.gpu_type, "rows": self.rows, "layers": self.layers,
                "mbs": list(self.mbs), "tp": list(self.tp), "source": self.source, "host": self.host,
                "recorded_at": self.recorded_at.isoformat()}


def pair_summaries(profiles: pa.Table) -> list[PairSummary]:
    """Every (model, GPU type) in the layer_profiles rows `profiles`, with what was profiled and where."""
    if not profiles.num_rows:
        return []
    g = profiles.group_by(["model", "gpu_type"], use_threads=False).aggregate([
        ("layer", "count"), ("layer", "count_distinct"), ("mbs", "distinct"), ("tp", "distinct"),
        ("source", "max"), ("host", "max"), ("recorded_at", "max")])
    out = [PairSummary(model=r["model"], gpu_type=r["gpu_type"], rows=r["layer_count"],
                       layers=r["layer_count_distinct"], mbs=tuple(sorted(r["mbs_distinct"])),
                       tp=tuple(sorted(r["tp_distinct"])),
                       source=r["source_max"], host=r["host_max"] or "", recorded_at=r["recorded_at_max"])
           for r in g.to_pylist()]
    return sorted(out, key=lambda s: (s.model, s.gpu_type))
