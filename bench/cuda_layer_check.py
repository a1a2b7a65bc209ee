"""Profile OPT-350 on the CUDA GPU at hand and compare per-layer times with the published profiles.

Runs the layer profiler (sailor_core.profiler, CUDA events) for OPT-350 at --mbs (default 1,2,4)
and every TP degree in --tp the node has GPUs for, into a temporary store over the shipped seed,
and prints, per (mbs, tp): forward and backward seconds of the embedding, a block and the head,
and the sums over all 26 layers, next to the published GH-96 and A100-40 profiles (the Sailor
artifact's, in the seed) with the ratios ours / published. Skips (exit 0, "SKIP") without CUDA.

    .venv/bin/python bench/cuda_layer_check.py [--mbs 1,2,4] [--tp 1] [--precision bf16|fp32] [--json OUT]
    (--model gpt-tiny --device cpu runs the same path on a CPU, to try the script out)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PUBLISHED = ("GH-96", "A100-40")
MODEL = "OPT-350"


def main() -> int:
    """Profiles, stores and compares (see the module); exit 0 with SKIP where there is no CUDA device."""
    a = _args()

    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: no CUDA device here; this check profiles OPT-350 on a GPU")
        return 0

    from profiles_store import open_store
    from profiles_store.tables import LAYER_PROFILES
    from sailor_core.models.config import get_config
    from sailor_core.profiler import ModelProfileSettings, profile_model, save_model_profile
    from sailor_core.profiler.env import device_name

    cfg = get_config(a.model)
    n_gpus = torch.cuda.device_count() if a.device == "cuda" else 1
    tps = tuple(t for t in (int(v) for v in a.tp.split(",")) if t <= n_gpus)
    mbs = tuple(int(v) for v in a.mbs.split(","))
    print(f"device: {device_name(a.device)} x{n_gpus}; torch {torch.__version__}; {cfg.name}; mbs {mbs}; tp {tps}; "
          f"{a.precision}")
    t0 = time.time()
    settings = ModelProfileSettings(model=cfg.name, device=a.device, mbs=mbs, tp=tps, precision=a.precision)
    prof = profile_model(settings, _progress)
    print(f"profiled in {time.time() - t0:.1f} s; framework overhead {prof.framework_overhead_bytes / 2**30:.2f} GiB; "
          f"optimizer {prof.optimizer_s}; infeasible {[(x.mbs, x.tp) for x in prof.infeasible]}")

    store = open_store(tempfile.mkdtemp(prefix="sailor-cuda-check-"))
    save_model_profile(store, prof)  # the same path as `sailor profile model` (the seed stays below)
    published = {g: {(p.mbs, p.tp, p.layer): p for p in store.read(LAYER_PROFILES, {"model": cfg.name, "gpu_type": g})}
                 for g in PUBLISHED}
    report = _compare(prof, published, cfg.num_layers)
    if a.json:
        Path(a.json).write_text(json.dumps({"device": device_name(a.device), "precision": a.precision,
                                            "rows": report, "overhead_bytes": prof.framework_overhead_bytes}, indent=1))
    return 0


def _args() -> argparse.Namespace:
    """The command line (see the module's usage)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbs", default="1,2,4")
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--precision", default="bf16", help="bf16 (autocast, as mixed-precision training runs) or fp32")
    ap.add_argument("--json", default=None, help="also write every number here")
    ap.add_argument("--model", default=MODEL, help="another model only to try the script out (e.g. gpt-tiny)")
    ap.add_argument("--device", default="cuda", help="cpu only to try the script out")
    return ap.parse_args()


def _progress(msg: dict) -> None:
    """Prints each measured point (and the profiler's other messages) as it arrives."""
    if msg["kind"] == "point":
        p = msg["point"]
        print(f"  mbs={p.mbs} tp={p.tp} layer {p.layer}: fwd {p.forward_s:.5f} s bwd {p.backward_s:.5f} s "
              f"kept {p.saved_bytes / 2**20:.1f} MiB"
              + (f" (allocator {p.allocated_bytes / 2**20:.1f} MiB)" if p.allocated_bytes is not None else ""),
              flush=True)
    else:
        print(f"  {msg}", flush=True)


def _compare(prof: Any, published: dict[str, dict[tuple[int, int, int], Any]], n_layers: int) -> list[dict]:
    """Prints, per (mbs, tp), a few layers and the sum of ours beside each published profile; returns the rows."""
    ours = {(p.mbs, p.tp, p.layer): p for p in prof.profiles}
    report = []
    show = (0, 1, 2, n_layers - 1)
    for (m, t) in sorted({(k[0], k[1]) for k in ours}):
        print(f"\nmbs={m} tp={t}: seconds (fwd / bwd); ratio = ours / published")
        header = f"{'layer':>6} {'ours':>19}" + "".join(f" {g:>19} {'ratio':>11}" for g in PUBLISHED)
        print(header)
        for i in (*show, "sum"):
            line, row = _layer_row(ours, published, m, t, i, n_layers)
            print(line)
            report.append(row)
        print(f"optimizer step (whole model, one GPU): {prof.optimizer_s.get(t, float('nan')):.5f} s; published "
              + ", ".join(f"{g} {published[g][(m, t, 0)].optimizer_s:.5f} s" for g in PUBLISHED
                          if (m, t, 0) in published[g]))
    return report


def _layer_row(ours: dict[tuple[int, int, int], Any], published: dict[str, dict[tuple[int, int, int], Any]], m: int,
               t: int, i: int | str, n_layers: int) -> tuple[str, dict[str, Any]]:
    """(the printed line, the JSON row) of layer i (or "sum": every layer) at (mbs m, tp t)."""
    if isinstance(i, str):  # "sum"
        f = sum(ours[(m, t, j)].forward_s for j in range(n_layers))
        b = sum(ours[(m, t, j)].backward_s for j in range(n_layers))
    else:
        f, b = ours[(m, t, i)].forward_s, ours[(m, t, i)].backward_s
    line = f"{i!s:>6} {f:9.5f} / {b:7.5f}"
    row: dict[str, Any] = {"mbs": m, "tp": t, "layer": i, "ours_fwd_s": f, "ours_bwd_s": b}
    for g in PUBLISHED:
        pts = published[g]
        if all((m, t, j) in pts for j in range(n_layers)):
            if isinstance(i, str):  # "sum"
                pf = sum(pts[(m, t, j)].forward_s for j in range(n_layers))
                pb = sum(pts[(m, t, j)].backward_s for j in range(n_layers))
            else:
                pf, pb = pts[(m, t, i)].forward_s, pts[(m, t, i)].backward_s
            rf = f / pf if pf else float("nan")
            rb = b / pb if pb else float("nan")
            line += f" {pf:9.5f} / {pb:7.5f} {rf:5.2f}/{rb:5.2f}"
            row[f"{g}_fwd_s"], row[f"{g}_bwd_s"] = pf, pb
        else:
            line += f" {'(not published)':>19} {'':>11}"
    return line, row


if __name__ == "__main__":
    sys.exit(main())
