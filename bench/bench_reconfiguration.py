"""Reconfiguration without restarts against a cold start, on the local testbed, in one run.

Runs the `sailor` flow on the testbed scenario (scenarios/geo.yaml's 1-device VMs, its events replaced
by one preemption of the newest VM the plan uses) `--runs` times (default 3) and reads from each run's history:
- cold_start_s: from the first plan's VMs being provisioned to its first training step (the VMs
  boot, install the run's wheel, start one worker per device, meet, build the model);
- reconfiguration_s: from the preemption notice to the first step of the next plan, whose kept VMs'
  worker processes went on running (kept_processes: same PIDs before and after);
and prints each run, then the medians; the last line is
`reconfiguration_s=X cold_start_s=Y kept_processes=N`. Profiles are measured on the first run (or
taken from `--store`) and reused after. Needs root for isolated VMs; without it the VMs are plain
processes (the figures then compare the same mechanisms without namespaces).

    .venv/bin/python bench/bench_reconfiguration.py [--runs 3] [--steps 40] [--store DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def scenario_file(out: Path, preempt_at: int) -> Path:
    sc = yaml.safe_load((ROOT / "scenarios" / "geo.yaml").read_text())
    # 1-device VMs only, so the plan spans several VMs and a preemption leaves survivors whose
    # processes can go on; the newest running VM of the run is taken back, whatever the plan chose.
    for zones in sc["regions"].values():
        for zone in list(zones):
            zones[zone] = [o for o in zones[zone] if o.get("devices_per_vm", 1) == 1]
            if not zones[zone]:
                del zones[zone]
    sc["events"] = [{"at_step": preempt_at, "kind": "preemption", "grace_s": 2}]
    path = out / "bench-geo.yaml"
    path.write_text(yaml.safe_dump(sc))
    return path


def one_run(store: str, workdir: Path, scenario: Path, steps: int) -> dict[str, float]:
    from flows.sailor import sailor
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    summary = sailor(run_name="bench-reconf", model="gpt-tiny", global_batch_size=8, objective="max-throughput",
                     provider="local", scenario=str(scenario), steps=steps, checkpoint_interval=5, store_uri=store,
                     workdir=str(workdir), min_gain=0.0, calibration_tolerance=9.0)
    run = RunHistory(open_store(store)).show(summary["run_id"])
    cold = next((m["cold_start_s"] for m in run["measurements"] if m["kind"] == "cold_start"), float("nan"))
    rec: dict[str, Any] = next((e for e in run["events"] if e["kind"] == "reconfigured"), {})
    return {"run_id": run["run_id"], "status": run["status"], "cold_start_s": float(cold),
            "reconfiguration_s": float(rec.get("reconfiguration_s", float("nan"))),
            "kept_processes": int(rec.get("kept_processes", 0)), "loaded_from": rec.get("loaded_from", {}),
            "isolation": (run.get("cluster") or {}).get("isolation", "?")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--preempt-at", type=int, default=15)
    ap.add_argument("--store", default=str(ROOT / ".sailor" / "bench-store"), help="kept across runs: profiles")
    ap.add_argument("--workdir", help="keep the runs' folders (worker logs, run state) here; default: a temporary one")
    a = ap.parse_args()
    os.environ.setdefault("PREFECT_HOME", str(ROOT / ".prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    rows = []
    with tempfile.TemporaryDirectory(prefix="sailor-bench-reconf-") as scratch:
        tmp = a.workdir or scratch
        os.makedirs(tmp, exist_ok=True)
        scenario = scenario_file(Path(tmp), a.preempt_at)
        for i in range(a.runs):
            r = one_run(a.store, Path(tmp) / f"run{i}", scenario, a.steps)
            rows.append(r)
            print(f"run {i + 1}: {json.dumps(r)}", flush=True)
    ok = [r for r in rows if r["status"] == "completed" and r["reconfiguration_s"] == r["reconfiguration_s"]]
    if not ok:
        print("no run completed with a reconfiguration")
        return 1
    rec = statistics.median(r["reconfiguration_s"] for r in ok)
    cold = statistics.median(r["cold_start_s"] for r in ok)
    kept = statistics.median(r["kept_processes"] for r in ok)
    print(f"median of {len(ok)} run(s) on isolation {ok[0]['isolation']}: reconfiguration {rec:.2f}s vs cold start "
          f"{cold:.2f}s (x{rec / cold:.2f}), kept processes {kept:g}")
    print(f"reconfiguration_s={rec:.2f} cold_start_s={cold:.2f} kept_processes={kept:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
