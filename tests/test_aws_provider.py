"""The AWS provider against moto's EC2 server (started here on a loopback port, stopped at the end).

Spot prices and interruption notices are injected through our own price and event sources, since
moto's spot price history is a fixed dummy and it emits no notices. Capacity errors are injected by
a client wrapper that answers RunInstances in chosen zones the way EC2 does.
"""

from __future__ import annotations

import base64
from datetime import timedelta

import pytest

from infra.aws import AwsConfig, AwsProvider
from infra.aws.prices import SpotPriceHistorySource
from infra.catalog import ScriptedPriceSource
from infra.cloud import RUN_TAG, ScriptedEventSource, format_dry_run
from infra.provider import EventKind, Provider, VmRequest, WorkerAssignment
from sailor_core.domain import Market
from sailor_core.errors import CapacityError, ProviderError
from tests.fakes.moto_server import MotoServer, client_factory
from tests.provider_contract import Clock

pytestmark = pytest.mark.aws

REGIONS = ("us-east-1", "us-west-2")
IMAGE = "Deep Learning AMI Ubuntu*"


@pytest.fixture(scope="module")
def moto():
    server = MotoServer()
    yield server
    server.stop()


class CapacityWall:
    """Wraps `client_for`: RunInstances in the listed zones (or (zone, type) pairs) fails like EC2 does."""

    def __init__(self, client_for, full_zones: set[str]) -> None:
        self.client_for, self.full_zones = client_for, full_zones

    def __call__(self, service: str, region: str):
        client = self.client_for(service, region)
        if service != "ec2":
            return client
        wall = self

        class Proxy:
            def __getattr__(self, name):
                return getattr(client, name)

            def run_instances(self, **kw):
                from botocore.exceptions import ClientError

                zone = kw["Placement"]["AvailabilityZone"]
                if zone in wall.full_zones or (zone, kw["InstanceType"]) in wall.full_zones:
                    raise ClientError({"Error": {"Code": "InsufficientInstanceCapacity",
                                                 "Message": f"no capacity in {zone}"}}, "RunInstances")
                return client.run_instances(**kw)

        return Proxy()


@pytest.fixture
def env(moto):
    moto.reset()
    clock = Clock()
    prices = ScriptedPriceSource(cloud="aws", clock=clock)
    for zone in ("us-east-1a", "us-east-1b", "us-west-2a", "us-west-2b"):
        prices.set(instance_type="g5.xlarge", zone=zone, market=Market.SPOT, usd_per_hour=0.40)
        prices.set(instance_type="g5.xlarge", zone=zone, market=Market.ON_DEMAND, usd_per_hour=1.006)
        prices.set(instance_type="p4d.24xlarge", zone=zone, market=Market.SPOT, usd_per_hour=12.0)
    events = ScriptedEventSource(clock=clock)
    client_for = client_factory(moto.url)
    wall = CapacityWall(client_for, set())
    provider = AwsProvider(AwsConfig(regions=REGIONS, image_name=IMAGE, disk_gb=120, max_vms_per_offering=3,
                                     wait_delay_s=0.05),
                           client_for=wall, prices=prices, event_source=events, clock=clock)
    return provider, prices, events, clock, client_for, wall


def req(name: str, zone: str, market: Market = Market.SPOT, run: str = "r1") -> VmRequest:
    return VmRequest(run_id=run, name=name, zone=zone, gpu_type="A10G-24", gpus=1, market=market)


def running(client_for, region: str) -> list[dict]:
    res = client_for("ec2", region).describe_instances(
        Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])["Reservations"]
    return [i for r in res for i in r["Instances"]]


def sailor_groups(client_for, region: str) -> list[dict]:
    return client_for("ec2", region).describe_security_groups(
        Filters=[{"Name": "tag-key", "Values": [RUN_TAG]}])["SecurityGroups"]


def test_offerings_map_types_to_gpus_per_zone_with_prices_and_fetch_time(env) -> None:
    provider, *_ , clock, _, _ = env
    assert isinstance(provider, Provider)
    offers = provider.offerings(gpu_types=["A10G-24", "A100-40"])
    keys = {(o.instance_type, o.zone, o.market) for o in offers}
    assert ("g5.xlarge", "us-east-1a", Market.SPOT) in keys and ("g5.xlarge", "us-west-2b", Market.ON_DEMAND) in keys
    assert ("p4d.24xlarge", "us-east-1a", Market.ON_DEMAND) not in keys  # no on-demand price quoted: not offered
    p4 = next(o for o in offers if o.instance_type == "p4d.24xlarge" and o.zone == "us-east-1a")
    assert (p4.gpu_type, p4.gpus_per_vm, p4.gpus, p4.usd_per_gpu_hour) == ("A100-40", 8, 24, 1.5)
    assert p4.price_fetched_at == clock.now and p4.cloud == "aws" and p4.region == "us-east-1"
    assert all(o.gpu_type in ("A10G-24", "A100-40") for o in offers)
    assert provider.offerings(regions=["eu-west-1"]) == []


def test_provision_in_two_regions_tags_spot_and_ports_only_between_the_run(env) -> None:
    provider, _, _, _, client_for, _ = env
    vms = provider.provision([req("w0", "us-east-1a"), req("w1", "us-west-2a", Market.ON_DEMAND)])
    assert [(v.zone, v.market, v.state, v.gpu_type) for v in vms] == [
        ("us-east-1a", Market.SPOT, "running", "A10G-24"), ("us-west-2a", Market.ON_DEMAND, "running", "A10G-24")]
    assert vms[0].usd_per_hour == pytest.approx(0.40) and vms[1].usd_per_hour == pytest.approx(1.006)
    east, west = running(client_for, "us-east-1"), running(client_for, "us-west-2")
    assert len(east) == len(west) == 1
    assert east[0].get("InstanceLifecycle") == "spot" and "InstanceLifecycle" not in west[0]
    assert {"Key": RUN_TAG, "Value": "r1"} in east[0]["Tags"]
    ec2 = client_for("ec2", "us-east-1")
    user_data = ec2.describe_instance_attribute(InstanceId=east[0]["InstanceId"], Attribute="userData")
    script = base64.b64decode(user_data["UserData"]["Value"]).decode()
    assert script.startswith("#!/bin/bash") and '"$bin/sailor" worker --control' in script  # the bootstrap
    vol = ec2.describe_volumes(Filters=[{"Name": f"tag:{RUN_TAG}", "Values": ["r1"]}])["Volumes"]
    assert vol and vol[0]["Size"] == 120
    # The group opens only the rendezvous and data ports, to itself and to the other region's VM.
    (sg,) = sailor_groups(client_for, "us-east-1")
    perms = sg["IpPermissions"]
    assert {(p["FromPort"], p["ToPort"]) for p in perms} == {(29400, 29400), (29500, 29600)}
    cidrs = {r["CidrIp"] for p in perms for r in p.get("IpRanges", [])}
    assert cidrs == {f"{west[0]['PublicIpAddress']}/32"}
    assert all(p.get("UserIdGroupPairs", [{}])[0].get("GroupId") == sg["GroupId"] for p in perms)
    assert not any(r["CidrIp"] == "0.0.0.0/0" for p in perms for r in p.get("IpRanges", []))
    assert {v.vm_id for v in provider.list_vms("r1")} == {v.vm_id for v in vms}
    assert provider.list_vms("other") == []


def test_capacity_error_falls_back_to_next_zone_and_reports_it(env) -> None:
    provider, _, _, _, client_for, wall = env
    wall.full_zones |= {"us-east-1a"}
    (vm,) = provider.provision([req("w0", "us-east-1a")])
    assert vm.zone == "us-east-1b"
    assert provider.fallbacks[-1].requested_zone == "us-east-1a" and "InsufficientInstanceCapacity" in \
        provider.fallbacks[-1].reason
    ev = [e for e in provider.events("r1") if e.kind is EventKind.CAPACITY_CHANGE]
    assert ev and ev[0].detail["zone"] == "us-east-1b" and ev[0].zone == "us-east-1a"
    # Every zone of both regions full: nothing is left running, and the error says where it tried.
    wall.full_zones |= {f"us-east-1{c}" for c in "abcdef"} | {f"us-west-2{c}" for c in "abcd"}
    with pytest.raises(CapacityError, match=r"tried us-west-2a \(InsufficientInstanceCapacity\).*us-east-1f.*to fix"):
        provider.provision([req("w9", "us-west-2a", run="r2")])
    # A region outside the provider's list is refused up front.
    with pytest.raises(ProviderError, match="eu-west-1 is not among"):
        provider.provision([req("w9", "eu-west-1a", run="r2")])
    assert provider.list_vms("r2") == []


def test_all_or_nothing_when_a_later_vm_fits_nowhere(env) -> None:
    provider, _, _, _, client_for, wall = env
    wall.full_zones |= {(f"us-west-2{c}", "p4d.24xlarge") for c in "abcd"}
    wall.full_zones |= {(f"us-east-1{c}", "p4d.24xlarge") for c in "abcdef"}
    big = VmRequest(run_id="r3", name="w1", zone="us-west-2a", gpu_type="A100-40", gpus=8, market=Market.SPOT)
    with pytest.raises(CapacityError, match="p4d.24xlarge"):
        provider.provision([req("w0", "us-east-1a", run="r3"), big])
    assert running(client_for, "us-east-1") == []


def test_dry_run_prints_exact_requests_and_cost_and_rents_nothing(env) -> None:
    provider, _, _, _, client_for, _ = env
    vms = provider.provision([req("w0", "us-east-1a"), req("w1", "us-west-2a", Market.ON_DEMAND)], dry_run=True)
    assert [v.state for v in vms] == ["planned", "planned"]
    report = provider.last_dry_run
    ops = [(c.operation, c.location) for c in report.calls]
    assert ops == [("CreateSecurityGroup", "us-east-1"), ("AuthorizeSecurityGroupIngress", "us-east-1"),
                   ("DescribeImages", "us-east-1"), ("RunInstances", "us-east-1"),
                   ("CreateSecurityGroup", "us-west-2"), ("AuthorizeSecurityGroupIngress", "us-west-2"),
                   ("DescribeImages", "us-west-2"), ("RunInstances", "us-west-2")]
    run = report.calls[3].params
    assert run["InstanceMarketOptions"]["MarketType"] == "spot" and run["Placement"]["AvailabilityZone"] == "us-east-1a"
    assert "InstanceMarketOptions" not in report.calls[7].params
    text = format_dry_run(report)
    assert "hourly cost: $1.4060/h" in text and "RunInstances" in text
    print(text.splitlines()[0], "|", text.splitlines()[-1])
    assert running(client_for, "us-east-1") == [] and sailor_groups(client_for, "us-east-1") == []


def test_events_spot_interruption_rebalance_loss_and_price_change(env) -> None:
    provider, prices, events, clock, client_for, _ = env
    vms = provider.provision([req("w0", "us-east-1a"), req("w1", "us-west-2a")])
    assert provider.events("r1") == []
    t0 = clock.now
    clock.tick()
    events.rebalance_recommendation(vms[1])
    events.spot_interruption(vms[0])
    got = provider.events("r1", since=t0)
    assert [(e.kind, e.vm_id, e.detail["signal"]) for e in got] == [
        (EventKind.CAPACITY_CHANGE, vms[1].vm_id, "rebalance-recommendation"),
        (EventKind.PREEMPTION, vms[0].vm_id, "spot-instance-action")]
    # Two minutes later EC2 reclaims the VM: its state says so, reported once as LOST.
    clock.tick(120)
    t1 = clock.now
    client_for("ec2", "us-east-1").terminate_instances(InstanceIds=[vms[0].vm_id])
    clock.tick()
    lost = [e for e in provider.events("r1", since=t1) if e.kind is EventKind.LOST]
    assert [(e.vm_id, e.market, e.detail["state"]) for e in lost] == [(vms[0].vm_id, Market.SPOT, "terminated")]
    assert [e.kind for e in provider.events("r1", since=clock.now)] == []
    # The spot price of the surviving VM moves: one PRICE_CHANGE per move, per GPU-hour.
    prices.set(instance_type="g5.xlarge", zone="us-west-2a", market=Market.SPOT, usd_per_hour=0.9)
    clock.tick()
    t2 = clock.now
    moved = provider.events("r1", since=t2 - timedelta(seconds=1))
    assert [(e.kind, e.zone, e.detail["old_usd_per_gpu_hour"], e.detail["new_usd_per_gpu_hour"]) for e in moved] == [
        (EventKind.PRICE_CHANGE, "us-west-2a", 0.40, 0.9)]
    # The interrupted (zone, type) is not offered for spot until the cooldown has passed.
    spot = {o.zone: o.gpus for o in provider.offerings(gpu_types=["A10G-24"], markets=[Market.SPOT])
            if o.instance_type == "g5.xlarge"}
    assert spot["us-east-1a"] == 0 and spot["us-west-2a"] > 0  # sold out, price still reported
    assert any(o.zone == "us-east-1a" for o in provider.offerings(gpu_types=["A10G-24"], markets=[Market.ON_DEMAND]))
    clock.tick(provider.config.interruption_cooldown_s)
    assert any(o.zone == "us-east-1a" and o.gpus > 0
               for o in provider.offerings(gpu_types=["A10G-24"], markets=[Market.SPOT]))
    # VMs the provider itself terminated are not "lost".
    provider.terminate([vms[1].vm_id])
    clock.tick()
    assert [e for e in provider.events("r1", since=clock.now - timedelta(seconds=1)) if e.kind is EventKind.LOST] == []


def test_bootstrap_sends_the_assignment_through_ssm_and_refuses_secrets(env) -> None:
    provider, _, _, _, client_for, _ = env
    (vm,) = provider.provision([req("w0", "us-east-1a")])
    a = WorkerAssignment(run_id="r1", plan_version=2, plan_json="{}", rendezvous_endpoint="10.0.0.1:29400",
                         ranks=(0, 1), world_size=2, checkpoint_uri="s3://b/ckpt")
    provider.bootstrap(vm, a)
    cmds = client_for("ssm", "us-east-1").list_commands(InstanceId=vm.vm_id)["Commands"]
    assert len(cmds) == 1 and cmds[0]["DocumentName"] == "AWS-RunShellScript"
    assert any('"plan_version": 2' in c for c in cmds[0]["Parameters"]["commands"])
    bad = WorkerAssignment(run_id="r1", plan_version=3, plan_json="{}", rendezvous_endpoint="x:1", ranks=(0,),
                           world_size=1, env={"AWS_SECRET_ACCESS_KEY": "x"})
    with pytest.raises(ProviderError, match="refusing to copy.*instance role"):
        provider.bootstrap(vm, bad)


def test_cleanup_finds_and_removes_everything_a_run_left(env) -> None:
    provider, _, _, _, client_for, _ = env
    provider.provision([req("w0", "us-east-1a", run="keep"), req("w1", "us-west-2a", run="keep")])
    provider.provision([req("w0", "us-east-1a", run="gone"), req("w1", "us-west-2b", run="gone")])
    # A second process (the CLI) sees the run's resources by their tags alone.
    fresh = AwsProvider(provider.config, client_for=client_for, prices=provider.prices)
    planned = fresh.cleanup_resources("gone", dry_run=True)
    assert (
        len([x for x in planned if x.startswith("i-")]) == 2 and len([x for x in planned if x.startswith("sg-")]) == 2
    )
    assert len(running(client_for, "us-east-1")) == 2  # dry run removed nothing
    assert fresh.cleanup("gone", dry_run=True) == [x for x in planned if x.startswith("i-")]
    removed = fresh.cleanup_resources("gone")
    assert sorted(removed) == sorted(planned)
    assert fresh.list_vms("gone") == [] and len(fresh.list_vms("keep")) == 2
    assert [g["GroupName"] for g in sailor_groups(client_for, "us-west-2")] == ["sailor-keep"]
    assert len(fresh.cleanup(None)) == 2
    for region in REGIONS:
        assert running(client_for, region) == [] and sailor_groups(client_for, region) == []
    assert fresh.cleanup(None) == []  # idempotent


def test_spot_price_history_source_reads_ec2(env) -> None:
    _, _, _, clock, client_for, _ = env
    src = SpotPriceHistorySource(lambda region: client_for("ec2", region), clock=clock)
    quotes = src.quotes(instance_types=["g5.xlarge"], regions=["us-east-1"], markets=[Market.SPOT])
    zones = {q.zone for q in quotes}
    assert {"us-east-1a", "us-east-1b"} <= zones
    assert all(q.market is Market.SPOT and q.fetched_at == clock.now and q.usd_per_hour > 0 for q in quotes)
    assert src.quotes(instance_types=["g5.xlarge"], regions=["us-east-1"], markets=[Market.ON_DEMAND]) == []


def test_a_request_without_instance_type_gets_the_shape_offered_there(env) -> None:
    provider, prices, _, _, client_for, _ = env
    prices.set(instance_type="c7i.2xlarge", zone="us-east-1b", market=Market.SPOT, usd_per_hour=0.12)
    assert [(o.instance_type, o.gpus) for o in provider.offerings(gpu_types=["cpu"])] == [("c7i.2xlarge", 3)]
    (vm,) = provider.provision([VmRequest(run_id="r5", name="w0", zone="us-east-1b", gpu_type="cpu", gpus=1,
                                          market=Market.SPOT)])
    assert running(client_for, "us-east-1")[0]["InstanceType"] == "c7i.2xlarge" and vm.usd_per_hour == 0.12
    assert [(o.instance_type, o.gpus) for o in provider.offerings(gpu_types=["cpu"])] == [("c7i.2xlarge", 2)]


class QuotaAnswers:
    """Service Quotas' GetServiceQuota answers (moto does not serve EC2 quotas): vCPU limits by code."""

    def __init__(self, limits: dict[str, float]) -> None:
        self.limits = limits
        self.asked: list[str] = []

    def get_service_quota(self, *, ServiceCode: str, QuotaCode: str) -> dict:
        assert ServiceCode == "ec2"
        self.asked.append(QuotaCode)
        return {"Quota": {"ServiceCode": "ec2", "QuotaCode": QuotaCode, "Value": self.limits[QuotaCode]}}


def test_counts_follow_the_vcpu_quotas_less_our_running_vms(moto) -> None:
    moto.reset()
    base = client_factory(moto.url)
    quotas = QuotaAnswers({"L-DB2E81BA": 10.0, "L-3819A6DF": 0.0, "L-417A185B": 96.0, "L-7212CCBC": 192.0})

    def client_for(service: str, region: str):
        return quotas if service == "service-quotas" else base(service, region)

    prices = ScriptedPriceSource(cloud="aws")
    for m, p in ((Market.ON_DEMAND, 1.006), (Market.SPOT, 0.4)):
        prices.set(instance_type="g5.xlarge", zone="us-east-1a", market=m, usd_per_hour=p)
        prices.set(instance_type="g5.12xlarge", zone="us-east-1a", market=m, usd_per_hour=p * 5)
    prices.set(instance_type="p4d.24xlarge", zone="us-east-1a", market=Market.SPOT, usd_per_hour=12.0)
    provider = AwsProvider(AwsConfig(regions=("us-east-1",), zones=("us-east-1a",), image_name=IMAGE),
                           client_for=client_for, prices=prices)
    counts = {(o.instance_type, o.market): o.gpus for o in provider.offerings()}
    # G on-demand: 10 vCPUs = two g5.xlarge (4 vCPUs) or no g5.12xlarge (48); G spot quota 0: sold out.
    assert counts[("g5.xlarge", Market.ON_DEMAND)] == 2 and counts[("g5.12xlarge", Market.ON_DEMAND)] == 0
    assert counts[("g5.xlarge", Market.SPOT)] == 0
    assert counts[("p4d.24xlarge", Market.SPOT)] == 2 * 8  # 192 vCPUs of P spot = two p4d.24xlarge (96 each)
    provider.provision([VmRequest(run_id="q", name="w0", zone="us-east-1a", gpu_type="A10G-24", gpus=1)])
    counts = {(o.instance_type, o.market): o.gpus for o in provider.offerings()}
    assert counts[("g5.xlarge", Market.ON_DEMAND)] == 1  # 10 - 4 vCPUs left
    with pytest.raises(CapacityError, match="SailorCapReached"):
        provider.provision([VmRequest(run_id="q", name=f"w{i}", zone="us-east-1a", gpu_type="A10G-24", gpus=1)
                            for i in (1, 2)])
    assert len(provider.list_vms("q")) == 1
    provider.cleanup("q")
