"""Each table of the store as data: its schema (schemas.py) and the values its rows hold.

Contract: a `Table[T]` describes one table once: `spec` (columns, partitions, key, schema version:
schemas.py), how values of type T become rows (`encode`) and rows become values (`decode`), the
mode a write takes by default (`replace`: a value is the whole of its partition, as a model's layers
are), and the column, if any, that names a GPU type the store must already know (`gpu_type_column`).
`ProfileStore.read(table)` and `ProfileStore.write(table, values)` work for every table through it;
the listing (`partitions`) and the CSV export go by `spec`. `TYPED` maps each table's name to its
description; history tables share one shape (`HISTORY`).

    store.read(NETWORK_LINKS)                           -> tuple[NetworkLink, ...]
    store.write(GPU_PRICES, prices)                     # every fetch kept; the newest per key is current
    dict(store.read(FRAMEWORK_OVERHEAD))                -> {gpu type: bytes}
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from profiles_store.schemas import HISTORY_TABLES, TABLES, TableSpec
from sailor_core.domain import (
    BandwidthFit,
    Capacity,
    EgressPrice,
    GpuPrice,
    GpuType,
    IntraNodeLink,
    LayerProfile,
    LayerSpec,
    LinkAllReduce,
    Market,
    ModelSpec,
    NetworkLink,
    NodeAllReduce,
    default_region,
)
from sailor_core.errors import SailorError, ValidationError

T = TypeVar("T")
Row = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Table(Generic[T]):
    """One table of the store (see the module's contract)."""

    spec: TableSpec
    encode: Callable[[Iterable[T]], list[Row]]
    decode: Callable[[Sequence[Row]], tuple[T, ...]]
    mode: str = "upsert"
    gpu_type_column: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name


def _per_row(to_row: Callable[[T], Row], from_row: Callable[[Row], T]) -> dict[str, Any]:
    """encode/decode for a table whose values are one row each."""
    return {"encode": lambda values: [to_row(v) for v in values],
            "decode": lambda rows: tuple(from_row(r) for r in rows)}


def _plain(cls: Callable[..., T], cols: Sequence[str], renamed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """encode/decode of a dataclass whose fields are the columns `cols` (`renamed`: field -> column)."""
    to_col = dict(renamed or {})
    return _per_row(lambda v: {to_col.get(f, f): getattr(v, f) for f in cols},
                    lambda r: cls(**{f: r[to_col.get(f, f)] for f in cols}))


def _fit(r: Mapping[str, Any]) -> BandwidthFit:
    return BandwidthFit(coeffs=(r["fit_a"], r["fit_b"], r["fit_c"]), max_bytes_per_s=r["max_bandwidth_bytes_per_s"],
                        latency_s=r["latency_s"])


def _fit_cols(f: BandwidthFit) -> Row:
    a, b, c = f.coeffs
    return dict(fit_a=a, fit_b=b, fit_c=c, max_bandwidth_bytes_per_s=f.max_bytes_per_s, latency_s=f.latency_s)


def _fitted(cls: Callable[..., T], cols: Sequence[str]) -> dict[str, Any]:
    """encode/decode of a measured fit (`fit: BandwidthFit`) keyed by the fields `cols`."""
    return _per_row(lambda v: {**{c: getattr(v, c) for c in cols}, **_fit_cols(v.fit)},  # type: ignore[attr-defined]
                    lambda r: cls(**{c: r[c] for c in cols}, fit=_fit(r)))


# -- models: one ModelSpec is the rows of its partition -------------------------------------------

_ARCH = ("num_blocks", "hidden_size", "num_heads", "sequence_length", "vocab_size", "ffn_hidden_size")
_LAYER = ("tp", "params", "act_output_elems", "act_input_elems", "act_memory_bytes")


def _model_rows(specs: Iterable[ModelSpec]) -> list[Row]:
    return [dict({c: getattr(s, c) for c in _ARCH}, model=s.name, tied_head=s.tied_head, layer=ly.index,
                 kind=ly.kind, **{c: getattr(ly, c) for c in _LAYER})
            for s in specs for ly in s.layers]


def _models(rows: Sequence[Row]) -> tuple[ModelSpec, ...]:
    by_model: dict[str, list[Row]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    return tuple(
        ModelSpec(name=name, tied_head=bool(rs[0].get("tied_head")), **{c: rs[0][c] for c in _ARCH},
                  layers=tuple(LayerSpec(index=r["layer"], kind=r["kind"], **{c: r[c] for c in _LAYER}) for r in rs))
        for name, rs in sorted(by_model.items()))


# -- prices, quotas, overheads --------------------------------------------------------------------


def _price_row(p: GpuPrice) -> Row:
    """A price's row; a price without `fetched_at` is stamped when written (`ProfileStore.write`)."""
    return dict(cloud=p.cloud, zone=p.zone, gpu_type=p.gpu_type, market=Market.parse(p.market).value,
                usd_per_gpu_hour=p.usd_per_gpu_hour,
                fetched_at=p.fetched_at if p.fetched_at is None or p.fetched_at.tzinfo else
                p.fetched_at.replace(tzinfo=UTC))


@dataclass(frozen=True, kw_only=True)
class Quota:
    """How many GPUs of a type the user may rent in a zone on a market (`ProfileStore.quotas()` turns
    them into pool entries, with GPUs per VM and price)."""

    cloud: str
    zone: str
    region: str
    gpu_type: str
    market: Market
    max_gpus: int

    @staticmethod
    def of(c: Capacity) -> Quota:
        """The quota that pool entry `c` states (its GPUs, in its zone and region, on its market)."""
        return Quota(cloud=c.cloud, zone=c.zone, region=c.region or default_region(c.zone), gpu_type=c.gpu_type,
                     market=Market.parse(c.market), max_gpus=c.gpus)


def _quota_row(q: Quota) -> Row:
    return dict(cloud=q.cloud, zone=q.zone, region=q.region, gpu_type=q.gpu_type,
                market=Market.parse(q.market).value, max_gpus=q.max_gpus)


def _overhead_row(item: tuple[str, int]) -> Row:
    g, b = item
    if b < 0:
        raise ValidationError(f"framework overhead for {g} must be >= 0 bytes, got {b}")
    return dict(gpu_type=g, overhead_bytes=int(b))


# -- run history ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class HistoryRecord:
    """One row of run history (runs, events, decisions, plans, measurements)."""

    run_id: str
    kind: str
    time: datetime
    reason: str = ""
    payload: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""
    host: str = ""


def _history_row(r: HistoryRecord) -> Row:
    try:
        payload = json.dumps(dict(r.payload), sort_keys=True, default=str)
    except (TypeError, ValueError) as e:
        raise SailorError(f"history record for run {r.run_id}: payload is not JSON-serialisable ({e})") from None
    row = dict(run_id=r.run_id, time=r.time if r.time.tzinfo else r.time.replace(tzinfo=UTC), kind=r.kind,
               reason=r.reason, payload=payload)
    # empty: the write's provenance fills them
    row.update({k: v for k, v in (("source", r.source), ("host", r.host)) if v})
    return row


def _history(r: Row) -> HistoryRecord:
    return HistoryRecord(run_id=r["run_id"], kind=r["kind"], time=r["time"], reason=r["reason"] or "",
                         payload=json.loads(r["payload"] or "{}"), source=r["source"], host=r["host"] or "")


# -- the tables -----------------------------------------------------------------------------------

GPU_TYPES: Table[GpuType] = Table(
    spec=TABLES["gpu_types"], **_plain(GpuType, ("name", "memory_bytes", "gpus_per_node", "peak_flops"),
                                       renamed={"name": "gpu_type"}))
MODELS: Table[ModelSpec] = Table(spec=TABLES["model_layers"], encode=_model_rows, decode=_models, mode="replace")
LAYER_PROFILES: Table[LayerProfile] = Table(
    spec=TABLES["layer_profiles"], gpu_type_column="gpu_type",
    **_plain(LayerProfile, tuple(f.name for f in fields(LayerProfile))))
FRAMEWORK_OVERHEAD: Table[tuple[str, int]] = Table(
    spec=TABLES["framework_overhead"], gpu_type_column="gpu_type",
    **_per_row(_overhead_row, lambda r: (r["gpu_type"], r["overhead_bytes"])))
NETWORK_LINKS: Table[NetworkLink] = Table(spec=TABLES["network_links"], **_fitted(NetworkLink, (
    "sender_zone", "sender_gpu", "sender_count", "receiver_zone", "receiver_gpu", "receiver_count")))
INTRA_NODE_LINKS: Table[IntraNodeLink] = Table(spec=TABLES["intra_node_links"],
                                               **_fitted(IntraNodeLink, ("gpu_type", "num_gpus")))
NODE_ALLREDUCE: Table[NodeAllReduce] = Table(spec=TABLES["node_allreduce"],
                                             **_fitted(NodeAllReduce, ("gpu_type", "workers")))
# a caller stores both orders of a pair: the readers look one up as a ring hop meets it
LINK_ALLREDUCE: Table[LinkAllReduce] = Table(spec=TABLES["link_allreduce"],
                                             **_fitted(LinkAllReduce, ("zone_a", "gpu_a", "zone_b", "gpu_b")))
EGRESS_PRICES: Table[EgressPrice] = Table(
    spec=TABLES["egress_prices"], **_plain(EgressPrice, ("sender_zone", "receiver_zone", "usd_per_gb")))
GPU_PRICES: Table[GpuPrice] = Table(spec=TABLES["gpu_prices"], **_per_row(_price_row, lambda r: GpuPrice(
    cloud=r["cloud"], zone=r["zone"], gpu_type=r["gpu_type"], market=r["market"],
    usd_per_gpu_hour=r["usd_per_gpu_hour"], fetched_at=r["fetched_at"])))
QUOTAS: Table[Quota] = Table(spec=TABLES["quotas"], **_per_row(_quota_row, lambda r: Quota(
    cloud=r["cloud"], zone=r["zone"], region=r["region"], gpu_type=r["gpu_type"], market=Market.parse(r["market"]),
    max_gpus=r["max_gpus"])))
HISTORY: dict[str, Table[HistoryRecord]] = {
    name: Table(spec=TABLES[name], **_per_row(_history_row, _history)) for name in HISTORY_TABLES}

_ALL: tuple[Table[Any], ...] = (GPU_TYPES, MODELS, LAYER_PROFILES, FRAMEWORK_OVERHEAD, NETWORK_LINKS, INTRA_NODE_LINKS,
                                NODE_ALLREDUCE, LINK_ALLREDUCE, EGRESS_PRICES, GPU_PRICES, QUOTAS, *HISTORY.values())
TYPED: dict[str, Table[Any]] = {t.name: t for t in _ALL}
assert set(TYPED) == set(TABLES), "every table of schemas.py has one description here"
