"""The `sailor` flow on the local testbed: isolated VMs in two zones, state in object storage.

One run, as root (skipped elsewhere): the profile subflow measures the links between the zones on
rented VMs, the plan trains on netns VMs whose only shared medium with the flow is the network (the
controller on the bridge address, the testbed's S3 server), a spot VM is preempted, the plan changes
without restarting the other VMs' processes, and afterwards nothing of the testbed is left.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from infra.testbed import testbed_support
from profiles_store.tables import NETWORK_LINKS

pytest_plugins = ["tests.flow_fixtures"]
# Several minutes of VM profiling and training on isolated VMs: run with SAILOR_SLOW_TESTS=1 (as root).
pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("SAILOR_SLOW_TESTS") != "1", reason="slow: set SAILOR_SLOW_TESTS=1"),
              pytest.mark.skipif(not testbed_support()[0], reason=f"no testbed here: {testbed_support()[1]}")]

SCENARIO = """
device_types:
  cpu: {cpu_per_device: 0.4}
regions:
  r1:
    za:
      - {device_type: cpu, devices_per_vm: 1, market: on-demand, count: 2, usd_per_gpu_hour: 0.30}
    zb:
      - {device_type: cpu, devices_per_vm: 1, market: spot, count: 3, usd_per_gpu_hour: 0.05}
links:
  same_zone_gbps: 1.0
  same_region_gbps: 0.4
  cross_region_gbps: 0.1
cpu_budget_cores: 2
events:
  - {at_step: 8, kind: preemption, zone: zb, market: spot, grace_s: 2}
"""


def _ours(tag: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    cg = Path("/sys/fs/cgroup/cpu/sailor-testbed") / tag
    return ([ln for ln in ns.splitlines() if f"sb-{tag}-" in ln] + [ln for ln in links.splitlines() if f"sb{tag}" in ln]
            + ([str(cg)] if cg.exists() else []))


def test_a_run_on_isolated_vms_keeps_its_state_in_object_storage_and_leaves_nothing(profiled_store, tmp_path):
    from flows.sailor import sailor
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    sc = tmp_path / "scenario.yaml"
    sc.write_text(SCENARIO)
    work = tmp_path / "work"
    # Two data-parallel replicas on the two cheapest VMs (zb's spot): the preemption takes one, and the
    # replica on the other goes on in the same process under the next plan.
    state = sailor(run_name="testbed", model="gpt-tiny", global_batch_size=8, objective="max-throughput",
                   provider="local", max_gpus=2, scenario=str(sc), workers=4, steps=24, checkpoint_interval=4,
                   store_uri=profiled_store,
                   workdir=str(work), isolation="netns", calibration_tolerance=9.0, return_state=True)
    assert state.is_completed(), state.message
    h = RunHistory(open_store(profiled_store))
    r = h.show(state.result()["run_id"])
    c = r["cluster"]
    assert c["isolation"] == "netns" and {z["zone"] for z in c["zones"]} == {"za", "zb"}
    # the state is named by the folder the testbed's object store keeps it in: readable after the run, and
    # never an s3:// name that points at a public bucket (it read s3://sailor-runs/..., looked up on AWS)
    objects = work / "objects" / "sailor-runs" / "runs" / r["run_id"]
    assert c["checkpoint_uri"] == str(objects.resolve() / "checkpoints") and len(c["wheel_sha256"]) == 64
    assert all(v["address"].startswith("10.") for v in c["vms"])
    # the links between the zones were measured on rented VMs and are in the store now
    measured = {(lk.sender_zone, lk.receiver_zone) for lk in open_store(profiled_store).read(NETWORK_LINKS)}
    assert {("za", "zb"), ("zb", "za")} <= measured
    kinds = [e["kind"] for e in r["events"]]
    assert "preemption" in kinds and "reconfigured" in kinds, kinds
    rec = next(e for e in r["events"] if e["kind"] == "reconfigured")
    assert rec["kept_processes"] >= 1, rec  # the VM that stayed kept its worker process (same PID)
    # Nothing the workers wrote is on the flow's disk: the run's folder holds the provider's records only.
    run_dir = work / "runs" / r["run_id"]
    written = [
        str(p.relative_to(run_dir))
        for p in run_dir.rglob("*")
        if p.is_file() and p.parts[len(run_dir.parts)] != "local"
    ]
    assert written == [], written
    # The run's state is in the testbed's object store: checkpoints, per-step records, worker logs.
    assert any(p.name.startswith("step_") for p in (objects / "checkpoints").iterdir())
    assert (objects / "metrics" / "v1.jsonl").stat().st_size > 0
    assert list((objects / "logs").rglob("worker-0.log"))
    # after the run, its server gone: `sailor runs show --plot` reads the steps from that folder, each once
    from sailor_cli.main import main

    assert main(["runs", "show", r["run_id"], "--store", profiled_store, "--plot", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    # And nothing of the testbed is left: namespaces, veths, the bridge, cgroups.
    tag = json.loads(next((work / "runs" / r["run_id"] / "local").glob("state.json")).read_text())["testbeds"][
        r["run_id"]
    ]["tag"]
    assert _ours(tag) == []
