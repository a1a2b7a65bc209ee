"""How well the stored network fit predicts the transfers it was fitted on, per message size.

Runs the network profiler between local workers (gloo on CPU, nccl with --device cuda) over the
default sizes (64 KiB up to 64 MiB on CPU, 1 GiB on CUDA; --max-bytes to change), then prints per
size: the measured point-to-point time (20th percentile of the repetitions, as stored, and the median), the time
the stored fit (the store's quadratic in u = log2(x/1e6)) predicts, the alpha-beta prediction, the
measured all-reduce with its own fit, and the all-reduce the simulator composes from the link fit
(ring: 2(D-1) hops of x/D bytes). Ends with the worst errors against the 15% target.

    .venv/bin/python bench/bench_network_fit.py [--workers 2] [--max-bytes N] [--device cpu|cuda] [--store DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sailor_core.profiler import NetworkSettings, profile_network, save_network_profile  # noqa: E402
from sailor_core.profiler.network import summary_rows  # noqa: E402

TARGET = 0.15


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--min-bytes", type=int, default=64 * 1024)
    ap.add_argument("--max-bytes", type=int, default=None)
    ap.add_argument("--store", default=None, help="also upsert the link into this store")
    a = ap.parse_args()

    settings = NetworkSettings(workers=a.workers, device=a.device, min_bytes=a.min_bytes, max_bytes=a.max_bytes)
    print(f"load average before: {os.getloadavg()}")
    t0 = time.time()
    prof = profile_network(settings)
    print(f"measured {len(prof.points)} sizes between {a.workers} {a.device} workers in {time.time() - t0:.1f} s\n")

    print(f"{'bytes':>11} | {'p2p ms':>9} {'median':>9} {'fit':>9} {'err':>7} {'a-b':>9} | "
          f"{'allred ms':>9} {'fit':>9} {'err':>7} {'ring(p2p)':>9}")
    rows = summary_rows(prof)
    for r in rows:
        print(f"{r['bytes']:>11} | {r['p2p_measured_s'] * 1e3:9.3f} {r['p2p_median_s'] * 1e3:9.3f} "
              f"{r['p2p_predicted_s'] * 1e3:9.3f} {r['p2p_err']:+7.1%} {r['p2p_alpha_beta_s'] * 1e3:9.3f} | "
              f"{r['allreduce_measured_s'] * 1e3:9.3f} {r['allreduce_predicted_s'] * 1e3:9.3f} "
              f"{r['allreduce_err']:+7.1%} {r['allreduce_ring_s'] * 1e3:9.3f}")
    a_, b_, c_ = prof.link.fit.coeffs
    print(
        f"\np2p fit: bw_GBps = {a_:.5g} u^2 + {b_:.5g} u + {c_:.5g}, max {prof.link.fit.max_bytes_per_s / 1e9:.2f} GB/s"
    )
    ab = prof.p2p_alpha_beta
    print(f"p2p alpha-beta: {ab.latency_s * 1e6:.1f} us + x / {ab.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
    ab = prof.allreduce_alpha_beta
    print(f"all-reduce alpha-beta: {ab.latency_s * 1e6:.1f} us + x / {ab.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
    worst_p2p = max(abs(r["p2p_err"]) for r in rows)
    worst_ar = max(abs(r["allreduce_err"]) for r in rows)
    within = sum(abs(r["p2p_err"]) <= TARGET for r in rows)
    print(f"worst p2p error {worst_p2p:.1%} ({within}/{len(rows)} sizes within {TARGET:.0%}); "
          f"worst all-reduce fit error {worst_ar:.1%}")
    print(f"load average after: {os.getloadavg()}")
    if a.store:
        from profiles_store import open_store

        save_network_profile(open_store(a.store), prof)
        print(f"upserted the link into {a.store}")
    return 0 if worst_p2p <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
