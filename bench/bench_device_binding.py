"""Layer times of tp=1 and tp=2 as the layer profiler measures them on a 2-device testbed VM.

A testbed device is a CPU share (infra/testbed.py): this builds a testbed with one VM of 2 devices of
`--cpu-per-device` cores each (default: cpu-fast of scenarios/geo.yaml), runs `sailor profile model
--tp 1,2` inside it, and prints forward + backward per measured layer for tp=1 and tp=2, and their
sums. With device binding (sailor_core/runtime/devices.py) each rank runs on its own device's share,
so tp=2 (two devices' worth of CPU) should beat tp=1 on the large layers unless gloo traffic dominates.
`--unbound` hides the device cgroups from the profiler (as before device binding): its ranks then
share the whole VM's quota, and tp=1 is timed in CPU seconds of a whole core, not of one device.

Needs root (a netns testbed). The host is shared: the times are noisy, run it more than once.
    sudo .venv/bin/python bench/bench_device_binding.py [--model gpt-small] [--mbs 1] [--unbound]
Last line: `tp1_ms=X tp2_ms=Y speedup=Z` (sums over the measured layers, speedup = X / Y).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from infra.scenario import load_scenario  # noqa: E402
from infra.testbed import Testbed, testbed_support  # noqa: E402
from sailor_core.runtime.devices import CGROUP_ROOT_ENV  # noqa: E402

SAILOR = str(Path(sys.executable).parent / "sailor")


def profile_on_vm(tb: Testbed, key: str, model: str, mbs: str, gpu_type: str, unbound: bool) -> dict:
    store = Path(tb.vm(key).folder) / "store"
    argv = [SAILOR, "profile", "model", "--model", model, "--device", "cpu", "--gpu-type", gpu_type,
            "--tp", "1,2", "--mbs", mbs, "--json", "--store", str(store)]
    env = {**os.environ, **tb.env(key), "OMP_NUM_THREADS": "1"}
    if unbound:
        env.pop(CGROUP_ROOT_ENV)
    r = subprocess.run(tb.command(key, argv), capture_output=True, text=True, env=env, cwd=tb.vm(key).folder,
                       timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"profiling on {key} failed (exit {r.returncode}): {r.stderr[-2000:]}")
    return dict(json.loads(r.stdout[r.stdout.index("{"):]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--mbs", default="1")
    ap.add_argument("--gpu-type", default="cpu-fast")
    ap.add_argument("--unbound", action="store_true", help="ranks not bound to their devices (as before binding)")
    ap.add_argument("--cpu-per-device", type=float, default=None,
                    help="cores per device (default: the gpu type's in scenarios/geo.yaml)")
    a = ap.parse_args()
    ok, why = testbed_support()
    if not ok:
        print(f"the testbed needs root: {why}; to fix: run as root", file=sys.stderr)
        return 2
    q = a.cpu_per_device or load_scenario(REPO / "scenarios" / "geo.yaml").device_type(a.gpu_type).cpu_per_device
    if q is None:
        print(
            f"{a.gpu_type} has no cpu_per_device in scenarios/geo.yaml; to fix: pass --cpu-per-device", file=sys.stderr
        )
        return 2
    tb = Testbed.create(run_id="bench-device-binding", zones=["z1"], link_gbps=lambda s, d: 1.0)
    try:
        tb.add_vm("vm", zone="z1", devices=2, cpu_cores=2 * q)
        t0 = time.monotonic()
        out = profile_on_vm(tb, "vm", a.model, a.mbs, a.gpu_type, a.unbound)
        print(f"{a.model} mbs={a.mbs} on a 2-device VM of {q} cores per device, ranks "
              f"{'unbound' if a.unbound else 'bound to their devices'} ({time.monotonic() - t0:.0f} s)")
    finally:
        tb.teardown()
    times: dict[int, dict[tuple[int, int], float]] = {}
    for p in out["measured"]:
        times.setdefault(p["tp"], {})[(p["mbs"], p["layer"])] = (p["forward_s"] + p["backward_s"]) * 1e3
    print(f"{'mbs':>4} {'layer':>5} {'tp1 fwd+bwd ms':>15} {'tp2 fwd+bwd ms':>15} {'tp1/tp2':>8}")
    for k in sorted(times.get(1, {})):
        t1, t2 = times[1][k], times.get(2, {}).get(k, float("nan"))
        print(f"{k[0]:>4} {k[1]:>5} {t1:>15.3f} {t2:>15.3f} {t1 / t2:>8.2f}")
    s1, s2 = sum(times.get(1, {}).values()), sum(times.get(2, {}).values())
    print(f"tp1_ms={s1:.3f} tp2_ms={s2:.3f} speedup={s1 / s2 if s2 else float('nan'):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
