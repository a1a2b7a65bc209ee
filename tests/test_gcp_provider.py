"""The GCP provider against the local Compute API fake (tests/fakes/gce_fake.py), anonymous credentials.

The fake runs in a thread of this process on a loopback port; google-cloud-compute talks plain
HTTP to it. Stockouts and preemptions are driven from the fake the way GCE reports them
(an insert operation failing with ZONE_RESOURCE_POOL_EXHAUSTED, a compute.instances.preempted
zone operation and the instance TERMINATED).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from infra.catalog import ScriptedPriceSource
from infra.cloud import ScriptedEventSource, dry_run_text, format_dry_run
from infra.gcp import GceClients, GcpConfig, GcpProvider, gce_name
from infra.provider import EventKind, Provider, VmRequest, WorkerAssignment
from sailor_core.domain import Market
from sailor_core.errors import CapacityError, ProviderError
from tests.fakes.gce_fake import GceFake
from tests.provider_contract import Clock

pytestmark = pytest.mark.gcp

REGIONS = ("us-central1", "europe-west4")
V100_1 = "n1-standard-8+nvidia-tesla-v100:1"


@pytest.fixture(scope="module")
def fake():
    f = GceFake(project="sailor-test").start()
    yield f
    f.stop()


@pytest.fixture(scope="module")
def clients(fake):
    return GceClients(endpoint=fake.endpoint)


@pytest.fixture
def env(fake, clients):
    fake.reset()
    clock = Clock()
    prices = ScriptedPriceSource(cloud="gcp", clock=clock)
    for zone in ("us-central1-a", "us-central1-b", "europe-west4-a", "europe-west4-b"):
        prices.set(instance_type=V100_1, zone=zone, market=Market.SPOT, usd_per_hour=0.82)
        prices.set(instance_type=V100_1, zone=zone, market=Market.ON_DEMAND, usd_per_hour=2.86)
        prices.set(instance_type="a2-highgpu-1g", zone=zone, market=Market.SPOT, usd_per_hour=1.15)
        prices.set(instance_type="g2-standard-4", zone=zone, market=Market.SPOT, usd_per_hour=0.22)
    events = ScriptedEventSource(clock=clock)
    provider = GcpProvider(GcpConfig(project="sailor-test", regions=REGIONS, disk_gb=150, max_vms_per_offering=2),
                           clients=clients, prices=prices, event_source=events, clock=clock)
    return provider, prices, events, clock, fake


def req(name: str, zone: str, market: Market = Market.SPOT, run: str = "R_1", gpu: str = "V100-16") -> VmRequest:
    return VmRequest(run_id=run, name=name, zone=zone, gpu_type=gpu, gpus=1, market=market)


def test_offerings_per_zone_with_gpus_quotas_and_prices(env) -> None:
    provider, _, _, clock, _ = env
    assert isinstance(provider, Provider)
    offers = provider.offerings(gpu_types=["V100-16", "A100-40", "L4-24"])
    keys = {(o.instance_type, o.zone, o.market): o for o in offers}
    v = keys[(V100_1, "us-central1-a", Market.SPOT)]
    assert (v.gpu_type, v.gpus_per_vm, v.usd_per_gpu_hour, v.price_fetched_at) == ("V100-16", 1, 0.82, clock.now)
    assert v.gpus == 8  # PREEMPTIBLE_NVIDIA_V100_GPUS quota of us-central1
    assert keys[(V100_1, "europe-west4-b", Market.ON_DEMAND)].gpus == 4
    assert (V100_1, "us-central1-c", Market.SPOT) not in keys  # the zone has no V100
    assert ("a2-highgpu-1g", "europe-west4-b", Market.SPOT) not in keys  # no A100 there
    assert keys[("a2-highgpu-1g", "us-central1-b", Market.SPOT)].gpus == 32
    assert ("g2-standard-4", "us-central1-a", Market.ON_DEMAND) not in keys  # unpriced: not offered
    assert provider.offerings(regions=["asia-east1"]) == []


def test_provision_spot_and_standard_in_two_regions_with_labels_firewall_and_script(env) -> None:
    provider, _, _, _, fake = env
    vms = provider.provision([req("w0", "us-central1-a"), req("w1", "europe-west4-a", Market.ON_DEMAND)])
    assert [(v.vm_id, v.market, v.state, v.usd_per_hour) for v in vms] == [
        ("us-central1-a/sailor-r-1-w0", Market.SPOT, "running", 0.82),
        ("europe-west4-a/sailor-r-1-w1", Market.ON_DEMAND, "running", 2.86)]
    assert vms[0].run_id == "R_1" and vms[0].address.startswith("10.128.")
    inserted = [b for m, p, b in fake.requests if m == "POST" and p.endswith("/instances")]
    spot, std = inserted
    assert spot["scheduling"]["provisioningModel"] == "SPOT" and spot["scheduling"]["onHostMaintenance"] == "TERMINATE"
    assert std["scheduling"]["provisioningModel"] == "STANDARD"
    assert spot["guestAccelerators"] == [{"acceleratorType": "zones/us-central1-a/acceleratorTypes/nvidia-tesla-v100",
                                          "acceleratorCount": 1}]
    assert (
        spot["labels"]["sailor-run"] == "r-1" and spot["disks"][0]["initializeParams"]["labels"]["sailor-run"] == "r-1"
    )
    assert spot["disks"][0]["initializeParams"]["diskSizeGb"] == "150"
    script = {i["key"]: i["value"] for i in spot["metadata"]["items"]}["startup-script"]
    assert '"$bin/sailor" worker --control' in script and "sailor-assignment" in script  # the bootstrap
    (fw,) = fake.firewalls.values()
    assert fw["sourceTags"] == fw["targetTags"] == [gce_name("sailor-R_1")] == spot["tags"]["items"]
    assert fw["allowed"] == [{"IPProtocol": "tcp", "ports": ["29400", "29500-29600"]}]
    assert "sourceRanges" not in fw
    assert {v.vm_id for v in provider.list_vms("R_1")} == {v.vm_id for v in vms}


def test_stockout_falls_back_to_next_zone_then_region(env) -> None:
    provider, _, _, _, fake = env
    fake.exhausted |= {"us-central1-a"}
    (vm,) = provider.provision([req("w0", "us-central1-a")])
    assert vm.zone == "us-central1-b"
    assert "ZONE_RESOURCE_POOL_EXHAUSTED" in provider.fallbacks[-1].reason
    fake.exhausted |= {"us-central1-b"}
    (vm2,) = provider.provision([req("w1", "us-central1-a")])
    assert vm2.zone == "europe-west4-a"
    ev = [e for e in provider.events("R_1") if e.kind is EventKind.CAPACITY_CHANGE]
    assert [e.detail["zone"] for e in ev] == ["us-central1-b", "europe-west4-a"]
    fake.exhausted |= {"europe-west4-a", "europe-west4-b"}
    with pytest.raises(CapacityError, match=r"tried us-central1-a \(ZONE_RESOURCE_POOL_EXHAUSTED\).*to fix"):
        provider.provision([req("w2", "us-central1-a", run="R2"), ])
    assert provider.list_vms("R2") == []


def test_all_or_nothing_and_bad_requests_say_how_to_fix(env) -> None:
    provider, _, _, _, fake = env
    fake.exhausted |= {(z, "a2-highgpu-1g") for z in fake.zones}
    with pytest.raises(CapacityError, match="a2-highgpu-1g"):
        provider.provision([req("w0", "us-central1-a", run="R3"), req("w1", "us-central1-a", run="R3", gpu="A100-40")])
    assert provider.list_vms("R3") == [] and fake.live_instances() == []
    with pytest.raises(ProviderError, match="no GCE shape has 1x B200.*to fix"):
        provider.provision([req("w0", "us-central1-a", gpu="B200")])
    with pytest.raises(ProviderError, match="asia-east1 is not among"):
        provider.provision([req("w0", "asia-east1-a")])


def test_dry_run_lists_exact_requests_and_cost_and_creates_nothing(env) -> None:
    provider, _, _, _, fake = env
    vms = provider.provision([req("w0", "us-central1-a"), req("w1", "europe-west4-a", Market.ON_DEMAND)],
                             dry_run=True)
    assert [v.state for v in vms] == ["planned", "planned"]
    rep = provider.last_dry_run
    assert [c.operation for c in rep.calls] == ["firewalls.insert", "instances.insert", "instances.insert"]
    assert rep.calls[1].params["instanceResource"]["scheduling"]["provisioningModel"] == "SPOT"
    text = format_dry_run(rep)
    assert "hourly cost: $3.6800/h" in text
    assert not [r for r in fake.requests if r[0] != "GET"] and fake.instances == {} and fake.firewalls == {}
    assert dry_run_text(provider, [req("w0", "us-central1-a")]).endswith("hourly cost: $0.8200/h")


def test_preemption_operation_and_status_become_events(env) -> None:
    provider, prices, events, clock, fake = env
    vms = provider.provision([req("w0", "us-central1-a"), req("w1", "europe-west4-a")])
    assert provider.events("R_1") == []
    t0 = clock.now
    clock.tick()
    fake.preempt("us-central1-a", "sailor-r-1-w0")
    got = provider.events("R_1", since=t0)
    assert [(e.kind, e.vm_id, e.detail["signal"]) for e in got] == [
        (EventKind.PREEMPTION, vms[0].vm_id, "instance-preempted"), (EventKind.LOST, vms[0].vm_id, "instance-state")]
    assert got[1].detail["state"] == "TERMINATED"
    clock.tick()
    assert provider.events("R_1", since=clock.now - timedelta(seconds=1)) == []  # reported once
    # The preempted (zone, shape) leaves spot offerings for the cooldown; placement skips it too.
    offered = {(o.zone, o.market): o.gpus for o in provider.offerings(gpu_types=["V100-16"])}
    assert offered[("us-central1-a", Market.SPOT)] == 0 and offered[("us-central1-a", Market.ON_DEMAND)] > 0
    (moved,) = provider.provision([req("w9", "us-central1-a")])
    assert moved.zone == "us-central1-b" and "preempted there recently" in provider.fallbacks[-1].reason
    provider.terminate([moved.vm_id])
    clock.tick()
    events.preemption(vms[1])
    prices.set(instance_type=V100_1, zone="europe-west4-a", market=Market.SPOT, usd_per_hour=1.64)
    got = provider.events("R_1", since=clock.now - timedelta(seconds=1))
    assert [e.kind for e in got] == [EventKind.PREEMPTION, EventKind.PRICE_CHANGE]
    assert (got[1].detail["old_usd_per_gpu_hour"], got[1].detail["new_usd_per_gpu_hour"]) == (0.82, 1.64)
    provider.terminate([vms[1].vm_id])
    clock.tick()
    assert provider.events("R_1", since=clock.now - timedelta(seconds=1)) == []  # our own delete is not "lost"


def test_bootstrap_sets_the_assignment_metadata_and_refuses_secrets(env) -> None:
    provider, _, _, _, fake = env
    (vm,) = provider.provision([req("w0", "us-central1-a")])
    a = WorkerAssignment(run_id="R_1", plan_version=1, plan_json="{}", rendezvous_endpoint="10.128.0.2:29400",
                         ranks=(0,), world_size=1, checkpoint_uri="gs://b/ck")
    provider.bootstrap(vm, a)
    items = {i["key"]: i["value"] for i in fake.instances[("us-central1-a", "sailor-r-1-w0")]["metadata"]["items"]}
    assert '"rendezvous_endpoint": "10.128.0.2:29400"' in items["sailor-assignment"] and "startup-script" in items
    provider.bootstrap(vm, a)  # again, with the new fingerprint
    with pytest.raises(ProviderError, match="refusing to copy"):
        provider.bootstrap(vm, WorkerAssignment(run_id="R_1", plan_version=2, plan_json="{}", rendezvous_endpoint="x:1",
                                                ranks=(0,), world_size=1, env={"GOOGLE_OAUTH_ACCESS_TOKEN": "t"}))


def test_cleanup_removes_a_runs_instances_and_firewall_only(env, clients) -> None:
    provider, _, _, _, fake = env
    provider.provision([req("w0", "us-central1-a", run="keep"), req("w1", "europe-west4-a", run="keep")])
    provider.provision([req("w0", "us-central1-b", run="gone"), req("w1", "europe-west4-b", run="gone")])
    fake.preempt("us-central1-b", "sailor-gone-w0")  # a stopped spot VM still counts as left behind
    fresh = GcpProvider(provider.config, clients=clients, prices=provider.prices)
    planned = fresh.cleanup_resources("gone", dry_run=True)
    assert planned == ["europe-west4-b/sailor-gone-w1", "us-central1-b/sailor-gone-w0", "firewall/sailor-gone-ports"]
    assert len(fake.instances) == 4
    assert fresh.cleanup("gone", dry_run=True) == planned[:2]
    assert fresh.cleanup_resources("gone") == planned
    assert sorted(n for _, n in fake.instances) == ["sailor-keep-w0", "sailor-keep-w1"]
    assert list(fake.firewalls) == ["sailor-keep-ports"]
    fresh.cleanup(None)
    assert fake.instances == {} and fake.firewalls == {}
    assert fresh.cleanup(None) == []
