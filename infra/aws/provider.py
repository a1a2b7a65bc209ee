"""The AWS provider: GPU VMs on EC2 (on-demand and spot) in several regions, behind infra.provider.Provider.

Contract:
- What both clouds do alike (the offerings loop, zone fallbacks, dry run, spot cooldown, event log)
  is infra.cloud.CloudProvider's; this module supplies EC2's calls through its hooks.
- Side effects come in through the constructor: `client_for(service, region)` returns a boto3
  client (default: boto3's standard credential chain; tests point it at moto's server), a price
  source (live feeds or a catalog), an event source for notices EC2's API cannot be polled for,
  and a clock. Nothing reaches for a global; no credential is read, logged or stored here.
- `offerings()` lists GPU instance types (infra/aws/instance_types.py) offered per availability
  zone (DescribeInstanceTypeOfferings) in the configured regions, priced per market from the price
  source with the fetch time; counts come from the vCPU quotas (Service Quotas) where readable,
  else `max_vms_per_offering`. A shape without a price is not offered; a sold-out one (quota or
  cap used, spot interrupted there recently) is reported with count 0 and its price.
- `provision()` creates one security group per region and run (ingress on the rendezvous and data
  ports only from the group itself and from the run's VMs in other regions, by /32), then
  RunInstances per VM with the image, disk, startup script and, for spot,
  InstanceMarketOptions; every instance, volume and group is tagged `sailor:run=<run id>`. A
  capacity error moves the VM to the next zone of its region offering the type, then to the next
  configured region, recorded in `fallbacks` and as a CAPACITY_CHANGE event. If a VM fits nowhere,
  the VMs this call started are terminated and CapacityError says where it tried.
  `dry_run=True` sends nothing and records the exact requests and hourly cost in `last_dry_run`.
- `bootstrap()` sends the assignment with SSM Run Command (the VM's instance profile must allow
  SSM); `events()` reports instance state (spot terminations, lost VMs), spot request status
  (marked-for-termination), the injected source's notices and price moves; a spot interruption
  takes that (zone, type) out of spot offerings and placement for `interruption_cooldown_s`;
  `cleanup(run_id)`
  terminates tagged instances, waits for them, and deletes the run's volumes and security groups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from infra.aws.instance_types import QUOTA_CODES, SHAPES, InstanceShape
from infra.bootstrap import assignment_commands, render_startup_script
from infra.catalog import PriceSource
from infra.cloud import (
    DATA_PORTS,
    RENDEZVOUS_PORT,
    RUN_TAG,
    CloudProvider,
    EventSource,
    FreeGpus,
    fallback_zones,
    utcnow,
)
from infra.provider import ApiCall, EventKind, ProviderEvent, Vm, VmRequest, WorkerAssignment
from sailor_core.domain import Market, default_region
from sailor_core.errors import ProviderError

_LOG = logging.getLogger(__name__)

CAPACITY_CODES = frozenset({"InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientHostCapacity",
                            "Unsupported", "InsufficientCapacityOnHost", "SpotMaxPriceTooLow",
                            # quotas are per region: the next region may still have room
                            "VcpuLimitExceeded", "MaxSpotInstanceCountExceeded", "InstanceLimitExceeded",
                            "SailorCapReached"})
LIVE_STATES = ("pending", "running")
GONE_STATES = ("shutting-down", "terminated", "stopping", "stopped")
NAME_TAG = "sailor:name"

ClientFor = Callable[[str, str], Any]


def boto3_clients(endpoint_url: str | None = None, profile: str | None = None) -> ClientFor:
    """Clients from boto3's standard credential chain (env, profile, SSO, instance role)."""
    import boto3  # lazy: the core installs without the aws extra

    session = boto3.session.Session(profile_name=profile)
    cache: dict[tuple[str, str], Any] = {}

    def client_for(service: str, region: str) -> Any:
        key = (service, region)
        if key not in cache:
            kw = {"endpoint_url": endpoint_url} if endpoint_url else {}
            cache[key] = session.client(service, region_name=region, **kw)
        return cache[key]

    return client_for


def _error_code(e: Exception) -> str:
    resp = getattr(e, "response", None)
    return str((resp or {}).get("Error", {}).get("Code", "")) if isinstance(resp, dict) else ""


@dataclass
class AwsConfig:
    regions: tuple[str, ...]
    image_ids: Mapping[str, str] = field(default_factory=dict)  # region -> AMI id; else looked up by name
    image_name: str = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch * (Ubuntu 22.04) *"
    image_owner: str = "amazon"
    disk_gb: int = 200
    instance_profile: str = ""  # name of an instance profile that allows SSM and the store bucket
    zones: tuple[str, ...] = ()  # allowed zones (empty: every zone of the regions)
    max_vms_per_offering: int = 4  # cap per (zone, type, market) where no quota is readable
    # After a spot VM of a type is interrupted in a zone, that (zone, type) is not offered or used
    # for spot for this long: the cloud just showed it has no spare capacity there.
    interruption_cooldown_s: float = 900.0
    wait_delay_s: float = 5.0
    wait_attempts: int = 120

    def __post_init__(self) -> None:
        if not self.regions:
            raise ProviderError("aws provider needs at least one region; to fix: pass regions=('us-east-1', ...)")
        self.regions = tuple(self.regions)


class AwsProvider(CloudProvider[InstanceShape]):
    """EC2's calls behind infra.cloud.CloudProvider, which holds what both clouds do alike."""

    name = "aws"
    SHAPES = SHAPES
    SHAPE_KIND = "AWS instance type"
    SPOT_LOSS = "interrupted"
    config: AwsConfig

    def __init__(
        self, config: AwsConfig, *, client_for: ClientFor | None = None, prices: PriceSource,
        event_source: EventSource | None = None, clock: Callable[[], datetime] = utcnow,
    ) -> None:
        super().__init__(config, prices=prices, event_source=event_source, clock=clock)
        self._client_for = client_for or boto3_clients()
        self._region_of: dict[str, str] = {}
        self._zone_types: dict[str, dict[str, set[str]]] = {}

    # -- helpers -------------------------------------------------------------------------------
    def ec2(self, region: str) -> Any:
        return self._client_for("ec2", region)

    def _zones_offering(self, region: str) -> dict[str, set[str]]:
        """instance type -> zones of `region` offering it (cached: offerings change rarely)."""
        if region not in self._zone_types:
            out: dict[str, set[str]] = {}
            pages = self.ec2(region).get_paginator("describe_instance_type_offerings").paginate(
                LocationType="availability-zone",
                Filters=[{"Name": "instance-type", "Values": sorted(SHAPES)}],
            )
            for page in pages:
                for o in page.get("InstanceTypeOfferings", []):
                    if not self.config.zones or o["Location"] in self.config.zones:
                        out.setdefault(o["InstanceType"], set()).add(o["Location"])
            self._zone_types[region] = out
        return self._zone_types[region]

    def _quota_vcpus(self, region: str, shape: InstanceShape, market: Market) -> float | None:
        """The region's vCPU quota for the shape's class and market, None where unreadable."""
        code = QUOTA_CODES.get((shape.quota_class, market))
        if code:
            try:
                q = self._client_for("service-quotas", region).get_service_quota(ServiceCode="ec2", QuotaCode=code)
                return float(q["Quota"]["Value"])
            except Exception:  # no permission, or not served: fall back to the configured cap
                return None
        return None

    def _in_use(self, region: str) -> list[tuple[str, str, Market]]:
        """(zone, instance type, market) of every live sailor VM in the region, any run."""
        out = []
        for _, i in self._describe(None, [region]):
            if i["State"]["Name"] in LIVE_STATES:
                m = Market.SPOT if i.get("InstanceLifecycle") == "spot" else Market.ON_DEMAND
                out.append((i["Placement"]["AvailabilityZone"], i["InstanceType"], m))
        return out

    def _free_vms(self, zone: str, shape: InstanceShape, market: Market,
                  in_use: list[tuple[str, str, Market]]) -> int:
        """VMs of this shape still allowed here: quota minus our own VMs of that class, else the cap."""
        quota = self._quota_vcpus(default_region(zone), shape, market)
        if quota is not None:
            used = sum(SHAPES[t].vcpus for _, t, m in in_use
                       if m is market and t in SHAPES and SHAPES[t].quota_class == shape.quota_class)
            return max(0, int((quota - used) // shape.vcpus))
        return self._cap_left(zone, shape, market, in_use)

    def _region_capacity(self, region: str, shapes: Sequence[InstanceShape],
                         markets: Sequence[Market]) -> tuple[list[tuple[str, InstanceShape]], FreeGpus[InstanceShape]]:
        zones_of = self._zones_offering(region)
        in_use = self._in_use(region)
        places = [(zone, shape) for shape in shapes for zone in sorted(zones_of.get(shape.instance_type, ()))]
        return places, lambda zone, shape, m: self._free_vms(zone, shape, m, in_use) * shape.gpus

    def _image(self, region: str, calls: list[ApiCall] | None) -> str:
        if region in self.config.image_ids:
            return self.config.image_ids[region]
        params = {"Owners": [self.config.image_owner],
                  "Filters": [{"Name": "name", "Values": [self.config.image_name]},
                              {"Name": "state", "Values": ["available"]}]}
        if calls is not None:
            calls.append(ApiCall(service="ec2", location=region, operation="DescribeImages", params=params))
            return f"<newest image named {self.config.image_name!r}>"
        images = self.ec2(region).describe_images(**params).get("Images", [])
        if not images:
            raise ProviderError(f"no image named {self.config.image_name!r} owned by {self.config.image_owner} in "
                                f"{region}; to fix: set image_ids={{'{region}': 'ami-...'}}")
        return max(images, key=lambda i: i.get("CreationDate", ""))["ImageId"]

    def _sg_params(self, run_id: str, region: str) -> dict[str, Any]:
        return {"GroupName": f"sailor-{run_id}", "Description": f"sailor run {run_id}: rendezvous and data ports "
                                                                f"between the run's VMs only",
                "TagSpecifications": [{"ResourceType": "security-group",
                                       "Tags": [{"Key": RUN_TAG, "Value": run_id}]}]}

    @staticmethod
    def _port_ranges() -> list[tuple[int, int]]:
        return [(RENDEZVOUS_PORT, RENDEZVOUS_PORT), DATA_PORTS]

    def _security_group(self, run_id: str, region: str) -> str:
        ec2 = self.ec2(region)
        found = ec2.describe_security_groups(Filters=[{"Name": f"tag:{RUN_TAG}", "Values": [run_id]}])["SecurityGroups"]
        if found:
            return found[0]["GroupId"]
        gid = ec2.create_security_group(**self._sg_params(run_id, region))["GroupId"]
        ec2.authorize_security_group_ingress(GroupId=gid, IpPermissions=[
            {"IpProtocol": "tcp", "FromPort": lo, "ToPort": hi, "UserIdGroupPairs": [{"GroupId": gid}]}
            for lo, hi in self._port_ranges()])
        return gid

    def _run_params(self, r: VmRequest, shape: InstanceShape, zone: str, image: str, sg: str) -> dict[str, Any]:
        tags = [{"Key": RUN_TAG, "Value": r.run_id}, {"Key": NAME_TAG, "Value": r.name},
                {"Key": "Name", "Value": f"sailor-{r.run_id}-{r.name}"},
                {"Key": "sailor:gpu-type", "Value": shape.gpu_type}]
        p: dict[str, Any] = {
            "ImageId": image, "InstanceType": shape.instance_type, "MinCount": 1, "MaxCount": 1,
            "Placement": {"AvailabilityZone": zone}, "SecurityGroupIds": [sg],
            "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": {
                "VolumeSize": self.config.disk_gb, "VolumeType": "gp3", "DeleteOnTermination": True}}],
            "UserData": render_startup_script(cloud="aws",
                                              run_id=r.run_id, vm_name=r.name),
            "TagSpecifications": [{"ResourceType": "instance", "Tags": tags},
                                  {"ResourceType": "volume", "Tags": tags}],
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},  # IMDSv2 only
        }
        if self.config.instance_profile:
            p["IamInstanceProfile"] = {"Name": self.config.instance_profile}
        if r.market is Market.SPOT:
            p["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        return p

    def _candidates(self, r: VmRequest, shape: InstanceShape) -> list[str]:
        """fallback_zones over the zones offering the type, less any outside `AwsConfig.zones`."""
        out = fallback_zones(r, self.config.regions,
                             lambda reg: sorted(self._zones_offering(reg).get(shape.instance_type, ())))
        return [z for z in out if not self.config.zones or z in self.config.zones]

    def _after_launch(self, requests: Sequence[VmRequest], started: list[Vm]) -> list[Vm]:
        """Open the ports between the run's regions, then report the VMs with their addresses."""
        self._sync_security_groups(requests[0].run_id if requests else "")
        return [self._refresh(v) for v in started]

    def _dry_run_calls(self, requests: Sequence[VmRequest], shapes: Mapping[str, InstanceShape]) -> list[ApiCall]:
        calls: list[ApiCall] = []
        seen_regions: set[str] = set()
        for r in requests:
            region = r.region or default_region(r.zone)
            shape = shapes[r.name]
            if region not in seen_regions:
                seen_regions.add(region)
                calls.append(ApiCall(service="ec2", location=region, operation="CreateSecurityGroup",
                                     params=self._sg_params(r.run_id, region)))
                calls.append(ApiCall(service="ec2", location=region, operation="AuthorizeSecurityGroupIngress",
                                     params={"GroupId": f"<sailor-{r.run_id}>", "IpPermissions": [
                                         {"IpProtocol": "tcp", "FromPort": lo, "ToPort": hi,
                                          "UserIdGroupPairs": [{"GroupId": f"<sailor-{r.run_id}>"}]}
                                         for lo, hi in self._port_ranges()]}))
            image = self._image(region, calls)
            calls.append(ApiCall(service="ec2", location=region, operation="RunInstances",
                                 params=self._run_params(r, shape, r.zone, image, f"<sailor-{r.run_id}>")))
        return calls

    def _place(self, r: VmRequest, shape: InstanceShape, zone: str) -> Vm | str:
        region = default_region(zone)
        if self._free_vms(zone, shape, r.market, self._in_use(region)) < 1:
            return "SailorCapReached: quota or max_vms_per_offering used up"
        sg = self._security_group(r.run_id, region)
        params = self._run_params(r, shape, zone, self._image(region, None), sg)
        try:
            inst = self.ec2(region).run_instances(**params)["Instances"][0]
        except Exception as e:
            code = _error_code(e)
            if code not in CAPACITY_CODES:
                raise ProviderError(f"{r.name}: RunInstances in {zone} failed: {e}; to fix: check the "
                                    f"account's quotas and the request above") from e
            return code
        self._region_of[inst["InstanceId"]] = region
        return self._vm(inst, region)

    def _vm(self, inst: Mapping[str, Any], region: str) -> Vm:
        tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
        shape = SHAPES.get(inst["InstanceType"])
        market = Market.SPOT if inst.get("InstanceLifecycle") == "spot" else Market.ON_DEMAND
        state = inst["State"]["Name"]
        zone = inst["Placement"]["AvailabilityZone"]
        price = self._price(shape, zone, market) if shape is not None else 0.0
        return Vm(vm_id=inst["InstanceId"], run_id=tags.get(RUN_TAG, ""), name=tags.get(NAME_TAG, ""), zone=zone,
                  gpu_type=shape.gpu_type if shape else tags.get("sailor:gpu-type", ""),
                  gpus=shape.gpus if shape else 0, market=market,
                  address=inst.get("PublicIpAddress") or inst.get("PrivateIpAddress", ""),
                  state="running" if state in LIVE_STATES else state, usd_per_hour=price)

    def _refresh(self, vm: Vm) -> Vm:
        region = self._region_of.get(vm.vm_id, default_region(vm.zone))
        res = self.ec2(region).describe_instances(InstanceIds=[vm.vm_id])["Reservations"]
        return self._vm(res[0]["Instances"][0], region) if res else vm

    def _describe(self, run_id: str | None, regions: Sequence[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
        filters = [{"Name": f"tag:{RUN_TAG}", "Values": [run_id]}] if run_id else [
            {"Name": "tag-key", "Values": [RUN_TAG]}]
        out = []
        for region in regions or self.config.regions:
            for page in self.ec2(region).get_paginator("describe_instances").paginate(Filters=filters):
                for res in page["Reservations"]:
                    for inst in res["Instances"]:
                        self._region_of[inst["InstanceId"]] = region
                        out.append((region, inst))
        return out

    def _sync_security_groups(self, run_id: str) -> None:
        """Open the ports to the run's VMs in other regions (/32 each); close them to VMs gone."""
        if not run_id:
            return
        live = [(reg, i) for reg, i in self._describe(run_id) if i["State"]["Name"] in LIVE_STATES]
        regions = sorted({reg for reg, _ in live})
        for region in regions:
            ec2 = self.ec2(region)
            sgs = ec2.describe_security_groups(Filters=[{"Name": f"tag:{RUN_TAG}", "Values": [run_id]}])
            for sg in sgs["SecurityGroups"]:
                want = {f"{i['PublicIpAddress']}/32" for reg, i in live if reg != region and i.get("PublicIpAddress")}
                have = {rng["CidrIp"] for perm in sg.get("IpPermissions", []) for rng in perm.get("IpRanges", [])}
                add, drop = sorted(want - have), sorted(have - want)
                if add:
                    ec2.authorize_security_group_ingress(GroupId=sg["GroupId"], IpPermissions=[
                        {"IpProtocol": "tcp", "FromPort": lo, "ToPort": hi,
                         "IpRanges": [{"CidrIp": c, "Description": f"sailor {run_id}"} for c in add]}
                        for lo, hi in self._port_ranges()])
                if drop:
                    ec2.revoke_security_group_ingress(GroupId=sg["GroupId"], IpPermissions=[
                        {"IpProtocol": "tcp", "FromPort": lo, "ToPort": hi,
                         "IpRanges": [{"CidrIp": c} for c in drop]} for lo, hi in self._port_ranges()])

    def bootstrap(self, vm: Vm, assignment: WorkerAssignment) -> None:
        region = self._region_of.get(vm.vm_id, default_region(vm.zone))
        try:
            res = self.ec2(region).describe_instances(InstanceIds=[vm.vm_id])["Reservations"]
            state = res[0]["Instances"][0]["State"]["Name"] if res else "unknown"
        except Exception as e:
            raise ProviderError(f"cannot bootstrap {vm.vm_id}: {e}; to fix: provision a new VM") from e
        if state != "running":
            raise ProviderError(f"cannot bootstrap {vm.vm_id}: it is {state}; to fix: provision a new VM")
        try:
            self._client_for("ssm", region).send_command(
                InstanceIds=[vm.vm_id], DocumentName="AWS-RunShellScript",
                Comment=f"sailor run {assignment.run_id} plan v{assignment.plan_version}",
                Parameters={"commands": assignment_commands(assignment, vm.vm_id)})
        except ProviderError:
            raise
        except Exception as e:
            raise ProviderError(f"cannot send the assignment to {vm.vm_id}: {e}; to fix: give the VM an instance "
                                f"profile with AmazonSSMManagedInstanceCore (AwsConfig.instance_profile)") from e

    def list_vms(self, run_id: str | None = None) -> list[Vm]:
        return [self._vm(i, reg) for reg, i in self._describe(run_id) if i["State"]["Name"] in LIVE_STATES]

    def events(self, run_id: str, *, since: datetime | None = None) -> list[ProviderEvent]:
        now = self.clock()
        all_vms = [(reg, i) for reg, i in self._describe(run_id)]
        vms = [self._vm(i, reg) for reg, i in all_vms]
        new: list[ProviderEvent] = []
        if self.event_source is not None:
            new += self.event_source.poll(run_id, vms, since)
        for (_reg, inst), vm in zip(all_vms, vms, strict=True):
            state = inst["State"]["Name"]
            if state in GONE_STATES and vm.vm_id not in self._removed_by_us:
                reason = inst.get("StateReason", {}).get("Code", "") or inst.get("StateTransitionReason", "")
                spot = vm.market is Market.SPOT
                new.append(ProviderEvent(kind=EventKind.LOST, at=now, vm_id=vm.vm_id, zone=vm.zone,
                                         gpu_type=vm.gpu_type, market=vm.market,
                                         detail={"signal": "instance-state", "state": state, "reason": reason,
                                                 "spot": spot}))
        new += self._spot_request_notices(run_id, all_vms, now)
        new += self._price_moves(vms, lambda v: self._instance_type(v, all_vms))
        return self._record_events(run_id, new, {i["InstanceId"]: i["InstanceType"] for _, i in all_vms}, now, since)

    @staticmethod
    def _instance_type(vm: Vm, described: Sequence[tuple[str, dict[str, Any]]]) -> str:
        return next(i["InstanceType"] for _, i in described if i["InstanceId"] == vm.vm_id)

    def _spot_request_notices(self, run_id: str, described: Sequence[tuple[str, dict[str, Any]]],
                              now: datetime) -> list[ProviderEvent]:
        """Spot requests whose status says the instance is about to go (marked-for-termination/stop)."""
        out = []
        by_region: dict[str, list[dict[str, Any]]] = {}
        for reg, i in described:
            if i.get("SpotInstanceRequestId") and i["State"]["Name"] in LIVE_STATES:
                by_region.setdefault(reg, []).append(i)
        for reg, insts in by_region.items():
            try:
                reqs = self.ec2(reg).describe_spot_instance_requests(
                    SpotInstanceRequestIds=[i["SpotInstanceRequestId"] for i in insts])["SpotInstanceRequests"]
            except Exception as e:  # noqa: BLE001 - botocore's errors; the instance-state poll above still sees the loss
                _LOG.warning("spot request status in %s unreadable (%s): no early notice this poll", reg, e)
                continue
            for req in reqs:
                code = req.get("Status", {}).get("Code", "")
                if code in ("marked-for-termination", "marked-for-stop", "instance-terminated-by-price"):
                    inst = next(i for i in insts if i["SpotInstanceRequestId"] == req["SpotInstanceRequestId"])
                    vm = self._vm(inst, reg)
                    out.append(ProviderEvent(kind=EventKind.PREEMPTION, at=now, vm_id=vm.vm_id, zone=vm.zone,
                                             gpu_type=vm.gpu_type, market=vm.market,
                                             detail={"signal": "spot-request-status", "code": code}))
        return out

    def terminate(self, vm_ids: Sequence[str]) -> None:
        ids = [v for v in vm_ids if v and not v.startswith("dry-run:")]
        if not ids:
            return
        unknown = [v for v in ids if v not in self._region_of]
        if unknown:
            self._describe(None)
        by_region: dict[str, list[str]] = {}
        for v in ids:
            if v in self._region_of:
                by_region.setdefault(self._region_of[v], []).append(v)
        for region, batch in by_region.items():
            self._removed_by_us.update(batch)
            self.ec2(region).terminate_instances(InstanceIds=batch)

    def cleanup(self, run_id: str | None = None, *, dry_run: bool = False) -> list[str]:
        """Remove everything the run left (all runs if None); return the instance ids removed."""
        return [x for x in self.cleanup_resources(run_id, dry_run=dry_run) if x.startswith("i-")]

    def cleanup_resources(self, run_id: str | None = None, *, dry_run: bool = False) -> list[str]:
        """Like `cleanup`, returning every resource: instances, volumes, security groups."""
        removed: list[str] = []
        for region in self.config.regions:
            insts = [i for _, i in self._describe(run_id, [region]) if i["State"]["Name"] != "terminated"]
            ids = [i["InstanceId"] for i in insts]
            removed += ids
            ec2 = self.ec2(region)
            if ids and not dry_run:
                self._removed_by_us.update(ids)
                ec2.terminate_instances(InstanceIds=ids)
                self._wait_terminated(ec2, ids)
            tag_filter = ([{"Name": f"tag:{RUN_TAG}", "Values": [run_id]}] if run_id
                          else [{"Name": "tag-key", "Values": [RUN_TAG]}])
            vols = ec2.describe_volumes(Filters=tag_filter + [{"Name": "status", "Values": ["available"]}])["Volumes"]
            for v in vols:
                removed.append(v["VolumeId"])
                if not dry_run:
                    ec2.delete_volume(VolumeId=v["VolumeId"])
            for sg in ec2.describe_security_groups(Filters=tag_filter)["SecurityGroups"]:
                removed.append(sg["GroupId"])
                if not dry_run:
                    self._delete_group(ec2, sg["GroupId"])
        return removed

    def _wait_terminated(self, ec2: Any, ids: list[str]) -> None:
        for _ in range(self.config.wait_attempts):
            res = ec2.describe_instances(InstanceIds=ids)["Reservations"]
            if all(i["State"]["Name"] == "terminated" for r in res for i in r["Instances"]):
                return
            time.sleep(self.config.wait_delay_s)
        raise ProviderError(f"instances {ids} did not terminate in time; to fix: rerun `sailor infra cleanup`")

    def _delete_group(self, ec2: Any, group_id: str) -> None:
        # A group stays "in use" for a little while after its instances terminate.
        for attempt in range(self.config.wait_attempts):
            try:
                ec2.delete_security_group(GroupId=group_id)
                return
            except Exception as e:
                if _error_code(e) != "DependencyViolation" or attempt == self.config.wait_attempts - 1:
                    raise ProviderError(f"cannot delete security group {group_id}: {e}; to fix: rerun "
                                        f"`sailor infra cleanup` once its instances are gone") from e
                time.sleep(self.config.wait_delay_s)
