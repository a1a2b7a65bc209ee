"""The `sailor` flow on the gcp provider (the Compute fake): two regions, a preemption, a replan, completion.

The VMs are the fake's instances (CPU VMs of GPU type `cpu`; the one preempted is an n2-standard-16, a
2-device VM that runs two ranks),
provisioned with labels, a run firewall and SPOT scheduling by GcpProvider; the worker each VM's
startup script would start runs on this machine (tests/fakes/agents_here.py) after the assignment
went into instance metadata. The preemption is GCE's own signal: a `compute.instances.preempted`
zone operation and the instance TERMINATED, with the VM's worker gone. Afterwards the fake must hold
no instance and no firewall of the run, and no credential may appear anywhere the run wrote.
"""

from __future__ import annotations

import pytest

from infra.catalog import ScriptedPriceSource
from infra.cloud import ScriptedEventSource
from infra.gcp import GceClients, GcpConfig, GcpProvider
from sailor_core.domain import Market
from tests.cloud_flow_fixtures import (
    INTERRUPTED_RUN_STEPS,
    assert_two_ranks_on_one_vm,
    cloud_store,
    leaks,
    notice_runs_out,
    when_step,
    zones_per_plan,
)
from tests.fakes.agents_here import AgentsHere
from tests.fakes.gce_fake import GceFake

pytest_plugins = ["tests.flow_fixtures"]  # one Prefect test server per session, shared with test_flow

pytestmark = [pytest.mark.gcp, pytest.mark.usefixtures("prefect_harness")]

ZONES = ("us-central1-a", "europe-west4-a", "europe-west4-b")
FAKE_TOKEN = "ya29.fake-oauth-token-for-the-leak-check-0001"


@pytest.fixture(scope="module")
def fake():
    f = GceFake(project="flow-project").start()
    yield f
    f.stop()


def test_flow_on_gcp_survives_a_preemption_and_leaves_nothing(fake, request, tmp_path, monkeypatch):
    from flows.sailor import Deps, sailor
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    monkeypatch.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", FAKE_TOKEN)  # what a real run's environment might hold
    fake.reset()
    store_uri = cloud_store(request.getfixturevalue("profiled_store"), tmp_path / "store", ZONES)
    prices = ScriptedPriceSource(cloud="gcp")
    prices.set(instance_type="n2-standard-16", zone="us-central1-a", market=Market.SPOT, usd_per_hour=0.16)  # 2 dev.
    prices.set(instance_type="n2-standard-8", zone="europe-west4-a", market=Market.SPOT, usd_per_hour=0.09)
    prices.set(instance_type="n2-standard-8", zone="europe-west4-b", market=Market.ON_DEMAND, usd_per_hour=0.43)
    gcp = GcpProvider(GcpConfig(project="flow-project", regions=("us-central1", "europe-west4"), zones=ZONES,
                                max_vms_per_offering=1),
                      clients=GceClients(endpoint=fake.endpoint), prices=prices, event_source=ScriptedEventSource())
    provider = AgentsHere(gcp, tmp_path / "agents")
    work = tmp_path / "work"
    preempted: list[str] = []

    def preempt() -> None:
        vm = next(v for v in gcp.list_vms() if v.zone == "us-central1-a")
        fake.preempt("us-central1-a", vm.vm_id.split("/", 1)[1])  # GCE preempts: the operation, then TERMINATED
        notice_runs_out(provider, vm.vm_id, 30.0)  # GCE's 30 s ACPI grace: the flow stops the workers first
        provider.reclaim(vm.vm_id)  # the VM is off, its worker with it
        preempted.append(vm.vm_id)

    deps = Deps(provider=provider, store=open_store(store_uri), workdir=work, poll_s=1.5)
    watcher = when_step(deps.board, 4, preempt)
    # The budget affords the two spot VMs (0.25/h) but no pair with the on-demand one (>= 0.52/h).
    state = sailor(
        run_name="gcp-spot",
        model="gpt-tiny",
        global_batch_size=8,
        objective="max-throughput",
        max_usd_per_hour=0.3,
        provider="gcp",
        regions=["us-central1", "europe-west4"],
        gpu_types=["cpu"],
        steps=INTERRUPTED_RUN_STEPS,
        checkpoint_interval=4,
        store_uri=store_uri,
        workdir=str(work),
        deps=deps,
        return_state=True,
    )
    watcher.join(timeout=30)
    assert state.is_completed(), state.message
    assert preempted, "the preemption never happened"

    h = RunHistory(open_store(store_uri))
    run = h.show(next(r["run_id"] for r in h.list_runs() if r.get("name") == "gcp-spot"))
    kinds = [e["kind"] for e in run["events"]]
    assert run["status"] == "completed"
    assert "preemption" in kinds and "reconfigured" in kinds, kinds
    zones = zones_per_plan(run)
    print(f"gcp flow: zones per plan {[sorted(z) for z in zones]}, events {kinds}")
    assert "us-central1-a" in zones[0] and any(z.startswith("europe-west4") for z in zones[-1])  # two regions
    assert "us-central1-a" not in zones[-1]  # replanned onto the remaining capacity
    # The 2-device VM ran two ranks until it was taken back.
    assert_two_ranks_on_one_vm(run["plans"][0]["plan"], "us-central1-a")

    assert fake.instances == {} and fake.firewalls == {}
    assert provider.alive() == []
    sent = [json_body for m, p, json_body in fake.requests if p.endswith("/setMetadata")]
    assert sent, "no assignment went to the VMs"
    assert leaks([FAKE_TOKEN], store_uri=store_uri, folders=[work, tmp_path / "agents"],
                 extra=[str(b) for b in sent]) == []
