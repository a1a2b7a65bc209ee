"""Plans simulated per second for OPT-350-sized plans (the planner needs thousands per second).

Builds a mix of OPT-350 plans on the published profiles (1, 2 and 4 stages; data parallel 1 to
32; microbatch 1 to 8; GH-96, A100-40 and V100-16; one zone and two zones), simulates each once
to warm the shared per-book caches (as the planner's search does), then times repeated full
`simulate` calls and the planner-facing `simulate_valid` (no validation) side by side.

    .venv/bin/python bench/bench_simulator_speed.py [--data /work/shared/reference_data] [--seconds 3]
"""

from __future__ import annotations

import argparse
import os
import time

from profiles_store.eth_easl import read_eth_easl
from sailor_core.domain import ParallelPlan, Replica, Stage, split_batch
from sailor_core.simulator import SimOptions, model_for, simulate, simulate_valid

DEFAULT_DATA = os.environ.get("SAILOR_REFERENCE_DATA", "/work/shared/reference_data")
SPLITS = {1: [(0, 25)], 2: [(0, 11), (12, 25)], 4: [(0, 4), (5, 11), (12, 18), (19, 25)]}


def plans() -> list[ParallelPlan]:
    out = []
    for gpu, tp, mbs in (("GH-96", 4, 8), ("GH-96", 4, 1), ("A100-40", 2, 4), ("V100-16", 4, 2)):
        for p, dp in ((1, 32), (2, 16), (4, 8), (4, 1), (2, 2)):
            for zones in (("us-central1-a",), ("us-central1-a", "us-central1-b")):
                if gpu == "GH-96" and len(zones) > 1:
                    zones = ("us-central1-a", "us-central1-a")
                stages = tuple(
                    Stage(first_layer=a, last_layer=b, replicas=tuple(
                        Replica(gpu_type=gpu, zone=zones[j % len(zones)], tp=tp, gpus_per_node=4) for j in range(dp)))
                    for a, b in SPLITS[p]
                )
                gbs = 1024 if dp > 2 else 64
                out.append(ParallelPlan(model="OPT-350", global_batch_size=gbs, stages=stages,
                                        pipelines=split_batch(gbs, [mbs] * dp)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    book = read_eth_easl(a.data).profile_book("OPT-350")
    ps = plans()
    for p in ps:
        simulate(p, book)  # warm the per-book caches once, as a planner's search does
    sm = model_for(book)
    opts = SimOptions()

    def rate(fn: object) -> tuple[float, float, int]:
        """(plans per wall second, plans per CPU second of this process, runs); CPU time is the
        fair figure on a shared machine."""
        n = 0
        t0, c0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < a.seconds:
            for p in ps:
                fn(p)  # type: ignore[operator]
            n += len(ps)
        return n / (time.perf_counter() - t0), n / max(time.process_time() - c0, 1e-9), n

    full = rate(lambda p: simulate(p, book))
    fast = rate(lambda p: simulate_valid(p, sm, schedule="1f1b", precision="fp32", zero1=False, options=opts))
    gpus = sum(p.num_gpus for p in ps) / len(ps)
    print(f"{len(ps)} OPT-350 plans (mean {gpus:.0f} GPUs, up to {max(p.num_gpus for p in ps)}; 1-4 stages, dp 1-32)")
    print(
        f"simulate (validated):      {full[1]:8.0f} plans per CPU-second, "
        f"{full[0]:8.0f} per wall second ({full[2]} runs)"
    )
    print(
        f"simulate_valid (planner):  {fast[1]:8.0f} plans per CPU-second, "
        f"{fast[0]:8.0f} per wall second ({fast[2]} runs)"
    )


if __name__ == "__main__":
    main()
