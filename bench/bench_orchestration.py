"""Orchestration benchmark: what the `sailor` flow costs on top of training, measured in one run.

Runs the `sailor` flow (Prefect ephemeral mode, local provider, real runtime) on gpt-tiny with a
scenario that preempts a spot worker and then makes spot dearer than on-demand, and prints:
- reconfiguration time seen by the flow: from the provider's event (preemption notice or price
  change) to the first training step under the new plan, for each reconfiguration;
- orchestration overhead: flow wall time minus training time (the sum of the iteration times the
  workers measured), split into where it went (profiling when the store lacked the profile,
  planning, starting workers, reconfiguring, teardown).
Usage: python bench/bench_orchestration.py [--steps N] [--workers N] [--store URI]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SCENARIO = """
offerings:
  - {market: spot, count: 4, usd_per_gpu_hour: 0.10}
  - {market: on-demand, count: 4, usd_per_gpu_hour: 0.30}
events:
  - {at_step: 10, kind: preemption, market: spot, grace_s: 2}
  - {at_step: 30, kind: price_change, market: spot, usd_per_gpu_hour: 5.0}
"""


def _t(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--store", default=None, help="store URI (default: $SAILOR_STORE or .sailor/store)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sailor-bench-orch-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # the runs' folders go with the bench
    os.environ.setdefault("PREFECT_HOME", str(REPO / ".prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    scenario = work / "scenario.yaml"
    scenario.write_text(SCENARIO)

    from flows.sailor import sailor
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    state = sailor(run_name="bench-orchestration", model="gpt-tiny", global_batch_size=8, objective="min-cost",
                   provider="local", scenario=str(scenario), workers=a.workers, max_gpus=a.workers, steps=a.steps,
                   checkpoint_interval=10, store_uri=a.store, workdir=str(work), return_state=True)
    if not state.is_completed():
        print(f"run did not complete: {state.message}")
        return 1
    summary = state.result()
    run = RunHistory(open_store(a.store)).show(summary["run_id"])
    ev = run["events"]
    first = {e["kind"]: _t(e["time"]) for e in reversed(ev)}
    wall, train = summary["wall_s"], summary["training_s"]
    print(f"run {summary['run_id']}: {summary['steps_done']} steps of gpt-tiny, {summary['plan_versions']} plan "
          f"version(s), {len(summary['reconfigurations_s'])} reconfiguration(s)")
    for m in run["measurements"]:
        if m["kind"] == "reconfiguration":
            print(f"reconfiguration to plan v{m['plan_version']}: {m['reconfiguration_s']:.2f} s from the event "
                  f"to the first step under the new plan ({m['workers']} workers)")
    for d in run["decisions"]:
        print(f"decision {d['kind']}: {d['reason'][:160]}")
    print(f"flow wall time {wall:.2f} s, training time {train:.2f} s (sum of measured iteration times)")
    print(f"orchestration overhead {wall - train:.2f} s ({100 * (wall - train) / wall:.0f}% of wall time)")
    started = first.get("provisioned")
    if started:
        print(f"  start -> VMs provisioned (profiles, offerings, plan): {started - _t(run['started_at']):.2f} s")
    if started and "training_started" in first:
        print(f"  provisioned -> workers launched: {first['training_started'] - started:.2f} s")
    if "completed" in first and "teardown" in first:
        print(f"  last step -> teardown done: {first['teardown'] - first['completed']:.2f} s")
    print(f"  reconfiguration total: {sum(summary['reconfigurations_s']):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
