"""The profile store: versioned Parquet tables on a local folder, S3 or GCS, over a read-only seed.

Contract
- `open_store(uri)` resolves the URI (see backend.py), checks the bucket/endpoint once, and returns
  a `ProfileStore`. Nothing is written until the first write; a local folder is created then.
- Layout: `<root>/_sailor_store.json` (format marker with the schema version) and, per table,
  `<root>/<table>/<col>=<value>/.../part-<time_ns>-<token>-<mode>.parquet` (partition folders as
  in schemas.py). Every write adds one new, uniquely named file per partition, committed
  atomically (backend.Location.put), so an interrupted write leaves the previous data readable and
  two writers never overwrite each other's rows.
- Reading a table: list its files (seed first, then the store's, each in write order); within each
  partition folder a `replace` file supersedes every older file; the rest are combined and, for
  keyed tables, the newest row per key wins. After a replace commits, the writer deletes the files
  it superseded (best effort; readers never need that to happen).
- Seed: the data shipped in `profiles_store/seed/` (the Sailor artifact's published profiles) is a
  read-only base layer below every store, on every backend: a store starts out listing it, its rows
  are overridden by rows of the same key (or a replace of the same partition) written to the store,
  and it is never copied. `open_store(uri, seed=False)` opens a store without it.
- Bad input (corrupt or truncated Parquet, a file of another schema version, unknown model or GPU
  type, unreachable endpoint, missing bucket or credentials) raises a one-line `SailorError`.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from profiles_store.backend import TMP_PREFIX, Location, redact, resolve
from profiles_store.schemas import (
    HISTORY_TABLES,
    META_TABLE,
    META_VERSION,
    SCHEMA_VERSION,
    STORE_FORMAT,
    TABLES,
    TableSpec,
)
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
    Provenance,
    default_region,
)
from sailor_core.errors import (
    SailorError,
    StoreError,
    UnknownGpuTypeError,
    UnknownModelError,
    ValidationError,
)
from sailor_core.profiles import ProfileBook

SEED_DIR = Path(__file__).resolve().parent / "seed"
MARKER = "_sailor_store.json"
FILE_RE = re.compile(r"^part-(\d{20})-([0-9a-z]+)-(replace|upsert)\.parquet$")
STALE_TMP_S = 3600.0  # a hidden temp file older than this belongs to a writer that died
_PROFILE_COLS = ("model", "gpu_type", "mbs", "tp", "layer", "forward_s", "backward_s", "optimizer_s")

_ts_lock = threading.Lock()
_last_ts = 0


def _next_ts() -> int:
    """Nanoseconds since the epoch, strictly increasing within this process (orders its writes)."""
    global _last_ts
    with _ts_lock:
        _last_ts = max(time.time_ns(), _last_ts + 1)
        return _last_ts


def _arrow_owned(data: bytes) -> pa.Buffer:
    """`data` copied into memory Arrow owns. A reader over Python `bytes` holds them through a PyBuffer
    that pyarrow's scanner threads may release after `read_table` returned; releasing it takes the GIL,
    and a thread that does so while the interpreter shuts down aborts the process ("terminate called
    without an active exception", exit 134, seen after a command printed its one-line error)."""
    owned = pa.allocate_buffer(len(data))
    memoryview(owned).cast("B")[:] = data
    return owned


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
        return {
            "model": self.model,
            "gpu_type": self.gpu_type,
            "rows": self.rows,
            "layers": self.layers,
            "mbs": list(self.mbs),
            "tp": list(self.tp),
            "source": self.source,
            "host": self.host,
            "recorded_at": self.recorded_at.isoformat(),
        }


@dataclass(frozen=True)
class _File:
    loc: Location
    path: str
    rel_dir: str
    order: tuple[int, int, str]  # (layer: 0 seed / 1 store, time_ns, token)
    mode: str


def _partition_dir(spec: TableSpec, values: Mapping[str, Any]) -> str:
    missing = [c for c in spec.partition_by if c not in values]
    if missing:
        raise SailorError(f"table {spec.name}: a write must name partition column(s) {missing}")
    return "/".join(f"{c}={quote(str(values[c]), safe='')}" for c in spec.partition_by)


def _parse_dir(rel_dir: str) -> dict[str, str] | None:
    if not rel_dir:
        return {}
    out = {}
    for part in rel_dir.split("/"):
        k, sep, v = part.partition("=")
        if not sep:
            return None
        out[k] = unquote(v)
    return out


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=UTC)


class ProfileStore:
    """Profiles, network links, prices, quotas and run history in versioned Parquet tables."""

    def __init__(
        self,
        location: Location,
        *,
        seed: Location | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        host: str | None = None,
    ) -> None:
        self.location = location
        self.seed = seed
        self.clock = clock
        self.host = host if host is not None else socket.gethostname()
        self._marker_ok = False

    @property
    def uri(self) -> str:
        """The store's URI as given, with any secret key hidden (safe to print)."""
        return redact(self.location.uri)

    def __repr__(self) -> str:
        return f"ProfileStore({self.uri!r}, seed={'yes' if self.seed else 'no'})"

    # ------------------------------------------------------------------------------------------
    # Layout, marker, version

    def check_marker(self) -> None:
        """Refuse a store written with another schema version (one line, with the fix)."""
        path = self.location.path(MARKER)
        try:
            raw = self.location.get(path)
        except FileNotFoundError:
            return
        try:
            meta = json.loads(raw)
            version = int(meta["schema_version"])
        except (ValueError, KeyError, TypeError):
            raise StoreError(
                f"{self.location.display(path)} is not a sailor store marker; to fix: delete it (it is "
                f"rewritten on the next write) or point --store at a sailor store"
            ) from None
        _check_version(version, f"store {self.uri}")
        self._marker_ok = True

    def _ensure_marker(self) -> None:
        if self._marker_ok:
            return
        path = self.location.path(MARKER)
        if not self.location.exists(path):
            body = {"format": STORE_FORMAT, "schema_version": SCHEMA_VERSION, "tables": sorted(TABLES)}
            self.location.put(path, json.dumps(body, indent=1).encode())
        self._marker_ok = True

    # ------------------------------------------------------------------------------------------
    # Generic table access

    @staticmethod
    def _listing(loc: Any, prefix: str) -> list[Any]:
        """The files under `prefix`. A local directory listing is no snapshot: one that starts before a
        replace renames its file in and reaches the superseded file after `_retire` deleted it sees
        neither (an empty partition). So a local folder is listed until two listings in a row agree."""
        got = loc.list_files(prefix)
        if not loc.is_local:
            return got
        for _ in range(8):
            again = loc.list_files(prefix)
            if [i.path for i in again] == [i.path for i in got]:
                return again
            got = again
        return got

    def _files(self, spec: TableSpec, where: Mapping[str, str | Sequence[str]]) -> list[_File]:
        # List only below the leading partition values that are fixed (fewer objects on S3).
        prefix = []
        for c in spec.partition_by:
            v = where.get(c)
            if not isinstance(v, str):
                break
            prefix.append(f"{c}={quote(v, safe='')}")
        found: list[_File] = []
        for layer, loc in ((0, self.seed), (1, self.location)):
            if loc is None:
                continue
            base = loc.path(spec.name)
            for info in self._listing(loc, loc.path(spec.name, *prefix)):
                rel_dir, _, name = info.path[len(base) + 1 :].rpartition("/")
                m = FILE_RE.match(name)
                values = _parse_dir(rel_dir)
                if not m or values is None or tuple(values) != spec.partition_by:
                    continue  # temp files, directory markers, foreign files: not ours
                if not all(
                    values[c] == v if isinstance(v, str) else values[c] in v
                    for c, v in where.items()
                    if c in values
                ):
                    continue
                found.append(_File(loc, info.path, rel_dir, (layer, int(m.group(1)), m.group(2)), m.group(3)))
        live: list[_File] = []
        by_dir: dict[str, list[_File]] = {}
        for f in found:
            by_dir.setdefault(f.rel_dir, []).append(f)
        for rel_dir in sorted(by_dir):
            files = sorted(by_dir[rel_dir], key=lambda f: f.order)
            last_replace = max((i for i, f in enumerate(files) if f.mode == "replace"), default=0)
            live.extend(files[last_replace:])
        return live

    def _read_file(self, spec: TableSpec, f: _File) -> pa.Table:
        shown = f.loc.display(f.path)
        data = _arrow_owned(f.loc.get(f.path))
        try:
            t = pq.read_table(pa.BufferReader(data))
        except (pa.ArrowException, OSError) as e:
            raise StoreError(
                f"{shown} is not a readable Parquet file (truncated or corrupt: {' '.join(str(e).split())[:160]}); "
                f"to fix: delete that file (the data written before it stays readable) or restore it from a backup"
            ) from None
        meta = t.schema.metadata or {}
        if META_VERSION in meta:
            try:
                version = int(meta[META_VERSION])
            except ValueError:
                version = -1
            _check_version(version, shown)
            if meta.get(META_TABLE, b"").decode() != spec.name:
                raise StoreError(
                    f"{shown} holds table {meta.get(META_TABLE, b'?').decode()!r}, not {spec.name!r}; "
                    f"to fix: move it out of {spec.name}/"
                )
        # a nullable column added after a file was written reads as nulls (not known)
        for col in spec.fields:
            if col.nullable and col.name not in t.column_names:
                t = t.append_column(col.name, pa.nulls(t.num_rows, col.type))
        missing = [c for c in spec.columns if c not in t.column_names]
        if missing:
            raise StoreError(
                f"{shown} does not have the columns of table {spec.name} (schema version {SCHEMA_VERSION}); "
                f"missing {missing}; to fix: delete it or rewrite it with this version of sailor"
            )
        try:
            return t.select(list(spec.columns)).cast(spec.schema)
        except (pa.ArrowException, ValueError) as e:
            raise StoreError(
                f"{shown} has columns of the wrong type for table {spec.name} ({e}); "
                f"to fix: delete it or rewrite it with this version of sailor"
            ) from None

    def read_table(
        self, name: str, where: Mapping[str, str | Sequence[str]] | None = None, *, latest: bool = True
    ) -> pa.Table:
        """The live rows of a table (Arrow). `where` filters on partition columns (a value or a list).

        `latest=False` keeps every version of a key (e.g. the price history) instead of the newest.
        """
        spec = _spec(name)
        where = dict(where or {})
        unknown = sorted(set(where) - set(spec.columns))
        if unknown:
            raise SailorError(f"table {spec.name} has no column(s) {unknown}; its columns are {list(spec.columns)}")
        for attempt in range(4):
            files = self._files(spec, where)
            try:
                if len(files) > 1 and not self.location.is_local:
                    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
                        parts = list(pool.map(lambda f: self._read_file(spec, f), files))
                else:
                    parts = [self._read_file(spec, f) for f in files]
                break
            except FileNotFoundError:
                # A replace retired a file between our listing and our read: list again.
                if attempt == 3:
                    raise StoreError(f"table {spec.name} keeps changing under the reader; to fix: retry") from None
        table = pa.concat_tables(parts) if parts else spec.schema.empty_table()
        for c, v in where.items():
            if c in spec.partition_by:
                continue
            table = table.filter(pc.is_in(table[c], pa.array([v] if isinstance(v, str) else list(v))))
        if latest and spec.key and table.num_rows:
            table = _newest_per_key(table, spec)
        sort_by = list(spec.key) if spec.key else ["time"] if "time" in spec.columns else []
        if sort_by and table.num_rows:
            table = table.take(pc.sort_indices(table, sort_keys=[(c, "ascending") for c in sort_by]))
        return table

    def write_table(
        self,
        name: str,
        rows: pa.Table | Iterable[Mapping[str, Any]],
        *,
        mode: str = "upsert",
        partition: Mapping[str, Any] | None = None,
        provenance: Provenance | None = None,
    ) -> int:
        """Add rows to a table; returns the number of rows written.

        mode "upsert": rows join the table (a row with an existing key wins over the old one).
        mode "replace": the rows become the whole content of their partition (`partition`, required
        for a partitioned table; an empty `rows` then empties it) or, unpartitioned, of the table.
        Rows spanning several partitions in upsert mode are written as one file per partition.
        Provenance columns missing from the rows are filled from `provenance`.
        """
        spec = _spec(name)
        if mode not in ("upsert", "replace"):
            raise SailorError(f"write mode must be 'upsert' or 'replace', got {mode!r}")
        table = self._to_table(spec, rows, provenance)
        if mode == "replace" and spec.partition_by:
            if partition is None:
                raise SailorError(f"replacing rows of {spec.name} needs partition={{{', '.join(spec.partition_by)}}}")
            groups = {_partition_dir(spec, partition): table}
            for c in spec.partition_by:
                bad = pc.any(pc.not_equal(table[c], pa.scalar(str(partition[c])))).as_py() if table.num_rows else False
                if bad:
                    raise SailorError(
                        f"rows for a replace of {spec.name} {dict(partition)} must all have {c}={partition[c]!r}"
                    )
        else:
            groups = _split_partitions(spec, table)
        self._ensure_marker()
        for rel_dir, part in groups.items():
            self._commit(spec, rel_dir, part, mode)
        return table.num_rows

    def _to_table(
        self, spec: TableSpec, rows: pa.Table | Iterable[Mapping[str, Any]], prov: Provenance | None
    ) -> pa.Table:
        p = prov or Provenance(source="sailor", host=self.host, recorded_at=self.clock())
        fill = {"source": p.source, "host": p.host, "recorded_at": _utc(p.recorded_at), "settings": p.settings}
        try:
            if isinstance(rows, pa.Table):
                cols = {}
                for f in spec.schema:
                    if f.name in rows.column_names:
                        cols[f.name] = rows[f.name].cast(f.type)
                    elif f.name in fill:
                        cols[f.name] = pa.array([fill[f.name]] * rows.num_rows, f.type)
                    else:
                        cols[f.name] = pa.nulls(rows.num_rows, f.type)
                table = pa.table(cols, schema=spec.schema)
            else:
                table = pa.Table.from_pylist([{**fill, **r} for r in rows], schema=spec.schema)
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise SailorError(f"rows for table {spec.name} do not fit its schema: {e}") from None
        for c in spec.required:
            if table[c].null_count:
                raise SailorError(f"rows for table {spec.name} have empty {c!r}; every row needs it")
        return table

    def _commit(self, spec: TableSpec, rel_dir: str, table: pa.Table, mode: str) -> str:
        name = f"part-{_next_ts():020d}-{secrets.token_hex(8)}-{mode}.parquet"
        path = self.location.path(spec.name, rel_dir, name)
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf, compression="zstd")
        self.location.put(path, buf.getvalue())
        if mode == "replace":
            self._retire(spec, rel_dir, name)
        return path

    def _retire(self, spec: TableSpec, rel_dir: str, keep: str) -> None:
        """Delete what a committed replace superseded. Best effort: readers skip those files anyway."""
        base = self.location.path(spec.name, rel_dir)
        keep_key = FILE_RE.match(keep).group(1, 2)  # type: ignore[union-attr]
        now = time.time()
        try:
            infos = self.location.list_files(base)
        except StoreError:
            return
        for info in infos:
            rel = info.path[len(base) + 1 :]
            if "/" in rel:
                continue
            m = FILE_RE.match(rel)
            stale_tmp = (
                rel.startswith(TMP_PREFIX) and info.mtime is not None and now - info.mtime.timestamp() > STALE_TMP_S
            )
            if (m and (m.group(1), m.group(2)) < keep_key) or stale_tmp:
                try:
                    self.location.delete(info.path)
                except (StoreError, FileNotFoundError):
                    pass

    def partitions(self, name: str) -> list[dict[str, str]]:
        """The partitions of a table that hold files (seed included), without reading them."""
        spec = _spec(name)
        seen = {f.rel_dir for f in self._files(spec, {})}
        return [v for v in (_parse_dir(d) for d in sorted(seen)) if v is not None]

    # ------------------------------------------------------------------------------------------
    # Models and GPU types

    def model_names(self) -> list[str]:
        return sorted({p["model"] for p in self.partitions("model_layers")})

    def model(self, name: str) -> ModelSpec:
        t = self.read_table("model_layers", {"model": name})
        if not t.num_rows:
            raise UnknownModelError(
                f"unknown model {name!r}; the store at {self.uri} has {self.model_names()}; to fix: use one of "
                f"those, or write its layer specs (sailor profiles import-eth-easl, or ProfileStore.write_model)"
            )
        rows = t.to_pylist()
        arch = {
            k: rows[0][k]
            for k in ("num_blocks", "hidden_size", "num_heads", "sequence_length", "vocab_size", "ffn_hidden_size")
        }
        layers = tuple(
            LayerSpec(
                index=r["layer"], kind=r["kind"], tp=r["tp"], params=r["params"],
                act_output_elems=r["act_output_elems"], act_input_elems=r["act_input_elems"],
                act_memory_bytes=r["act_memory_bytes"],
            )
            for r in rows
        )
        return ModelSpec(name=name, layers=layers, tied_head=bool(rows[0].get("tied_head")), **arch)

    def write_model(self, spec: ModelSpec, *, provenance: Provenance | None = None) -> None:
        """Replace a model's architecture and per-layer sizes (every TP degree) in one commit."""
        arch = dict(
            model=spec.name, num_blocks=spec.num_blocks, hidden_size=spec.hidden_size, num_heads=spec.num_heads,
            sequence_length=spec.sequence_length, vocab_size=spec.vocab_size, ffn_hidden_size=spec.ffn_hidden_size,
            tied_head=spec.tied_head,
        )
        rows = [
            dict(arch, tp=ly.tp, layer=ly.index, kind=ly.kind, params=ly.params, act_output_elems=ly.act_output_elems,
                 act_input_elems=ly.act_input_elems, act_memory_bytes=ly.act_memory_bytes)
            for ly in spec.layers
        ]
        self.write_table("model_layers", rows, mode="replace", partition={"model": spec.name}, provenance=provenance)

    def gpu_types(self) -> dict[str, GpuType]:
        return {
            r["gpu_type"]: GpuType(
                name=r["gpu_type"],
                memory_bytes=r["memory_bytes"],
                gpus_per_node=r["gpus_per_node"],
                peak_flops=r["peak_flops"],
            )
            for r in self.read_table("gpu_types").to_pylist()
        }

    def write_gpu_types(self, types: Iterable[GpuType], *, provenance: Provenance | None = None) -> None:
        rows = [
            dict(gpu_type=g.name, memory_bytes=g.memory_bytes, gpus_per_node=g.gpus_per_node, peak_flops=g.peak_flops)
            for g in types
        ]
        self.write_table("gpu_types", rows, provenance=provenance)

    def require_gpu_types(self, names: Iterable[str], known: Mapping[str, GpuType] | None = None) -> dict[str, GpuType]:
        known = dict(known if known is not None else self.gpu_types())
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise UnknownGpuTypeError(
                f"unknown GPU type(s) {unknown}; the store at {self.uri} knows {sorted(known)}; to fix: use one of "
                f"those names or add the type first (ProfileStore.write_gpu_types)"
            )
        return known

    # ------------------------------------------------------------------------------------------
    # Layer profiles

    def layer_profiles(self, model: str, gpu_types: Sequence[str] | None = None) -> tuple[LayerProfile, ...]:
        where: dict[str, str | Sequence[str]] = {"model": model}
        if gpu_types is not None:
            where["gpu_type"] = list(gpu_types)
        t = self.read_table("layer_profiles", where)
        cols = [t[c].to_pylist() for c in _PROFILE_COLS]
        return tuple(LayerProfile(**dict(zip(_PROFILE_COLS, vals, strict=True))) for vals in zip(*cols, strict=True))

    def replace_layer_profiles(
        self, model: str, gpu_type: str, profiles: Iterable[LayerProfile], *, provenance: Provenance | None = None
    ) -> int:
        """Make `profiles` the whole layer profile of (model, gpu_type), in one atomic commit."""
        spec = self.model(model)
        self.require_gpu_types([gpu_type])
        cols: dict[str, list] = {c: [] for c in _PROFILE_COLS}
        for p in profiles:
            if p.model != model or p.gpu_type != gpu_type:
                raise SailorError(
                    f"profile row for ({p.model}, {p.gpu_type}) given to replace ({model}, {gpu_type}); "
                    f"to fix: write each (model, GPU type) separately"
                )
            if not 0 <= p.layer < spec.num_layers:
                raise SailorError(
                    f"profile row layer {p.layer} is outside model {model}'s layers 0..{spec.num_layers - 1}"
                )
            for c, values in cols.items():
                values.append(getattr(p, c))
        return self.write_table(
            "layer_profiles",
            pa.table({c: pa.array(v, TABLES["layer_profiles"].schema.field(c).type) for c, v in cols.items()}),
            mode="replace",
            partition={"model": model, "gpu_type": gpu_type},
            provenance=provenance,
        )

    def list_pairs(self) -> list[PairSummary]:
        """Every (model, GPU type) with layer profiles, with what was profiled and where it came from."""
        t = self.read_table("layer_profiles")
        out: list[PairSummary] = []
        if not t.num_rows:
            return out
        g = t.group_by(["model", "gpu_type"], use_threads=False).aggregate(
            [
                ("layer", "count"),
                ("layer", "count_distinct"),
                ("mbs", "distinct"),
                ("tp", "distinct"),
                ("source", "max"),
                ("host", "max"),
                ("recorded_at", "max"),
            ]
        )
        for r in g.to_pylist():
            out.append(
                PairSummary(
                    model=r["model"], gpu_type=r["gpu_type"], rows=r["layer_count"], layers=r["layer_count_distinct"],
                    mbs=tuple(sorted(r["mbs_distinct"])), tp=tuple(sorted(r["tp_distinct"])),
                    source=r["source_max"], host=r["host_max"] or "", recorded_at=r["recorded_at_max"],
                )
            )
        return sorted(out, key=lambda s: (s.model, s.gpu_type))

    # ------------------------------------------------------------------------------------------
    # Memory, network, prices, quotas

    def framework_overhead(self) -> dict[str, int]:
        return {r["gpu_type"]: r["overhead_bytes"] for r in self.read_table("framework_overhead").to_pylist()}

    def write_framework_overhead(
        self, overhead_bytes: Mapping[str, int], *, provenance: Provenance | None = None
    ) -> None:
        self.require_gpu_types(overhead_bytes)
        for g, b in overhead_bytes.items():
            if b < 0:
                raise ValidationError(f"framework overhead for {g} must be >= 0 bytes, got {b}")
        rows = [dict(gpu_type=g, overhead_bytes=int(b)) for g, b in overhead_bytes.items()]
        self.write_table("framework_overhead", rows, provenance=provenance)

    def network_links(self) -> tuple[NetworkLink, ...]:
        return tuple(
            NetworkLink(
                sender_zone=r["sender_zone"], sender_gpu=r["sender_gpu"], sender_count=r["sender_count"],
                receiver_zone=r["receiver_zone"], receiver_gpu=r["receiver_gpu"], receiver_count=r["receiver_count"],
                fit=_fit(r),
            )
            for r in self.read_table("network_links").to_pylist()
        )

    def write_network_links(
        self, links: Iterable[NetworkLink], *, replace_all: bool = False, provenance: Provenance | None = None
    ) -> None:
        """Upsert links by (sender zone, GPU, count, receiver zone, GPU, count); `replace_all` drops the rest."""
        rows = [
            dict(sender_zone=lk.sender_zone, sender_gpu=lk.sender_gpu, sender_count=lk.sender_count,
                 receiver_zone=lk.receiver_zone, receiver_gpu=lk.receiver_gpu, receiver_count=lk.receiver_count,
                 **_fit_cols(lk.fit))
            for lk in links
        ]
        self.write_table("network_links", rows, mode="replace" if replace_all else "upsert", provenance=provenance)

    def intra_node_links(self) -> tuple[IntraNodeLink, ...]:
        return tuple(
            IntraNodeLink(gpu_type=r["gpu_type"], num_gpus=r["num_gpus"], fit=_fit(r))
            for r in self.read_table("intra_node_links").to_pylist()
        )

    def write_intra_node_links(
        self, links: Iterable[IntraNodeLink], *, replace_all: bool = False, provenance: Provenance | None = None
    ) -> None:
        rows = [dict(gpu_type=x.gpu_type, num_gpus=x.num_gpus, **_fit_cols(x.fit)) for x in links]
        self.write_table("intra_node_links", rows, mode="replace" if replace_all else "upsert", provenance=provenance)

    def link_allreduce(self) -> tuple[LinkAllReduce, ...]:
        return tuple(
            LinkAllReduce(zone_a=r["zone_a"], gpu_a=r["gpu_a"], zone_b=r["zone_b"], gpu_b=r["gpu_b"], fit=_fit(r))
            for r in self.read_table("link_allreduce").to_pylist()
        )

    def write_link_allreduce(
        self, fits: Iterable[LinkAllReduce], *, replace_all: bool = False, provenance: Provenance | None = None
    ) -> None:
        """Upsert by (zone_a, gpu_a, zone_b, gpu_b); a caller stores both orders of a pair (the readers look
        one up as a ring hop meets it)."""
        rows = [dict(zone_a=x.zone_a, gpu_a=x.gpu_a, zone_b=x.zone_b, gpu_b=x.gpu_b, **_fit_cols(x.fit)) for x in fits]
        self.write_table("link_allreduce", rows, mode="replace" if replace_all else "upsert", provenance=provenance)

    def node_allreduce(self) -> tuple[NodeAllReduce, ...]:
        return tuple(
            NodeAllReduce(gpu_type=r["gpu_type"], workers=r["workers"], fit=_fit(r))
            for r in self.read_table("node_allreduce").to_pylist()
        )

    def write_node_allreduce(
        self, fits: Iterable[NodeAllReduce], *, replace_all: bool = False, provenance: Provenance | None = None
    ) -> None:
        rows = [dict(gpu_type=x.gpu_type, workers=x.workers, **_fit_cols(x.fit)) for x in fits]
        self.write_table("node_allreduce", rows, mode="replace" if replace_all else "upsert", provenance=provenance)

    def egress_prices(self) -> tuple[EgressPrice, ...]:
        return tuple(
            EgressPrice(**r)
            for r in self.read_table("egress_prices").select(["sender_zone", "receiver_zone", "usd_per_gb"]).to_pylist()
        )

    def write_egress_prices(self, prices: Iterable[EgressPrice], *, provenance: Provenance | None = None) -> None:
        rows = [dict(sender_zone=e.sender_zone, receiver_zone=e.receiver_zone, usd_per_gb=e.usd_per_gb) for e in prices]
        self.write_table("egress_prices", rows, provenance=provenance)

    def prices(self, *, history: bool = False) -> tuple[GpuPrice, ...]:
        """Current GPU prices (newest `fetched_at` per cloud, zone, GPU type, market); `history` keeps all."""
        t = self.read_table("gpu_prices", latest=not history)
        return tuple(
            GpuPrice(cloud=r["cloud"], zone=r["zone"], gpu_type=r["gpu_type"], market=r["market"],
                     usd_per_gpu_hour=r["usd_per_gpu_hour"], fetched_at=r["fetched_at"])
            for r in t.to_pylist()
        )

    def write_prices(self, prices: Iterable[GpuPrice], *, provenance: Provenance | None = None) -> None:
        """Record fetched prices; every fetch is kept (history), the newest per key is current."""
        now = self.clock()
        rows = [
            dict(cloud=p.cloud, zone=p.zone, gpu_type=p.gpu_type, market=Market.parse(p.market).value,
                 usd_per_gpu_hour=p.usd_per_gpu_hour, fetched_at=_utc(p.fetched_at or now))
            for p in prices
        ]
        self.write_table("gpu_prices", rows, provenance=provenance)

    def quotas(self) -> tuple[Capacity, ...]:
        """Quotas as pool entries: GPUs per node from the GPU types, price from the current prices."""
        types = self.gpu_types()
        price = {(p.cloud, p.zone, p.gpu_type, p.market): p.usd_per_gpu_hour for p in self.prices()}
        out = []
        for r in self.read_table("quotas").to_pylist():
            market = Market.parse(r["market"])
            g = types.get(r["gpu_type"])
            out.append(
                Capacity(
                    zone=r["zone"], region=r["region"], gpu_type=r["gpu_type"], gpus=r["max_gpus"], market=market,
                    gpus_per_vm=g.gpus_per_node if g else 1,
                    usd_per_gpu_hour=price.get((r["cloud"], r["zone"], r["gpu_type"], market), 0.0), cloud=r["cloud"],
                )
            )
        return tuple(out)

    def write_quotas(self, entries: Iterable[Capacity], *, provenance: Provenance | None = None) -> None:
        rows = [
            dict(cloud=e.cloud, zone=e.zone, region=e.region or default_region(e.zone), gpu_type=e.gpu_type,
                 market=Market.parse(e.market).value, max_gpus=e.gpus)
            for e in entries
        ]
        self.write_table("quotas", rows, provenance=provenance)

    # ------------------------------------------------------------------------------------------
    # What the simulator and planner read

    def profile_book(self, model: str, gpu_types: Sequence[str] | None = None) -> ProfileBook:
        """Everything known about `model` on `gpu_types` (default: every GPU type the store knows).

        Unknown model or GPU type: `SailorError` naming what the store has. A known GPU type without
        layer profiles for the model is not an error here; `ProfileBook.layers` says what is missing.
        """
        spec = self.model(model)
        known = self.gpu_types()
        if gpu_types is None:
            wanted = set(known)
        else:
            wanted = set(gpu_types)
            self.require_gpu_types(wanted, known)
        grouped: dict[tuple[str, int, int], list[LayerProfile]] = {}
        for p in self.layer_profiles(model, sorted(wanted)):
            grouped.setdefault((p.gpu_type, p.mbs, p.tp), []).append(p)
        return ProfileBook(
            model=spec,
            gpu_types={g: t for g, t in known.items() if g in wanted},
            layer_profiles={k: tuple(sorted(v, key=lambda x: x.layer)) for k, v in grouped.items()},
            framework_overhead_bytes={g: b for g, b in self.framework_overhead().items() if g in wanted},
            links=tuple(lk for lk in self.network_links() if lk.sender_gpu in wanted and lk.receiver_gpu in wanted),
            intra_node=tuple(x for x in self.intra_node_links() if x.gpu_type in wanted),
            node_allreduce=tuple(x for x in self.node_allreduce() if x.gpu_type in wanted),
            link_allreduce=tuple(x for x in self.link_allreduce() if x.gpu_a in wanted and x.gpu_b in wanted),
            egress=self.egress_prices(),
            prices=tuple(p for p in self.prices() if p.gpu_type in wanted),
        )

    # ------------------------------------------------------------------------------------------
    # Run history

    def append_history(
        self, table: str, records: Iterable[HistoryRecord], *, provenance: Provenance | None = None
    ) -> int:
        """Append records to a run-history table (runs, events, decisions, plans, measurements)."""
        if table not in HISTORY_TABLES:
            raise SailorError(f"{table!r} is not a run-history table; use one of {list(HISTORY_TABLES)}")
        p = provenance or Provenance(source="sailor", host=self.host, recorded_at=self.clock())
        rows = []
        for r in records:
            try:
                payload = json.dumps(dict(r.payload), sort_keys=True, default=str)
            except (TypeError, ValueError) as e:
                raise SailorError(
                    f"{table} record for run {r.run_id}: payload is not JSON-serialisable ({e})"
                ) from None
            rows.append(
                dict(run_id=r.run_id, time=_utc(r.time), kind=r.kind, reason=r.reason, payload=payload,
                     source=r.source or p.source, host=r.host or p.host)
            )
        return self.write_table(table, rows, provenance=p)

    def read_history(self, table: str, *, run_id: str | None = None, kind: str | None = None) -> list[HistoryRecord]:
        """Records of a run-history table in time order, optionally of one run and/or one kind."""
        if table not in HISTORY_TABLES:
            raise SailorError(f"{table!r} is not a run-history table; use one of {list(HISTORY_TABLES)}")
        where: dict[str, str] = {}
        if run_id is not None:
            where["run_id"] = run_id
        if kind is not None:
            where["kind"] = kind
        return [
            HistoryRecord(run_id=r["run_id"], kind=r["kind"], time=r["time"], reason=r["reason"] or "",
                          payload=json.loads(r["payload"] or "{}"), source=r["source"], host=r["host"] or "")
            for r in self.read_table(table, where).to_pylist()
        ]

    # ------------------------------------------------------------------------------------------
    # Import / export

    def export_csv(self, out_dir: str | Path, tables: Sequence[str] | None = None) -> dict[str, int]:
        """Write one CSV per table (live rows, seed included) into a local folder; rows per table."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        counts = {}
        for name in tables or list(TABLES):
            t = self.read_table(name)
            if not t.num_rows and name in HISTORY_TABLES:
                continue
            buf = io.BytesIO()
            pacsv.write_csv(t, buf)
            (out / f"{name}.csv").write_bytes(buf.getvalue())
            counts[name] = t.num_rows
        return counts


def _spec(name: str) -> TableSpec:
    try:
        return TABLES[name]
    except KeyError:
        raise SailorError(f"unknown table {name!r}; the store has {sorted(TABLES)}") from None


def _check_version(version: int, what: str) -> None:
    if version == SCHEMA_VERSION:
        return
    if version > SCHEMA_VERSION:
        fix = f"upgrade sailor-prefect to a release that reads schema version {version} (pip install -U sailor-prefect)"
    else:
        fix = (
            "rewrite the data with this release (re-run the import or profiling that produced it), or read it "
            "with the release that wrote it and `sailor profiles export` it to CSV"
        )
    raise StoreError(
        f"{what} uses store schema version {version}; this sailor reads version {SCHEMA_VERSION}; to fix: {fix}"
    )


def _split_partitions(spec: TableSpec, table: pa.Table) -> dict[str, pa.Table]:
    if not spec.partition_by:
        return {"": table}
    if not table.num_rows:
        return {}
    keys = table.select(list(spec.partition_by)).to_pylist()
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(_partition_dir(spec, k), []).append(i)
    return {d: table.take(pa.array(idx)) for d, idx in groups.items()}


def _newest_per_key(table: pa.Table, spec: TableSpec) -> pa.Table:
    """Keep, per key, the row written last (or with the newest `latest_by`, then written last)."""
    order = pa.array(range(table.num_rows), pa.int64())
    if spec.latest_by:
        idx = pc.sort_indices(
            pa.table({"t": table[spec.latest_by], "i": order}),
            sort_keys=[("t", "ascending", "at_start"), ("i", "ascending", "at_end")],
        )
        table = table.take(idx)
    keyed = table.select(list(spec.key or ())).append_column("__i", order)
    last = keyed.group_by(list(spec.key or ()), use_threads=False).aggregate([("__i", "max")])["__i_max"]
    return table.take(last)


def _fit(r: Mapping[str, Any]) -> BandwidthFit:
    return BandwidthFit(
        coeffs=(r["fit_a"], r["fit_b"], r["fit_c"]),
        max_bytes_per_s=r["max_bandwidth_bytes_per_s"],
        latency_s=r["latency_s"],
    )


def _fit_cols(f: BandwidthFit) -> dict[str, float]:
    a, b, c = f.coeffs
    return dict(fit_a=a, fit_b=b, fit_c=c, max_bandwidth_bytes_per_s=f.max_bytes_per_s, latency_s=f.latency_s)


def open_store(
    uri: str | None = None,
    *,
    seed: bool = True,
    clock: Callable[[], datetime] | None = None,
    host: str | None = None,
    env: Mapping[str, str] | None = None,
) -> ProfileStore:
    """Open the store at `uri` (None: $SAILOR_STORE, else .sailor/store under the current directory).

    `seed=True` lays the shipped seed data (the Sailor artifact's profiles) under the store as a
    read-only base layer. Checks the bucket or folder and the schema version once; writes nothing.
    `env`: the environment that completes the URI (sailor_core.uris); the CLI and the flow pass
    `os.environ`, which is also what None stands for (a notebook's or a bench's `open_store(uri)`).
    """
    loc = resolve(uri, os.environ if env is None else env)
    loc.check_reachable()
    seed_loc = resolve(str(SEED_DIR), {}) if seed else None  # a local folder: no environment to consult
    store = ProfileStore(loc, seed=seed_loc, clock=clock or (lambda: datetime.now(UTC)), host=host)
    store.check_marker()
    return store
