"""Rebuild the shipped seed store from the Sailor artifact's published data, byte for byte.

    python -m profiles_store.build_seed /work/shared/reference_data [--out profiles_store/seed]

Contract: reads the folder laid out as eth-easl/sailor (or its parent), imports it into a fresh
store with a fixed `recorded_at` and no seed underneath, then copies the result into `--out` with
fixed file names (one file per partition, all named as generation 0), so that running it twice
gives identical files. The license and NOTICE in the output folder are kept.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from profiles_store.backend import resolve
from profiles_store.eth_easl import read_eth_easl
from profiles_store.files import FILE_RE
from profiles_store.importer import import_eth_easl
from profiles_store.store import MARKER, SEED_DIR, ProfileStore

# Fixed provenance time of the seed rows: the artifact commit's snapshot date (no per-row time is published).
SEED_RECORDED_AT = datetime(2025, 6, 1, tzinfo=UTC)
SEED_FILE = "part-00000000000000000000-seed-replace.parquet"


def build_seed(reference: str | Path, out: str | Path = SEED_DIR) -> dict[str, int]:
    data = read_eth_easl(reference)
    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        store = ProfileStore(resolve(tmp, {}), seed=None, host="")  # a local folder
        counts = import_eth_easl(store, data, recorded_at=SEED_RECORDED_AT)
        files = sorted(p for p in Path(tmp).rglob("*.parquet") if FILE_RE.match(p.name))
        dirs = [p.parent for p in files]
        merged = {d for d in dirs if dirs.count(d) > 1}
        if merged:
            # Several writes into one partition (e.g. gpu types from two sources): fold them into one
            # file through the store's own reader so the seed holds one generation per partition.
            for d in merged:
                rel = d.relative_to(tmp).as_posix()
                table_name, _, part = rel.partition("/")
                where = dict(kv.split("=", 1) for kv in part.split("/")) if part else {}
                table = store.read_table(table_name, where)
                for p in d.glob("part-*.parquet"):
                    p.unlink()
                store.write_table(table_name, table, mode="replace", partition=where or None)
            files = sorted(p for p in Path(tmp).rglob("*.parquet") if FILE_RE.match(p.name))
        for old in list(out.iterdir()) if out.exists() else []:
            if old.is_dir():
                shutil.rmtree(old)
            elif old.name == MARKER:
                old.unlink()
        for p in files:
            dest = out / p.parent.relative_to(tmp) / SEED_FILE
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, dest)
        shutil.copyfile(Path(tmp) / MARKER, out / MARKER)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", help="folder holding eth-easl-sailor/ (or the eth-easl-sailor folder itself)")
    ap.add_argument("--out", default=str(SEED_DIR), help="seed folder to (re)write (default: the package's)")
    args = ap.parse_args(argv)
    counts = build_seed(args.reference, args.out)
    for table, n in counts.items():
        print(f"{table:18s} {n:6d} rows")
    print(f"seed written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
