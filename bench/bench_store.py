"""Store throughput: write and read 100,000 layer-profile rows on a local folder and on S3, side by side.

    python bench/bench_store.py [--rows 100000] [--repeat 3]

Starts its own S3 server (`rclone serve s3` on 127.0.0.1, rclone's in-memory backend), so the S3
column measures the store's S3 code path plus HTTP on loopback, not a network or a disk.
Two paths per backend: the domain API the profiler and planner use (`replace_layer_profiles` with
LayerProfile objects in, `layer_profiles` with LayerProfile objects out) and the Arrow API
(`write_table` / `read_table`). Each figure is the median of `--repeat` runs; every write is a
replace of the same (model, GPU type), so each read sees exactly `--rows` rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa  # noqa: E402

from profiles_store import open_store  # noqa: E402
from profiles_store.local_servers import LocalS3Server  # noqa: E402
from profiles_store.tables import GPU_TYPES, LAYER_PROFILES, MODELS  # noqa: E402
from sailor_core.domain import GIB, GpuType, LayerProfile, LayerSpec, ModelSpec, Provenance  # noqa: E402

LAYERS = 100
TPS = 4
PROV = Provenance(source="bench", host="bench")


def _model() -> ModelSpec:
    layers = tuple(
        LayerSpec(index=i, kind="embedding" if i == 0 else "head" if i == LAYERS - 1 else "block", tp=1,
                  params=1000, act_output_elems=10, act_input_elems=10, act_memory_bytes=40)
        for i in range(LAYERS)
    )
    return ModelSpec(name="Bench", num_blocks=LAYERS - 2, hidden_size=64, num_heads=4, sequence_length=64,
                     vocab_size=1000, layers=layers)


def _rows(n: int) -> list[LayerProfile]:
    per_mbs = LAYERS * TPS
    return [
        LayerProfile(
            model="Bench",
            gpu_type="BenchGPU",
            mbs=1 + i // per_mbs,
            tp=1 + (i // LAYERS) % TPS,
            layer=i % LAYERS,
            forward_s=1e-3 * (1 + i % 7),
            backward_s=2e-3 * (1 + i % 5),
            optimizer_s=1e-4,
        )
        for i in range(n)
    ]


def _table(rows: list[LayerProfile]) -> pa.Table:
    cols = ("model", "gpu_type", "mbs", "tp", "layer", "forward_s", "backward_s", "optimizer_s")
    return pa.table({c: [getattr(r, c) for r in rows] for c in cols})


def _median_rate(n: int, repeat: int, fn: Callable[[], object]) -> float:
    fn()  # warm-up: connections, caches, first-use imports
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times)


def measure(uri: str, rows: list[LayerProfile], repeat: int) -> dict[str, float]:
    store = open_store(uri, seed=False)
    store.write(GPU_TYPES, [GpuType(name="BenchGPU", memory_bytes=16 * GIB)], provenance=PROV)
    store.write(MODELS, [_model()], provenance=PROV)
    table = _table(rows)
    n = len(rows)
    part = {"model": "Bench", "gpu_type": "BenchGPU"}
    out = {
        "write, domain objects": _median_rate(
            n, repeat, lambda: store.replace_layer_profiles("Bench", "BenchGPU", rows, provenance=PROV)
        ),
        "read, domain objects": _median_rate(
            n, repeat, lambda: store.read(LAYER_PROFILES, {"model": "Bench", "gpu_type": "BenchGPU"})),
        "write, Arrow table": _median_rate(
            n,
            repeat,
            lambda: store.write_table("layer_profiles", table, mode="replace", partition=part, provenance=PROV),
        ),
        "read, Arrow table": _median_rate(n, repeat, lambda: store.read_table("layer_profiles", part)),
    }
    got = store.read_table("layer_profiles", part).num_rows
    assert got == n, f"read back {got} rows, wrote {n}"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    if args.rows > 10_000 * LAYERS * TPS or args.rows % (LAYERS * TPS):
        ap.error(f"--rows must be a multiple of {LAYERS * TPS}")
    rows = _rows(args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        local = measure(str(Path(tmp) / "local"), rows, args.repeat)
        with LocalS3Server() as server:
            server.create_bucket("bench")
            s3 = measure(server.uri("bench", "store"), rows, args.repeat)
    print(f"profile store throughput, {args.rows:,} layer-profile rows, median of {args.repeat} (rows/s)")
    print(f"{'operation':24s} {'local':>12s} {'s3 (rclone)':>12s} {'s3/local':>9s}")
    for k in local:
        print(f"{k:24s} {local[k]:12,.0f} {s3[k]:12,.0f} {s3[k] / local[k]:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
