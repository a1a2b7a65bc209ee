"""GPU check: the runtime's CUDA/NCCL path and the CUDA profiler, one OK/SKIP/FAIL line per check.

Run it the day a GPU machine is lent (a few minutes on one node):

    .venv/bin/python bench/gpu_check.py [--model OPT-350] [--steps 5] [--mbs 1,2,4] [--skip-profile]
    (--device cpu --model gpt-tiny runs the training checks over gloo on this machine's CPUs, to try
    the script out; the profile check then skips)

Checks, each printed as `CHECK <name>: OK|SKIP|FAIL <details>`:
- cuda: the CUDA devices torch sees, and NCCL.
- train-1rank: the model on one GPU (one worker process through sailor_core.runtime.launcher, nccl):
  the losses must fall; they are the reference of the next two.
- train-1f1b-2stages: 2 stages, 1F1B, 4 microbatches, one GPU each, nccl (on OPT-350 at sequence
  2048 every activation sent is 8 MiB in fp32, large enough that NCCL's sends wait for their
  receives): the losses must be within 1e-3 (relative) of train-1rank.
- train-tp2: one stage with tp = 2 over 2 GPUs: the same test.
- train-dp2 (2 GPUs) and train-1f1b-2stages-dp2 (4 GPUs): two data-parallel replicas, whose NCCL
  gradient all-reduces overlap the backward (and, with 2 stages, the pipeline's sends): the same test.
- profile-opt350: OPT-350's layers profiled with CUDA events by sailor_core.profiler (tp 1, and 2
  where 2 GPUs exist; bf16 autocast by default), compared with the published profiles in the seed
  store: where the device's own GPU type is published, the summed forward+backward time of every
  microbatch size must be within a factor PUBLISHED_BAND of it; otherwise the ratios to the
  published GH-96 and A100-40 are printed and only sanity is checked (positive, growing with the
  microbatch). bench/cuda_layer_check.py prints the per-layer table.
A 1-GPU machine runs train-1rank and the profile and SKIPs the checks that need 2 or 4 GPUs; a machine
without CUDA SKIPs every check. Exit status: 1 if a check FAILed, else 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOSS_REL_TOL = 1e-3  # as tests/test_runtime.py: a plan's losses against one process
PUBLISHED_BAND = 2.0  # our layer-time sum / the published one, same GPU type: host and software differ
PUBLISHED = ("GH-96", "A100-40")  # shown for a GPU type the artifact did not profile
TRAINING_CHECKS = ("train-1rank", "train-1f1b-2stages", "train-tp2", "train-dp2", "train-1f1b-2stages-dp2")
RUNTIME_GPU_LABEL = "A100-80"  # plan label for a GPU the catalog lacks: the runtime only tells 'cpu' from CUDA


def line(name: str, verdict: str, detail: str) -> str:
    out = f"CHECK {name}: {verdict} {detail}"
    print(out, flush=True)
    return verdict


def _plan(gpu_type: str, stages: list[tuple[int, int, int]], dp: int, mbs: int, n_micro: int, model: str,
          gpus_per_node: int):
    """Stages (first layer, last layer, tp) with `dp` replicas each; the global batch is always
    mbs x n_micro, split evenly over the pipelines, so every plan's losses compare with one GPU's."""
    from sailor_core.domain import ParallelPlan, PipelineBatch, Replica, Stage

    return ParallelPlan(
        model=model,
        global_batch_size=mbs * n_micro,
        precision="fp32",
        stages=tuple(
            Stage(
                first_layer=a,
                last_layer=b,
                replicas=(Replica(gpu_type=gpu_type, zone="local", tp=tp, gpus_per_node=gpus_per_node),) * dp,
            )
            for a, b, tp in stages
        ),
        pipelines=(PipelineBatch(microbatch_size=mbs, num_microbatches=n_micro // dp),) * dp,
    )


def _train(plan, cfg, steps: int, run_dir: Path) -> list[float]:
    from sailor_core.runtime.engine import TrainSettings
    from sailor_core.runtime.launcher import run_local

    out = run_dir / "metrics.jsonl"
    settings = TrainSettings(model=cfg.name, steps=steps, metrics_out=str(out), timeout_s=180)
    run_local(plan, cfg, settings, run_dir=str(run_dir), slots=plan.num_gpus)
    rows = {r["step"]: r["loss"] for r in map(json.loads, out.read_text().splitlines())}
    return [rows[k] for k in sorted(rows)]


def _rel(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return math.inf
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def check_training(device: str, n_dev: int, model: str, steps: int, work: Path) -> list[str]:
    import torch

    from sailor_core.models.config import get_config
    from sailor_core.profiler.env import default_gpu_type

    cfg = get_config(model)
    n_layers = cfg.num_layers
    verdicts = []
    if device == "cuda":
        label = default_gpu_type("cuda")
        from sailor_core.catalog import GPU_TYPES

        gpu_type = label if label in GPU_TYPES else RUNTIME_GPU_LABEL
        note = f"{torch.cuda.get_device_name(0)} as {gpu_type!r}, nccl"
    else:
        gpu_type, note = "cpu", "cpu workers, gloo"
    mbs, n_micro = 1, 4
    half = n_layers // 2
    whole, two = [(0, n_layers - 1, 1)], [(0, half - 1, 1), (half, n_layers - 1, 1)]
    plans: dict[str, tuple[list[tuple[int, int, int]], int]] = {  # stages, data-parallel replicas
        "train-1rank": (whole, 1),
        "train-1f1b-2stages": (two, 1),
        "train-tp2": ([(0, n_layers - 1, 2)], 1),
        "train-dp2": (whole, 2),  # NCCL all-reduces overlapped with the backward
        "train-1f1b-2stages-dp2": (two, 2),  # the same, interleaved with the pipeline's sends
    }
    assert tuple(plans) == TRAINING_CHECKS
    reference: list[float] | None = None
    for name, (stages, dp) in plans.items():
        need = dp * sum(tp for _, _, tp in stages)
        if need > n_dev:
            verdicts.append(line(name, "SKIP", f"needs {need} GPUs, this machine has {n_dev}"))
            continue
        if name != "train-1rank" and reference is None:
            verdicts.append(line(name, "SKIP", "no reference: train-1rank did not pass"))
            continue
        p = _plan(gpu_type, stages, dp, mbs, n_micro, cfg.name, gpus_per_node=max(2, n_dev))
        t0 = time.monotonic()
        try:
            got = _train(p, cfg, steps, work / name)
        except Exception as e:  # noqa: BLE001 - one FAIL line per check, the others still run
            tail = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
            verdicts.append(line(name, "FAIL", f"{type(e).__name__}: {tail} (logs in {work / name})"))
            continue
        took = (f"{time.monotonic() - t0:.0f} s; {note}; {model}, {steps} steps, "
                f"global batch {mbs * n_micro} in microbatches of {mbs}")
        if name == "train-1rank":
            ok = len(got) == steps and got[-1] < got[0]
            reference = got if ok else None
            verdicts.append(line(name, "OK" if ok else "FAIL", f"losses {got[0]:.4f} -> {got[-1]:.4f} ({took})"))
            continue
        assert reference is not None
        err = _rel(got, reference)
        verdicts.append(
            line(
                name,
                "OK" if err <= LOSS_REL_TOL else "FAIL",
                f"max relative loss difference to train-1rank {err:.2e} (limit {LOSS_REL_TOL:.0e}; {took})",
            )
        )
    return verdicts


def compare_with_published(
    profiles: Sequence[Any], published: Callable[[str], Sequence[Any]], own: str
) -> tuple[bool, str]:
    """Our OPT-350 layer profiles against the published ones (`published(gpu_type)` lists a type's
    LayerProfiles). Per (mbs, tp): forward + backward summed over the layers. Fails on a
    non-positive or non-finite time, on a sum that does not grow with the microbatch, and, where
    `own` (the device's GPU type) is published, on a sum outside a factor PUBLISHED_BAND of its."""
    ours: dict[tuple[int, int], float] = {}
    for p in profiles:
        if not (math.isfinite(p.forward_s) and math.isfinite(p.backward_s) and p.forward_s > 0 and p.backward_s >= 0):
            return False, f"layer {p.layer} mbs={p.mbs} tp={p.tp}: fwd {p.forward_s} s bwd {p.backward_s} s"
        ours[(p.mbs, p.tp)] = ours.get((p.mbs, p.tp), 0.0) + p.forward_s + p.backward_s
    n_layers = len({p.layer for p in profiles})
    pub: dict[str, dict[tuple[int, int], float]] = {}
    for g in (own, *PUBLISHED):
        sums: dict[tuple[int, int], float] = {}
        counts: dict[tuple[int, int], int] = {}
        for p in published(g):
            sums[(p.mbs, p.tp)] = sums.get((p.mbs, p.tp), 0.0) + p.forward_s + p.backward_s
            counts[(p.mbs, p.tp)] = counts.get((p.mbs, p.tp), 0) + 1
        complete = {k: v for k, v in sums.items() if counts[k] == n_layers}  # a partial profile is no total
        if complete:
            pub[g] = complete
        if g == own and g in pub:
            break  # the device's own type is published: compare with it alone
    parts, bad = [], []
    for key in sorted(ours):
        ratios = {g: ours[key] / pub[g][key] for g in pub if pub[g].get(key)}
        parts.append(f"mbs={key[0]} tp={key[1]} {ours[key] * 1e3:.1f} ms"
                     + "".join(f", x{r:.2f} of {g}" for g, r in ratios.items()))
        if own in ratios and not 1 / PUBLISHED_BAND <= ratios[own] <= PUBLISHED_BAND:
            bad.append(f"mbs={key[0]} tp={key[1]} is x{ratios[own]:.2f} of the published {own}")
    for tp in sorted({t for _, t in ours}):
        seq = [ours[(m, tp)] for m in sorted(m for m, t in ours if t == tp)]
        if any(b <= a for a, b in zip(seq, seq[1:], strict=False)):
            bad.append(f"tp={tp}: time does not grow with the microbatch ({[round(s * 1e3, 1) for s in seq]} ms)")
    scope = f"published {own}" if own in pub else f"{own} is not published; ratios to {', '.join(PUBLISHED)}"
    detail = f"fwd+bwd summed over {n_layers} layers; {scope}: " + "; ".join(parts)
    return not bad, ("; ".join(bad) + " | " if bad else "") + detail


def check_profile(n_dev: int, mbs: tuple[int, ...], precision: str) -> str:
    from profiles_store import open_store
    from profiles_store.tables import LAYER_PROFILES
    from sailor_core.profiler import ModelProfileSettings, profile_model
    from sailor_core.profiler.env import default_gpu_type

    name = "profile-opt350"
    tps = (1, 2) if n_dev >= 2 else (1,)
    t0 = time.monotonic()
    try:
        prof = profile_model(ModelProfileSettings(model="OPT-350", device="cuda", mbs=mbs, tp=tps, precision=precision))
    except Exception as e:  # noqa: BLE001 - one FAIL line per check
        return line(
            name, "FAIL", f"the profiler failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        )
    with tempfile.TemporaryDirectory(prefix="sailor-gpu-check-") as tmp:
        store = open_store(tmp)  # the shipped seed: published profiles
        ok, detail = compare_with_published(
            prof.profiles, lambda g: store.read(LAYER_PROFILES, {"model": "OPT-350", "gpu_type": g}),
            default_gpu_type("cuda"))
    detail += f" ({precision}, {time.monotonic() - t0:.0f} s)"
    if prof.infeasible:
        detail += f"; out of memory at {[(x.mbs, x.tp) for x in prof.infeasible]}"
    return line(name, "OK" if ok else "FAIL", detail)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="OPT-350", help="model the training checks train (default OPT-350)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--mbs", default="1,2,4", help="microbatch sizes of the profile check")
    ap.add_argument("--precision", default="bf16", help="of the profile check: bf16 (autocast) or fp32")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: run the training checks over gloo here, to try the script out")
    ap.add_argument("--work-dir", default=None, help="where the runs' logs go (default: a temporary folder)")
    a = ap.parse_args(argv)

    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: every check skips")
        for name in ("cuda", *TRAINING_CHECKS, "profile-opt350"):
            line(name, "SKIP", "no CUDA device (torch.cuda.is_available() is False)")
        return 0
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="sailor-gpu-check-"))
    verdicts: list[str] = []
    if a.device == "cuda":
        n_dev = torch.cuda.device_count()
        nccl = torch.distributed.is_nccl_available()
        names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(n_dev)}))
        v = torch.cuda.nccl.version() if nccl else "missing"
        verdicts.append(line("cuda", "OK" if nccl else "FAIL",
                             f"{n_dev} x {names}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
                             f"nccl {'.'.join(map(str, v)) if isinstance(v, tuple) else v}"))
    else:
        n_dev = 4  # worker processes standing in for GPUs
        line("cuda", "SKIP", "--device cpu: training checks over gloo on CPU workers")
    try:
        verdicts += check_training(a.device, n_dev, a.model, a.steps, work)
    except Exception:  # noqa: BLE001 - a bug in this script is a FAIL line too, with its trace
        traceback.print_exc()
        verdicts.append(line("training", "FAIL", "the training checks crashed (trace above)"))
    if a.skip_profile:
        line("profile-opt350", "SKIP", "--skip-profile")
    elif a.device != "cuda":
        line("profile-opt350", "SKIP", "--device cpu (CUDA events need a GPU)")
    else:
        verdicts.append(check_profile(n_dev, tuple(int(v) for v in a.mbs.split(",")), a.precision))
    print(f"runs' logs: {work}")
    return 1 if "FAIL" in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
