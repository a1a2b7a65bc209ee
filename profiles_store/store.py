"""The profile store: versioned Parquet tables on a local folder, S3 or GCS, over a read-only seed.

Contract
- `open_store(uri)` resolves the URI (see backend.py), checks the bucket/endpoint once, and returns
  a `ProfileStore`. Nothing is written until the first write; a local folder is created then.
- Every table is data (tables.py): `read(table)` returns its values, `write(table, values)` adds
  them; `read_table` / `write_table` are the same on Arrow tables by name. Whatever is more than
  one table (a model's `ProfileBook`, quotas as pool entries, the profiled pairs) is composed from
  them in views.py.
- Layout: `<root>/_sailor_store.json` (format marker with the schema version) and, per table,
  `<root>/<table>/<col>=<value>/.../part-<time_ns>-<token>-<mode>.parquet` (partition folders as
  in schemas.py). Every write adds one new, uniquely named file per partition, committed
  atomically (backend.Location.put), so an interrupted write leaves the previous data readable and
  two writers never overwrite each other's rows (files.py).
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
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from profiles_store import views
from profiles_store.backend import Location, redact, resolve
from profiles_store.files import TableFiles, check_version, newest_per_key, parse_dir, partition_dir, split_partitions
from profiles_store.schemas import HISTORY_TABLES, SCHEMA_VERSION, STORE_FORMAT, TABLES, TableSpec
from profiles_store.tables import GPU_TYPES, HISTORY, LAYER_PROFILES, MODELS, TYPED, HistoryRecord, Table
from profiles_store.views import PairSummary
from sailor_core.domain import Capacity, GpuType, LayerProfile, ModelSpec, Provenance
from sailor_core.errors import SailorError, StoreError, UnknownGpuTypeError, UnknownModelError
from sailor_core.files import write_atomic
from sailor_core.profiles import ProfileBook

SEED_DIR = Path(__file__).resolve().parent / "seed"
MARKER = "_sailor_store.json"
T = TypeVar("T")
Where = Mapping[str, "str | Sequence[str]"]

__all__ = ["SEED_DIR", "HistoryRecord", "PairSummary", "ProfileStore", "open_store"]


class ProfileStore:
    """Profiles, network links, prices, quotas and run history in versioned Parquet tables."""

    def __init__(self, location: Location, *, seed: Location | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC), host: str | None = None) -> None:
        self.location = location
        self.seed = seed
        self.clock = clock
        self.host = host if host is not None else socket.gethostname()
        self._marker_ok = False

    @property
    def files(self) -> TableFiles:
        """The tables' files in the store's two layers, at its current location."""
        return TableFiles(self.location, self.seed)

    @property
    def uri(self) -> str:
        """The store's URI as given, with any secret key hidden (safe to print)."""
        return redact(self.location.uri)

    def __repr__(self) -> str:
        return f"ProfileStore({self.uri!r}, seed={'yes' if self.seed else 'no'})"

    # -- marker and version ----------------------------------------------------------------------

    def check_marker(self) -> None:
        """Refuse a store written with another schema version (one line, with the fix)."""
        path = self.location.path(MARKER)
        try:
            raw = self.location.get(path)
        except FileNotFoundError:
            return
        try:
            version = int(json.loads(raw)["schema_version"])
        except (ValueError, KeyError, TypeError):
            raise StoreError(
                f"{self.location.display(path)} is not a sailor store marker; to fix: delete it (it is "
                f"rewritten on the next write) or point --store at a sailor store"
            ) from None
        check_version(version, f"store {self.uri}")
        self._marker_ok = True

    def _ensure_marker(self) -> None:
        if self._marker_ok:
            return
        path = self.location.path(MARKER)
        if not self.location.exists(path):
            body = {"format": STORE_FORMAT, "schema_version": SCHEMA_VERSION, "tables": sorted(TABLES)}
            self.location.put(path, json.dumps(body, indent=1).encode())
        self._marker_ok = True

    # -- every table: values ---------------------------------------------------------------------

    def read(self, table: Table[T], where: Where | None = None, *, latest: bool = True) -> tuple[T, ...]:
        """The values of `table` (tables.py); `where` and `latest` as in `read_table`."""
        return table.decode(self.read_table(table.name, where, latest=latest).to_pylist())

    def write(self, table: Table[T] | str, values: Iterable[T], *, mode: str | None = None,
              partition: Mapping[str, Any] | None = None, provenance: Provenance | None = None) -> int:
        """Add `values` to `table` (or the table of that name: for writers that do not import this
        package, such as sailor_core's profiler); the mode is the table's own unless given (see
        `write_table`). GPU types the table names must be known; a version column left empty gets
        the write's time."""
        if isinstance(table, str):
            table = _typed(table)
        rows = table.encode(values)
        if table.gpu_type_column is not None:
            self.require_gpu_types({r[table.gpu_type_column] for r in rows})
        stamp = table.spec.latest_by
        if stamp is not None:
            now = self.clock()
            rows = [r if r.get(stamp) is not None else {**r, stamp: now if now.tzinfo else now.replace(tzinfo=UTC)}
                    for r in rows]
        return self.write_table(table.name, rows, mode=mode or table.mode, partition=partition, provenance=provenance)

    # -- every table: Arrow ----------------------------------------------------------------------

    def read_table(self, name: str, where: Where | None = None, *, latest: bool = True) -> pa.Table:
        """The live rows of a table (Arrow). `where` filters on any column (a value or a list).

        `latest=False` keeps every version of a key (e.g. the price history) instead of the newest.
        """
        spec = _spec(name)
        where = dict(where or {})
        unknown = sorted(set(where) - set(spec.columns))
        if unknown:
            raise SailorError(f"table {spec.name} has no column(s) {unknown}; its columns are {list(spec.columns)}")
        table = self._read_files(spec, where)
        for c, v in where.items():
            if c not in spec.partition_by:
                table = table.filter(pc.is_in(table[c], pa.array([v] if isinstance(v, str) else list(v))))
        if latest and spec.key and table.num_rows:
            table = newest_per_key(table, spec)
        sort_by = list(spec.key) if spec.key else ["time"] if "time" in spec.columns else []
        if sort_by and table.num_rows:
            table = table.take(pc.sort_indices(table, sort_keys=[(c, "ascending") for c in sort_by]))
        return table

    def _read_files(self, spec: TableSpec, where: Where) -> pa.Table:
        """Every live file's rows of `spec` (partition columns filtered by `where`), concatenated."""
        for attempt in range(4):
            files = self.files.live(spec, where)
            try:
                if len(files) > 1 and not self.location.is_local:
                    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
                        parts = list(pool.map(lambda f: self.files.read(spec, f), files))
                else:
                    parts = [self.files.read(spec, f) for f in files]
                return pa.concat_tables(parts) if parts else spec.schema.empty_table()
            except FileNotFoundError:
                # A replace retired a file between our listing and our read: list again.
                if attempt == 3:
                    raise StoreError(f"table {spec.name} keeps changing under the reader; to fix: retry") from None
        raise AssertionError("unreachable")

    def write_table(self, name: str, rows: pa.Table | Iterable[Mapping[str, Any]], *, mode: str = "upsert",
                    partition: Mapping[str, Any] | None = None, provenance: Provenance | None = None) -> int:
        """Add rows to a table; returns the number of rows written.

        mode "upsert": rows join the table (a row with an existing key wins over the old one).
        mode "replace": the rows become the whole content of their partition (`partition`: the one
        partition they replace, which an empty `rows` then empties; without it, every partition the
        rows fall in) or, unpartitioned, of the table. Rows spanning several partitions are written
        as one file per partition. Provenance columns missing from the rows are filled from `provenance`.
        """
        spec = _spec(name)
        if mode not in ("upsert", "replace"):
            raise SailorError(f"write mode must be 'upsert' or 'replace', got {mode!r}")
        table = self._to_table(spec, rows, provenance)
        if mode == "replace" and spec.partition_by and partition is not None:
            groups = {partition_dir(spec, partition): table}
            for c in spec.partition_by:
                bad = pc.any(pc.not_equal(table[c], pa.scalar(str(partition[c])))).as_py() if table.num_rows else False
                if bad:
                    raise SailorError(
                        f"rows for a replace of {spec.name} {dict(partition)} must all have {c}={partition[c]!r}"
                    )
        else:
            groups = split_partitions(spec, table)
        self._ensure_marker()
        for rel_dir, part in groups.items():
            self.files.commit(spec, rel_dir, part, mode)
        return table.num_rows

    def _to_table(self, spec: TableSpec, rows: pa.Table | Iterable[Mapping[str, Any]],
                  prov: Provenance | None) -> pa.Table:
        p = prov or Provenance(source="sailor", host=self.host, recorded_at=self.clock())
        at = p.recorded_at if p.recorded_at.tzinfo else p.recorded_at.replace(tzinfo=UTC)
        fill = {"source": p.source, "host": p.host, "recorded_at": at, "settings": p.settings}
        try:
            if isinstance(rows, pa.Table):
                cols = {f.name: rows[f.name].cast(f.type) if f.name in rows.column_names
                        else pa.array([fill[f.name]] * rows.num_rows, f.type) if f.name in fill
                        else pa.nulls(rows.num_rows, f.type) for f in spec.schema}
                table = pa.table(cols, schema=spec.schema)
            else:
                table = pa.Table.from_pylist([{**fill, **r} for r in rows], schema=spec.schema)
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise SailorError(f"rows for table {spec.name} do not fit its schema: {e}") from None
        for c in spec.required:
            if table[c].null_count:
                raise SailorError(f"rows for table {spec.name} have empty {c!r}; every row needs it")
        return table

    def partitions(self, name: str) -> list[dict[str, str]]:
        """The partitions of a table that hold files (seed included), without reading them."""
        seen = {f.rel_dir for f in self.files.live(_spec(name), {})}
        return [v for v in (parse_dir(d) for d in sorted(seen)) if v is not None]

    # -- lookups that name what the store has ----------------------------------------------------

    def model_names(self) -> list[str]:
        return sorted({p["model"] for p in self.partitions(MODELS.name)})

    def model(self, name: str) -> ModelSpec:
        found = self.read(MODELS, {"model": name})
        if not found:
            raise UnknownModelError(
                f"unknown model {name!r}; the store at {self.uri} has {self.model_names()}; to fix: use one of "
                f"those, or write its layer specs (sailor profiles import-eth-easl, or store.write(MODELS, ...))"
            )
        return found[0]

    def gpu_types(self) -> dict[str, GpuType]:
        """Every GPU type the store knows, by name."""
        return {g.name: g for g in self.read(GPU_TYPES)}

    def require_gpu_types(self, names: Iterable[str], known: Mapping[str, GpuType] | None = None) -> dict[str, GpuType]:
        known = dict(known if known is not None else self.gpu_types())
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise UnknownGpuTypeError(
                f"unknown GPU type(s) {unknown}; the store at {self.uri} knows {sorted(known)}; to fix: use one of "
                f"those names or add the type first (store.write(GPU_TYPES, ...))"
            )
        return known

    def replace_layer_profiles(self, model: str, gpu_type: str, profiles: Iterable[LayerProfile], *,
                               provenance: Provenance | None = None) -> int:
        """Make `profiles` the whole layer profile of (model, gpu_type), in one atomic commit."""
        self.require_gpu_types([gpu_type])  # also when `profiles` is empty
        rows = views.checked_profiles(self.model(model), gpu_type, profiles)
        return self.write(LAYER_PROFILES, rows, mode="replace", partition={"model": model, "gpu_type": gpu_type},
                          provenance=provenance)

    # -- what is composed of several tables (views.py) -------------------------------------------

    def profile_book(self, model: str, gpu_types: Sequence[str] | None = None) -> ProfileBook:
        """Everything known about `model` on `gpu_types` (default: every GPU type the store knows)."""
        return views.profile_book(self, model, gpu_types)

    def quotas(self) -> tuple[Capacity, ...]:
        """Quotas as pool entries: GPUs per node from the GPU types, price from the current prices."""
        return views.quota_pool(self)

    def list_pairs(self) -> list[PairSummary]:
        """Every (model, GPU type) with layer profiles, with what was profiled and where it came from."""
        return views.pair_summaries(self.read_table(LAYER_PROFILES.name))

    # -- run history -----------------------------------------------------------------------------

    def append_history(self, table: str, records: Iterable[HistoryRecord], *,
                       provenance: Provenance | None = None) -> int:
        """Append records to a run-history table (runs, events, decisions, plans, measurements)."""
        p = provenance or Provenance(source="sailor", host=self.host, recorded_at=self.clock())
        return self.write(_history(table), records, provenance=p)

    def read_history(self, table: str, *, run_id: str | None = None, kind: str | None = None) -> list[HistoryRecord]:
        """Records of a run-history table in time order, optionally of one run and/or one kind."""
        where = {c: v for c, v in (("run_id", run_id), ("kind", kind)) if v is not None}
        return list(self.read(_history(table), where))

    # -- export ----------------------------------------------------------------------------------

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
            write_atomic("--out", out / f"{name}.csv", buf.getvalue())  # never through a link or into a device
            counts[name] = t.num_rows
        return counts


def _spec(name: str) -> TableSpec:
    try:
        return TABLES[name]
    except KeyError:
        raise SailorError(f"unknown table {name!r}; the store has {sorted(TABLES)}") from None


def _typed(name: str) -> Table[Any]:
    _spec(name)  # an unknown name: one line naming the tables
    return TYPED[name]


def _history(table: str) -> Table[HistoryRecord]:
    if table not in HISTORY:
        raise SailorError(f"{table!r} is not a run-history table; use one of {list(HISTORY_TABLES)}")
    return HISTORY[table]


def open_store(uri: str | None = None, *, seed: bool = True, clock: Callable[[], datetime] | None = None,
               host: str | None = None, env: Mapping[str, str] | None = None) -> ProfileStore:
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
