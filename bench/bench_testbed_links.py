"""Bandwidth between testbed VMs, per zone pair, measured against the rate the scenario shapes.

Builds the scenario's testbed (infra/testbed.py; needs root) with two VMs per zone and no CPU quota
(this measures the network, not a device type), sends one TCP stream per direction of every zone
pair and inside every zone (8-32 MB: about 1.5 s at the shaped rate), takes the median of
`--repeat` streams, and prints measured vs shaped and whether it is within 15%. Tears everything
down at the end, also on an error or Ctrl-C.

    sudo .venv/bin/python bench/bench_testbed_links.py [--scenario scenarios/geo.yaml] [--repeat 3]

The last line: `pairs_within_15pct=N/M worst_error_pct=X`. The machine is shared (2 cores): a busy
moment makes a fast link measure low; rerun before you trust one bad pair.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.scenario import load_scenario  # noqa: E402
from infra.testbed import Testbed, stream_bytes_per_s, testbed_support  # noqa: E402

TOLERANCE = 0.15
MIN_BYTES, MAX_BYTES = 8 << 20, 32 << 20
STREAM_S = 1.5  # aim each stream at about this long at the shaped rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="scenarios/geo.yaml")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    ok, why = testbed_support()
    if not ok:
        print(f"cannot build the testbed here: {why}; to fix: run as root", file=sys.stderr)
        return 2
    sc = load_scenario(args.scenario)
    zones = [z for z, _ in sc.zones]
    tb = Testbed.create(run_id="bench-links", zones=zones, link_gbps=sc.link_gbps)
    try:
        for z in zones:
            for i in (0, 1):
                tb.add_vm(f"{z}-{i}", zone=z)
        print(f"testbed {tb.tag}: {len(zones)} zones, {2 * len(zones)} VMs, subnet {tb.subnet}; "
              f"{args.repeat} streams per direction, median")
        print(f"{'from':<12} {'to':<12} {'shaped MB/s':>11} {'measured MB/s':>13} {'ratio':>6}  within 15%")
        pairs = [(a, b) for a in zones for b in zones]
        results = []
        port = 5400
        for a, b in pairs:
            src, dst = f"{a}-0", f"{b}-1"
            shaped = tb.rate_gbps(a, b) * 1e9 / 8
            nbytes = int(min(MAX_BYTES, max(MIN_BYTES, shaped * STREAM_S)))
            rates = []
            for _ in range(args.repeat):
                port += 1
                rates.append(stream_bytes_per_s(tb, src, dst, nbytes, port=port))
            measured = statistics.median(rates)
            ratio = measured / shaped
            within = abs(ratio - 1) <= TOLERANCE
            results.append((within, abs(ratio - 1)))
            print(f"{a:<12} {b:<12} {shaped / 1e6:>11.1f} {measured / 1e6:>13.1f} {ratio:>6.2f}  "
                  f"{'yes' if within else 'NO'}")
        good = sum(1 for w, _ in results if w)
        worst = max(e for _, e in results) * 100
        print(f"pairs_within_15pct={good}/{len(results)} worst_error_pct={worst:.1f}")
        return 0 if good == len(results) else 1
    finally:
        tb.teardown()


if __name__ == "__main__":
    sys.exit(main())
