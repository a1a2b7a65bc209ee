"""Every table of the profile store, defined once: columns, partitioning, keys, schema version.

Contract: `TABLES[name]` is the single definition the reader, the writer, the CSV export and
docs/store.md follow. Each Parquet file the store writes carries `sailor.table` and
`sailor.schema_version` in its key-value metadata; a file of another version is refused with a
`SailorError` (no silent reinterpretation). Bump `SCHEMA_VERSION` when a column changes meaning,
type or name, and say in docs/store.md how to move data across.

Row semantics per table:
- `partition_by`: the folder levels (`col=value/...`) files live in. A *replace* write supersedes
  every older file of its partition folder (for an unpartitioned table: of the whole table).
- `key`: rows with the same key are one fact; on read the newest write wins (upsert).
  `None` means append-only: every row is kept (run history).
- `latest_by`: a column that orders versions of one key before write order does (prices by
  `fetched_at`), so a late write of an old price does not hide a newer one.
Every table ends with the provenance columns (`PROVENANCE_COLUMNS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

SCHEMA_VERSION = 1
STORE_FORMAT = "sailor-profile-store"
META_TABLE = b"sailor.table"
META_VERSION = b"sailor.schema_version"

_TS = pa.timestamp("us", tz="UTC")

# Where a row came from: a tool or dataset (`source`), the machine that measured it or the file
# of the dataset it was read from (`host`), when it was recorded, and free-form settings (JSON).
PROVENANCE_FIELDS: tuple[pa.Field, ...] = (
    pa.field("source", pa.string(), nullable=False),
    pa.field("host", pa.string()),
    pa.field("recorded_at", _TS, nullable=False),
    pa.field("settings", pa.string()),
)
PROVENANCE_COLUMNS = tuple(f.name for f in PROVENANCE_FIELDS)


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    name: str
    doc: str
    fields: tuple[pa.Field, ...]
    partition_by: tuple[str, ...] = ()
    key: tuple[str, ...] | None = None
    latest_by: str | None = None

    @property
    def schema(self) -> pa.Schema:
        """The full Arrow schema of a stored file: data columns, provenance, version metadata."""
        return pa.schema(
            list(self.fields) + list(PROVENANCE_FIELDS),
            metadata={META_TABLE: self.name.encode(), META_VERSION: str(SCHEMA_VERSION).encode()},
        )

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields) + PROVENANCE_COLUMNS

    @property
    def required(self) -> tuple[str, ...]:
        """Columns that may not hold nulls."""
        return tuple(f.name for f in self.fields if not f.nullable) + ("source", "recorded_at")


def _f(name: str, typ: pa.DataType, nullable: bool = False) -> pa.Field:
    return pa.field(name, typ, nullable=nullable)


_S, _I, _F = pa.string(), pa.int64(), pa.float64()

_FIT = (
    _f("fit_a", _F),
    _f("fit_b", _F),
    _f("fit_c", _F),
    _f("max_bandwidth_bytes_per_s", _F),
    _f("latency_s", _F),
)

# Run history: one shape for every table of it. `payload` is a JSON object (text).
_HISTORY_FIELDS = (
    _f("run_id", _S),
    _f("time", _TS),
    _f("kind", _S),
    _f("reason", _S, True),
    _f("payload", _S, True),
)
HISTORY_TABLES = ("runs", "events", "decisions", "plans", "measurements")

_SPECS = [
    TableSpec(
        name="gpu_types",
        doc="GPU types: memory per GPU, GPUs per node (the usual VM shape), peak dense bf16 FLOP/s if known.",
        fields=(_f("gpu_type", _S), _f("memory_bytes", _I), _f("gpus_per_node", _I), _f("peak_flops", _F, True)),
        key=("gpu_type",),
    ),
    TableSpec(
        name="model_layers",
        doc=(
            "A model's architecture and per-layer sizes per TP degree (one GPU of a tp-way group, one "
            "sequence): parameter elements, output/input activation elements, activation bytes kept for "
            "backward. Layer 0 is the embedding, 1..L the blocks, L+1 the final norm and head."
        ),
        fields=(
            _f("model", _S),
            _f("num_blocks", _I),
            _f("hidden_size", _I),
            _f("num_heads", _I),
            _f("sequence_length", _I),
            _f("vocab_size", _I),
            _f("ffn_hidden_size", _I),
            _f("tp", _I),
            _f("layer", _I),
            _f("kind", _S),
            _f("params", _I),
            _f("act_output_elems", _I),
            _f("act_input_elems", _I),
            _f("act_memory_bytes", _I),
            _f("tied_head", pa.bool_(), nullable=True),  # null: not known (files written before it)
        ),
        partition_by=("model",),
        key=("model", "tp", "layer"),
    ),
    TableSpec(
        name="layer_profiles",
        doc=(
            "Measured time of one layer for one microbatch of `mbs` sequences on one `tp`-way group of "
            "`gpu_type` GPUs: forward, backward and optimizer-step seconds."
        ),
        fields=(
            _f("model", _S),
            _f("gpu_type", _S),
            _f("mbs", _I),
            _f("tp", _I),
            _f("layer", _I),
            _f("forward_s", _F),
            _f("backward_s", _F),
            _f("optimizer_s", _F),
        ),
        partition_by=("model", "gpu_type"),
        key=("model", "gpu_type", "mbs", "tp", "layer"),
    ),
    TableSpec(
        name="framework_overhead",
        doc="Fixed memory the training framework takes on one GPU before any model tensor (CUDA context, kernels).",
        fields=(_f("gpu_type", _S), _f("overhead_bytes", _I)),
        key=("gpu_type",),
    ),
    TableSpec(
        name="network_links",
        doc=(
            "Bandwidth between `sender_count` GPUs of one node in `sender_zone` and `receiver_count` GPUs in "
            "`receiver_zone`: bw_GBps(x) = fit_a*u^2 + fit_b*u + fit_c with u = log2(bytes/1e6), capped at "
            "the largest measured bandwidth."
        ),
        fields=(
            _f("sender_zone", _S),
            _f("sender_gpu", _S),
            _f("sender_count", _I),
            _f("receiver_zone", _S),
            _f("receiver_gpu", _S),
            _f("receiver_count", _I),
            *_FIT,
        ),
        key=("sender_zone", "sender_gpu", "sender_count", "receiver_zone", "receiver_gpu", "receiver_count"),
    ),
    TableSpec(
        name="intra_node_links",
        doc="Collective bandwidth among `num_gpus` GPUs of one node, same fit as network_links.",
        fields=(_f("gpu_type", _S), _f("num_gpus", _I), *_FIT),
        key=("gpu_type", "num_gpus"),
    ),
    TableSpec(
        name="node_allreduce",
        doc=(
            "A measured all-reduce among `workers` GPUs of one node (one per worker): its algorithm "
            "bandwidth x / t(x) for x bytes per worker, same fit as network_links. The simulator uses it "
            "for a data-parallel group inside one node; elsewhere it composes rings from link hops."
        ),
        fields=(_f("gpu_type", _S), _f("workers", _I), *_FIT),
        key=("gpu_type", "workers"),
    ),
    TableSpec(
        name="link_allreduce",
        doc=(
            "A measured all-reduce between one GPU in `zone_a` and one in `zone_b`, a worker on each of two "
            "machines (`sailor profile link`): its algorithm bandwidth x / t(x) for x bytes per worker, same fit "
            "as network_links. The simulator times a data-parallel ring step over such a link from it "
            "(t(2 c) / 2 for a chunk of c bytes) instead of from the ping-pong link fit."
        ),
        fields=(_f("zone_a", _S), _f("gpu_a", _S), _f("zone_b", _S), _f("gpu_b", _S), *_FIT),
        key=("zone_a", "gpu_a", "zone_b", "gpu_b"),
    ),
    TableSpec(
        name="egress_prices",
        doc="USD per GB sent from one zone to another (0 within a zone).",
        fields=(_f("sender_zone", _S), _f("receiver_zone", _S), _f("usd_per_gb", _F)),
        key=("sender_zone", "receiver_zone"),
    ),
    TableSpec(
        name="gpu_prices",
        doc=(
            "Price of one GPU-hour of `gpu_type` in a zone on a market (on-demand | spot), as fetched at "
            "`fetched_at`. Every fetch is kept; the current price is the newest per (cloud, zone, gpu_type, market)."
        ),
        fields=(
            _f("cloud", _S),
            _f("zone", _S),
            _f("gpu_type", _S),
            _f("market", _S),
            _f("usd_per_gpu_hour", _F),
            _f("fetched_at", _TS),
        ),
        key=("cloud", "zone", "gpu_type", "market"),
        latest_by="fetched_at",
    ),
    TableSpec(
        name="quotas",
        doc="How many GPUs of a type the user may rent in a zone on a market.",
        fields=(
            _f("cloud", _S),
            _f("zone", _S),
            _f("region", _S),
            _f("gpu_type", _S),
            _f("market", _S),
            _f("max_gpus", _I),
        ),
        key=("cloud", "zone", "gpu_type", "market"),
    ),
    *(
        TableSpec(
            name=name,
            doc=f"Run history ({name}): one row per record of a run, `payload` a JSON object.",
            fields=_HISTORY_FIELDS,
            partition_by=("run_id",),
            key=None,
        )
        for name in HISTORY_TABLES
    ),
]

TABLES: dict[str, TableSpec] = {s.name: s for s in _SPECS}
PROFILE_TABLES = tuple(n for n in TABLES if n not in HISTORY_TABLES)
