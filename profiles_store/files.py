"""The store's file layer: which Parquet files of a table are live, reading one, committing one.

Contract (the layout and semantics docs/store.md states, for `ProfileStore` to build on):
- A table's files are `<table>/<col>=<value>/.../part-<time_ns:20>-<token:16>-<replace|upsert>.parquet`
  (partition folders in the order of the table's `partition_by`). `TableFiles(location, seed)`
  lists them in both layers, the seed first, each in write order (`live`): within a partition
  folder the newest `replace` file supersedes every older one. Files of other names (temp files,
  markers, foreign files) are not the store's and are skipped.
- `read(spec, file)` returns the file's rows in the table's schema, or raises a one-line
  `StoreError` for a corrupt file, a file of another schema version or table, or missing columns;
  a nullable column added after the file was written reads as nulls.
- `commit(spec, rel_dir, table, mode)` writes one new, uniquely named file (backend.Location.put:
  atomic), and after a replace deletes what it superseded, best effort.
- `newest_per_key` and `split_partitions` are the row rules of keyed and partitioned tables.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from profiles_store.backend import TMP_PREFIX, Location
from profiles_store.schemas import META_TABLE, META_VERSION, SCHEMA_VERSION, TableSpec
from sailor_core.errors import SailorError, StoreError

FILE_RE = re.compile(r"^part-(\d{20})-([0-9a-z]+)-(replace|upsert)\.parquet$")
STALE_TMP_S = 3600.0  # a hidden temp file older than this belongs to a writer that died

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


@dataclass(frozen=True)
class StoredFile:
    """One Parquet file of a table: where it is, its partition folder, its order and write mode."""

    loc: Location
    path: str
    rel_dir: str
    order: tuple[int, int, str]  # (layer: 0 seed / 1 store, time_ns, token)
    mode: str


def partition_dir(spec: TableSpec, values: Mapping[str, Any]) -> str:
    """The folder (relative to the table's) of the partition that `values` name."""
    missing = [c for c in spec.partition_by if c not in values]
    if missing:
        raise SailorError(f"table {spec.name}: a write must name partition column(s) {missing}")
    return "/".join(f"{c}={quote(str(values[c]), safe='')}" for c in spec.partition_by)


def parse_dir(rel_dir: str) -> dict[str, str] | None:
    """The partition values a folder names (None: not a partition folder)."""
    if not rel_dir:
        return {}
    out = {}
    for part in rel_dir.split("/"):
        k, sep, v = part.partition("=")
        if not sep:
            return None
        out[k] = unquote(v)
    return out


def check_version(version: int, what: str) -> None:
    """Refuse data of another schema version, with the way across."""
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


def _listing(loc: Location, prefix: str) -> list[Any]:
    """The files under `prefix`. A local directory listing is no snapshot: one that starts before a
    replace renames its file in and reaches the superseded file after `retire` deleted it sees
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


def _matches(values: Mapping[str, str], where: Mapping[str, str | Sequence[str]]) -> bool:
    return all(values[c] == v if isinstance(v, str) else values[c] in v for c, v in where.items() if c in values)


class TableFiles:
    """The files of the store's tables in its two layers (see the module's contract)."""

    def __init__(self, location: Location, seed: Location | None) -> None:
        self.location, self.seed = location, seed

    def live(self, spec: TableSpec, where: Mapping[str, str | Sequence[str]]) -> list[StoredFile]:
        """The files whose rows a read of `spec` combines, filtered on partition columns by `where`."""
        # List only below the leading partition values that are fixed (fewer objects on S3).
        prefix = []
        for c in spec.partition_by:
            v = where.get(c)
            if not isinstance(v, str):
                break
            prefix.append(f"{c}={quote(v, safe='')}")
        by_dir: dict[str, list[StoredFile]] = {}
        for layer, loc in ((0, self.seed), (1, self.location)):
            if loc is None:
                continue
            base = loc.path(spec.name)
            for info in _listing(loc, loc.path(spec.name, *prefix)):
                rel_dir, _, name = info.path[len(base) + 1 :].rpartition("/")
                m = FILE_RE.match(name)
                values = parse_dir(rel_dir)
                if not m or values is None or tuple(values) != spec.partition_by or not _matches(values, where):
                    continue  # temp files, directory markers, foreign files: not ours
                f = StoredFile(loc, info.path, rel_dir, (layer, int(m.group(1)), m.group(2)), m.group(3))
                by_dir.setdefault(rel_dir, []).append(f)
        live: list[StoredFile] = []
        for rel_dir in sorted(by_dir):
            files = sorted(by_dir[rel_dir], key=lambda f: f.order)
            last_replace = max((i for i, f in enumerate(files) if f.mode == "replace"), default=0)
            live.extend(files[last_replace:])
        return live

    @staticmethod
    def read(spec: TableSpec, f: StoredFile) -> pa.Table:
        """The rows of `f` in `spec`'s schema (see the module's contract)."""
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
            check_version(version, shown)
            if meta.get(META_TABLE, b"").decode() != spec.name:
                raise StoreError(
                    f"{shown} holds table {meta.get(META_TABLE, b'?').decode()!r}, not {spec.name!r}; "
                    f"to fix: move it out of {spec.name}/"
                )
        for col in spec.fields:  # a nullable column added after a file was written reads as nulls (not known)
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

    def commit(self, spec: TableSpec, rel_dir: str, table: pa.Table, mode: str) -> str:
        """Write `table` as one new file of partition folder `rel_dir`; a replace then retires the older files."""
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


def split_partitions(spec: TableSpec, table: pa.Table) -> dict[str, pa.Table]:
    """The rows of `table` by partition folder."""
    if not spec.partition_by:
        return {"": table}
    if not table.num_rows:
        return {}
    keys = table.select(list(spec.partition_by)).to_pylist()
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(partition_dir(spec, k), []).append(i)
    return {d: table.take(pa.array(idx)) for d, idx in groups.items()}


def newest_per_key(table: pa.Table, spec: TableSpec) -> pa.Table:
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
