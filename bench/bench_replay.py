"""Replay speed: simulated hours per second of replay, at 256, 1,024 and 2,048 GPUs, per policy.

For each size, a synthetic 14-day trace (5 zones x 3 GPU types x 2 markets, the generator's
default rates, seed 0) and an OPT-350 job (global batch 1024) with a token budget that keeps it
training for most of the trace at that size; then every policy replays it on its own fresh
planner (no memo shared between policies, unlike `sailor replay --policy all`). Prints, side by
side, the simulated hours, the replay's wall and CPU seconds, the simulated hours per second (of
CPU, and of wall: the machine is shared, so the wall figure moves with its load), the planner
calls and memo hits, and Sailor's time and cost ratios against relaunch-same. Every policy's
replacement on new VMs waits `--vm-start-s` for them (default: the flow's assumption for a cloud VM,
sailor_core.planner.risk.ASSUMED_VM_START_S). The row `sailor-shrink` is Sailor's policy with the
flow's former rule after a loss (shrink onto the GPUs still held, `weigh_replacements=False`); the
flow now weighs replacements exactly as the `sailor` row does (the same `best_replacement`).

    .venv/bin/python bench/bench_replay.py [--sizes 256,1024,2048] [--days 14] [--policies all]
        [--vm-start-s 180]
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")

from sailor_cli.options import load_book  # noqa: E402
from sailor_core.planner import SearchOptions  # noqa: E402
from sailor_core.planner.risk import ASSUMED_VM_START_S  # noqa: E402
from sailor_core.replay import (  # noqa: E402
    FAST_SEARCH,
    POLICIES,
    Planner,
    ReplayJob,
    SyntheticSpec,
    policy_named,
    replay,
    synthetic_trace,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256,1024,2048")
    ap.add_argument("--days", type=float, default=14.0)
    ap.add_argument("--policies", default="all")
    ap.add_argument("--store", default=None)
    ap.add_argument("--vm-start-s", type=float, default=ASSUMED_VM_START_S["gcp"])
    args = ap.parse_args()
    book = load_book("OPT-350", args.store)
    names = list(POLICIES) + ["sailor-shrink"] if args.policies == "all" else args.policies.split(",")
    seq = book.model.sequence_length
    print(f"{'GPUs':>5} {'policy':<14} {'done':>4} {'sim h':>7} {'wall s':>7} {'cpu s':>6} {'sim h/s cpu':>11} "
          f"{'sim h/s wall':>12} {'changes':>7} {'planner':>9} {'USD':>10}")
    for size in (int(x) for x in args.sizes.split(",")):
        t0 = time.perf_counter()
        trace = synthetic_trace(SyntheticSpec(total_gpus=size, days=args.days), book.price_usd_per_gpu_hour,
                                lambda g: book.gpu(g).gpus_per_node)
        gen_s = time.perf_counter() - t0
        # Size the job to the first plan: about 60% of the trace at its nominal speed.
        probe = ReplayJob(model="OPT-350", global_batch_size=1024, total_steps=1, tokens_per_step=1024 * seq,
                          search=SearchOptions(**FAST_SEARCH))
        first = Planner(book, probe).best(trace.pool_at(0))
        assert first is not None, f"no plan on the first pool of {size} GPUs"
        steps = int(0.6 * args.days * 86400 / first.cost.iteration_time_s)
        # A checkpoint every 100 steps: the job this bench has measured from its first run on.
        job = ReplayJob(model="OPT-350", global_batch_size=1024, total_steps=steps, tokens_per_step=1024 * seq,
                        search=SearchOptions(**FAST_SEARCH), checkpoint_interval=100, vm_start_s=args.vm_start_s)
        print(f"-- {size} GPUs: {len(trace.points)} changes over {trace.duration_s / 3600:.0f} h, generated in "
              f"{gen_s:.3f} s; job: {steps} steps ({steps * 1024 * seq:.3g} tokens), first plan "
              f"{first.plan.num_gpus} GPUs at {first.cost.iteration_time_s:.3f} s/step")
        res = {}
        for name in names:
            shrink = name == "sailor-shrink"
            j = replace(job, weigh_replacements=False) if shrink else job
            r = replay(trace, book, j, policy_named("sailor" if shrink else name), name=name, planner=Planner(book, j),
                       period_s=job.period_s if name == "periodic" else None)
            res[name] = r
            sim_h = r.time_to_train_s / 3600
            print(f"{size:>5} {name:<14} {'yes' if r.finished else 'no':>4} {sim_h:>7.1f} {r.wall_s:>7.2f} "
                  f"{r.cpu_s:>6.2f} {sim_h / max(r.cpu_s, 1e-9):>11.1f} {sim_h / max(r.wall_s, 1e-9):>12.1f} "
                  f"{len(r.decisions):>7} {r.planner_calls:>4}+{r.planner_hits:<4} {r.usd:>10.0f}", flush=True)
        s, b = res.get("sailor"), res.get("relaunch-same")
        if s and b:
            print(f"      sailor vs relaunch-same at {size} GPUs: time x{s.time_to_train_s / b.time_to_train_s:.3f}, "
                  f"cost x{s.usd / b.usd:.3f}" + ("" if b.finished else " (relaunch-same unfinished)"))
        k = res.get("sailor-shrink")
        if s and k:
            print(f"      sailor (the flow's rule: weigh replacements) vs shrink first at {size} GPUs: time "
                  f"x{s.time_to_train_s / k.time_to_train_s:.3f}, cost x{s.usd / k.usd:.3f}")


if __name__ == "__main__":
    main()
