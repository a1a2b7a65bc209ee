"""The GCP provider: GPU VMs on Compute Engine (standard and SPOT) in several regions.

Contract (the Provider protocol of infra/provider.py):
- What both clouds do alike (the offerings loop, zone fallbacks, dry run, spot cooldown, event log)
  is infra.cloud.CloudProvider's; this module supplies Compute Engine's calls through its hooks.
- Side effects come in through the constructor: `GceClients` (google-cloud-compute REST clients
  from google-auth's standard chain; tests point them at a local fake with anonymous
  credentials), a price source, an event source and a clock.
- `offerings()` lists, per configured region and zone, the GPU shapes of infra/gcp/machine_types.py
  whose accelerator the zone has (acceleratorTypes.list), priced per market from the price source;
  counts come from the region's GPU quotas (regions.get; PREEMPTIBLE_* for spot) where present,
  else `max_vms_per_offering`. A shape without a price is not offered; a sold-out one (quota or
  cap used, spot preempted there recently) is reported with count 0 and its price.
- `provision()` creates one firewall per run (ingress on the rendezvous and data ports, only from
  VMs carrying the run's network tag to VMs carrying it) and instances.insert per VM with the
  image, boot disk, startup script (metadata `startup-script`), attached GPUs for N1, and
  `scheduling.provisioningModel=SPOT` for spot. Instances and disks carry the label
  `sailor-run=<run>`; the original run id is in metadata `sailor-run-id`. VM ids are `zone/name`.
  ZONE_RESOURCE_POOL_EXHAUSTED (and other stockouts) moves the VM to the next zone of its region,
  then the next configured region, recorded in `fallbacks` and as a CAPACITY_CHANGE event; if a VM
  fits nowhere the VMs this call created are deleted and CapacityError lists what was tried.
  `dry_run=True` sends nothing and keeps the exact requests and the hourly cost in `last_dry_run`.
- `bootstrap()` sets metadata `sailor-assignment`, which the startup script waits for.
- `events()` reports the zone operation `compute.instances.preempted` (PREEMPTION), instances
  stopped or gone without our asking (LOST), the event source's notices and price moves. A SPOT
  preemption takes that (zone, shape) out of spot offerings and placement for
  `interruption_cooldown_s` (GCE just showed it has no spare capacity there).
- `cleanup(run_id)` deletes the run's labelled instances and its firewall; `None` means every run.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from infra.bootstrap import GCP_ASSIGNMENT_KEY, assignment_json, render_startup_script
from infra.catalog import PriceSource
from infra.cloud import (
    DATA_PORTS,
    RENDEZVOUS_PORT,
    CloudProvider,
    EventSource,
    FreeGpus,
    fallback_zones,
    utcnow,
)
from infra.gcp.machine_types import SHAPES, GceShape
from infra.provider import ApiCall, EventKind, ProviderEvent, Vm, VmRequest, WorkerAssignment
from sailor_core.domain import Market, default_region
from sailor_core.errors import ProviderError

RUN_LABEL = "sailor-run"
NAME_LABEL = "sailor-name"
RUN_ID_KEY = "sailor-run-id"
STOCKOUT_CODES = ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                  "RESOURCE_POOL_EXHAUSTED", "UNSUPPORTED_OPERATION",
                  "QUOTA_EXCEEDED",  # GPU quotas are regional: the next region may have room
                  "SAILOR_CAP_REACHED")
LIVE = ("PROVISIONING", "STAGING", "RUNNING")
GONE = ("STOPPING", "STOPPED", "SUSPENDING", "SUSPENDED", "TERMINATED")


def gce_name(text: str, max_len: int = 63) -> str:
    """A valid GCE name or label value: lowercase letters, digits, '-', starting with a letter."""
    s = re.sub(r"[^a-z0-9-]", "-", text.lower()).strip("-") or "x"
    if not s[0].isalpha():
        s = "r" + s
    if len(s) > max_len:
        s = s[: max_len - 9].rstrip("-") + "-" + hashlib.sha1(text.encode()).hexdigest()[:8]
    return s


class GceClients:
    """google-cloud-compute REST clients; `endpoint` points them elsewhere (a local fake)."""

    def __init__(self, *, endpoint: str | None = None, credentials: Any = None) -> None:
        from google.api_core.client_options import ClientOptions  # lazy: gcp extra only
        from google.cloud import compute_v1

        kw: dict[str, Any] = {"transport": "rest"}
        if endpoint:
            kw["client_options"] = ClientOptions(api_endpoint=endpoint)
            if credentials is None and re.match(r"^http://(127\.0\.0\.1|localhost)[:/]", endpoint):
                from google.auth.credentials import AnonymousCredentials

                credentials = AnonymousCredentials()
        if credentials is not None:
            kw["credentials"] = credentials
        self.compute_v1 = compute_v1
        self.instances = compute_v1.InstancesClient(**kw)
        self.zone_operations = compute_v1.ZoneOperationsClient(**kw)
        self.zones = compute_v1.ZonesClient(**kw)
        self.regions = compute_v1.RegionsClient(**kw)
        self.accelerator_types = compute_v1.AcceleratorTypesClient(**kw)
        self.firewalls = compute_v1.FirewallsClient(**kw)


@dataclass
class GcpConfig:
    project: str
    regions: tuple[str, ...]
    image: str = "projects/deeplearning-platform-release/global/images/family/common-cu124-debian-11-py310"
    disk_gb: int = 200
    network: str = "global/networks/default"
    service_account: str = "default"
    spot_termination_action: str = "STOP"  # STOP keeps the preempted VM visible until cleanup
    zones: tuple[str, ...] = ()  # allowed zones (empty: every zone of the regions)
    max_vms_per_offering: int = 4  # cap per (zone, shape, market) where the region shows no quota
    # After a SPOT VM of a shape is preempted in a zone, that (zone, shape) is not offered or used for
    # spot for this long: GCE just showed it has no spare capacity there.
    interruption_cooldown_s: float = 900.0
    op_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.project:
            raise ProviderError("gcp provider needs a project; to fix: pass project='my-project'")
        if not self.regions:
            raise ProviderError("gcp provider needs at least one region; to fix: pass regions=('us-central1',)")
        self.regions = tuple(self.regions)


def _error_codes(e: BaseException) -> list[str]:
    codes = [str(getattr(x, "code", "") or (x.get("code", "") if isinstance(x, dict) else "")) for x in
             (getattr(e, "errors", None) or [])]
    return [c for c in codes if c] or [c for c in STOCKOUT_CODES if c in str(e)]


class GcpProvider(CloudProvider[GceShape]):
    """Compute Engine's calls behind infra.cloud.CloudProvider, which holds what both clouds do alike."""

    name = "gcp"
    SHAPES = SHAPES
    SHAPE_KIND = "GCE shape"
    SPOT_LOSS = "preempted"
    config: GcpConfig

    def __init__(
        self, config: GcpConfig, *, clients: GceClients | None = None, prices: PriceSource,
        event_source: EventSource | None = None, clock: Callable[[], datetime] = utcnow,
    ) -> None:
        super().__init__(config, prices=prices, event_source=event_source, clock=clock)
        self._clients = clients
        self._zone_accels: dict[str, set[str]] = {}
        self._zones_of: dict[str, list[str]] = {}
        self._known: dict[str, dict[str, Vm]] = {}
        self._types: dict[str, str] = {}  # vm id -> instance type

    @property
    def c(self) -> GceClients:
        if self._clients is None:
            self._clients = GceClients()
        return self._clients

    @property
    def project(self) -> str:
        return self.config.project

    # -- discovery -------------------------------------------------------------------------------
    def _zones(self, region: str) -> list[str]:
        if not self._zones_of:
            for z in sorted(z.name for z in self.c.zones.list(project=self.project) if z.status == "UP"):
                if self.config.zones and z not in self.config.zones:
                    continue
                self._zones_of.setdefault(default_region(z), []).append(z)
        return self._zones_of.get(region, [])

    def _accels(self, zone: str) -> set[str]:
        if zone not in self._zone_accels:
            self._zone_accels[zone] = {a.name for a in self.c.accelerator_types.list(project=self.project, zone=zone)}
        return self._zone_accels[zone]

    def _quotas(self, region: str) -> dict[str, float]:
        try:
            reg = self.c.regions.get(project=self.project, region=region)
        except Exception:  # quotas unreadable: the configured cap applies
            return {}
        return {q.metric: q.limit - q.usage for q in reg.quotas}

    def _in_use(self, region: str) -> list[tuple[str, str, Market]]:
        """(zone, instance type, market) of every live sailor VM in the region, any run."""
        out = []
        for vid, inst in self._list(None).items():
            zone = vid.split("/", 1)[0]
            if default_region(zone) == region and inst.status in LIVE:
                vm = self._vm(inst, priced=False)
                out.append((zone, _instance_type(inst), vm.market))
        return out

    def _free_gpus(self, zone: str, shape: GceShape, market: Market, quotas: dict[str, float],
                   in_use: list[tuple[str, str, Market]]) -> int:
        """GPUs of this shape still allowed: the region's quota left (GCE counts usage), else our cap."""
        metric = shape.quota_metric(market)
        if metric in quotas:
            if shape.cpu_only:  # a vCPU quota: whole VMs of this shape, one slot each
                return int(quotas[metric] // shape.vcpus) * shape.gpus
            return int(quotas[metric]) // shape.gpus * shape.gpus
        return self._cap_left(zone, shape, market, in_use) * shape.gpus

    def _region_capacity(self, region: str, shapes: Sequence[GceShape],
                         markets: Sequence[Market]) -> tuple[list[tuple[str, GceShape]], FreeGpus[GceShape]]:
        quotas = self._quotas(region)
        in_use = self._in_use(region) if any(s.quota_metric(m) not in quotas for s in shapes for m in markets) else []
        places = [(zone, shape) for zone in self._zones(region) for shape in shapes
                  if not shape.accelerator or shape.accelerator in self._accels(zone)]
        return places, lambda zone, shape, m: max(0, self._free_gpus(zone, shape, m, quotas, in_use))

    def _tag(self, run_id: str) -> str:
        return gce_name(f"sailor-{run_id}")

    def _firewall_name(self, run_id: str) -> str:
        return gce_name(f"sailor-{run_id}-ports")

    def _firewall_body(self, run_id: str) -> dict[str, Any]:
        tag = self._tag(run_id)
        return {"name": self._firewall_name(run_id), "network": self.config.network, "direction": "INGRESS",
                "description": f"sailor run {run_id}: rendezvous and data ports between the run's VMs only",
                "allowed": [{"IPProtocol": "tcp", "ports": [str(RENDEZVOUS_PORT), f"{DATA_PORTS[0]}-{DATA_PORTS[1]}"]}],
                "sourceTags": [tag], "targetTags": [tag]}

    def _firewall(self, run_id: str) -> None:
        c = self.c
        name = self._firewall_name(run_id)
        try:
            c.firewalls.get(project=self.project, firewall=name)
            return
        except Exception as e:
            if type(e).__name__ != "NotFound":
                raise ProviderError(f"cannot read firewall {name}: {e}; to fix: check the project's "
                                    f"permissions (compute.firewalls.get)") from e
        fw = c.compute_v1.Firewall.from_json(_json(self._firewall_body(run_id)), ignore_unknown_fields=True)
        c.firewalls.insert(project=self.project, firewall_resource=fw).result(timeout=self.config.op_timeout_s)

    def _instance_body(self, r: VmRequest, shape: GceShape, zone: str) -> dict[str, Any]:
        labels = {RUN_LABEL: gce_name(r.run_id), NAME_LABEL: gce_name(r.name), "sailor-managed": "true"}
        scheduling: dict[str, Any] = {"onHostMaintenance": "TERMINATE", "automaticRestart": False}
        if r.market is Market.SPOT:
            scheduling.update(provisioningModel="SPOT",
                              instanceTerminationAction=self.config.spot_termination_action)
        else:
            scheduling["provisioningModel"] = "STANDARD"
        body: dict[str, Any] = {
            "name": gce_name(f"sailor-{r.run_id}-{r.name}"),
            "machineType": f"zones/{zone}/machineTypes/{shape.machine_type}",
            "labels": labels, "tags": {"items": [self._tag(r.run_id)]},
            "disks": [{"boot": True, "autoDelete": True, "initializeParams": {
                "sourceImage": self.config.image, "diskSizeGb": str(self.config.disk_gb), "labels": labels}}],
            "networkInterfaces": [{"network": self.config.network,
                                   "accessConfigs": [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]}],
            "scheduling": scheduling,
            "metadata": {"items": [
                {"key": "startup-script", "value": render_startup_script(
                    cloud="gcp", run_id=r.run_id, vm_name=r.name)},
                {"key": RUN_ID_KEY, "value": r.run_id}, {"key": "sailor-gpu-type", "value": shape.gpu_type}]},
            "serviceAccounts": [{"email": self.config.service_account,
                                 "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}],
        }
        if shape.attached:
            body["guestAccelerators"] = [{"acceleratorType": f"zones/{zone}/acceleratorTypes/{shape.accelerator}",
                                          "acceleratorCount": shape.gpus}]
        return body

    def _candidates(self, r: VmRequest, shape: GceShape) -> list[str]:
        """fallback_zones over the regions' zones that have the shape's accelerator."""
        return fallback_zones(r, self.config.regions, self._zones,
                              lambda z: not shape.accelerator or shape.accelerator in self._accels(z))

    def _before_launch(self, requests: Sequence[VmRequest]) -> None:
        for run_id in sorted({r.run_id for r in requests}):
            self._firewall(run_id)

    def _dry_run_calls(self, requests: Sequence[VmRequest], shapes: Mapping[str, GceShape]) -> list[ApiCall]:
        calls = [ApiCall(service="compute", location="global", operation="firewalls.insert",
                         params={"project": self.project, "firewallResource": self._firewall_body(run_id)})
                 for run_id in sorted({r.run_id for r in requests})]
        for r in requests:
            calls.append(ApiCall(service="compute", location=r.zone, operation="instances.insert",
                                 params={"project": self.project, "zone": r.zone,
                                         "instanceResource": self._instance_body(r, shapes[r.name], r.zone)}))
        return calls

    def _place(self, r: VmRequest, shape: GceShape, zone: str) -> Vm | str:
        c = self.c
        region = default_region(zone)
        quotas = self._quotas(region)
        if shape.quota_metric(r.market) not in quotas and \
                self._free_gpus(zone, shape, r.market, quotas, self._in_use(region)) < shape.gpus:
            return "SAILOR_CAP_REACHED: max_vms_per_offering used up"
        body = self._instance_body(r, shape, zone)
        inst = c.compute_v1.Instance.from_json(_json(body), ignore_unknown_fields=True)
        try:
            c.instances.insert(project=self.project, zone=zone, instance_resource=inst).result(
                timeout=self.config.op_timeout_s)
        except Exception as e:
            codes = _error_codes(e)
            if not any(code in STOCKOUT_CODES for code in codes):
                raise ProviderError(f"{r.name}: instances.insert in {zone} failed: {e}; to fix: check the "
                                    f"project's quotas and the request (see --dry-run)") from e
            return codes[0]
        vm = self._vm(c.instances.get(project=self.project, zone=zone, instance=body["name"]))
        self._known.setdefault(r.run_id, {})[vm.vm_id] = vm
        self._types[vm.vm_id] = shape.instance_type
        return vm

    def _vm(self, inst: Any, *, priced: bool = True) -> Vm:
        zone = inst.zone.rsplit("/", 1)[-1]
        meta = {i.key: i.value for i in inst.metadata.items}
        shape = SHAPES.get(_instance_type(inst))
        spot = inst.scheduling.provisioning_model == "SPOT"
        market = Market.SPOT if spot else Market.ON_DEMAND
        nic = inst.network_interfaces[0] if inst.network_interfaces else None
        return Vm(vm_id=f"{zone}/{inst.name}", run_id=meta.get(RUN_ID_KEY, inst.labels.get(RUN_LABEL, "")),
                  name=inst.labels.get(NAME_LABEL, inst.name), zone=zone,
                  gpu_type=shape.gpu_type if shape else meta.get("sailor-gpu-type", ""),
                  gpus=shape.gpus if shape else 0, market=market, address=nic.network_i_p if nic else "",
                  state="running" if inst.status in LIVE else inst.status.lower(),
                  usd_per_hour=self._price(shape, zone, market) if shape and priced else 0.0)

    def _instance_type(self, vm: Vm, raw: dict[str, Any]) -> str:
        return _instance_type(raw[vm.vm_id])

    def _list(self, run_id: str | None) -> dict[str, Any]:
        flt = f'labels.{RUN_LABEL} = "{gce_name(run_id)}"' if run_id else 'labels.sailor-managed = "true"'
        out = {}
        req = self.c.compute_v1.AggregatedListInstancesRequest(project=self.project, filter=flt)
        for zone_key, scoped in self.c.instances.aggregated_list(request=req):
            for inst in scoped.instances:
                out[f"{zone_key.rsplit('/', 1)[-1]}/{inst.name}"] = inst
        return out

    def bootstrap(self, vm: Vm, assignment: WorkerAssignment) -> None:
        zone, name = vm.vm_id.split("/", 1)
        value = assignment_json(assignment, vm.vm_id)
        c = self.c
        try:
            inst = c.instances.get(project=self.project, zone=zone, instance=name)
            if inst.status not in LIVE:
                raise ProviderError(f"it is {inst.status}")
            items = [i for i in inst.metadata.items if i.key != GCP_ASSIGNMENT_KEY]
            items.append(c.compute_v1.Items(key=GCP_ASSIGNMENT_KEY, value=value))
            md = c.compute_v1.Metadata(fingerprint=inst.metadata.fingerprint, items=items)
            c.instances.set_metadata(project=self.project, zone=zone, instance=name,
                                     metadata_resource=md).result(timeout=self.config.op_timeout_s)
        except Exception as e:
            raise ProviderError(f"cannot set the assignment on {vm.vm_id}: {e}; to fix: check that the VM "
                                f"exists and the caller may call compute.instances.setMetadata") from e

    def list_vms(self, run_id: str | None = None) -> list[Vm]:
        return [self._vm(i) for i in self._list(run_id).values() if i.status in LIVE]

    def events(self, run_id: str, *, since: datetime | None = None) -> list[ProviderEvent]:
        now = self.clock()
        raw = self._list(run_id)
        vms = {vid: self._vm(i) for vid, i in raw.items()}
        self._types.update({vid: _instance_type(i) for vid, i in raw.items()})
        known = self._known.setdefault(run_id, {})
        known.update(vms)
        new: list[ProviderEvent] = []
        if self.event_source is not None:
            new += self.event_source.poll(run_id, list(vms.values()), since)
        by_link = {i.self_link.rsplit("/compute/v1/", 1)[-1]: vid for vid, i in raw.items()}
        for zone in sorted({vm.zone for vm in known.values()}):
            ops = self.c.zone_operations.list(request=self.c.compute_v1.ListZoneOperationsRequest(
                project=self.project, zone=zone, filter='operationType = "compute.instances.preempted"'))
            for op in ops:
                target = op.target_link.rsplit("/compute/v1/", 1)[-1]
                vid = by_link.get(target) or f"{zone}/{target.rsplit('/', 1)[-1]}"
                vm = known.get(vid)
                if vm is None:
                    continue
                new.append(ProviderEvent(kind=EventKind.PREEMPTION, at=now, vm_id=vid, zone=vm.zone,
                                         gpu_type=vm.gpu_type, market=vm.market,
                                         detail={"signal": "instance-preempted", "operation": op.name,
                                                 "operation_time": op.insert_time}))
        for vid, vm in known.items():
            if vid in self._removed_by_us:
                continue
            inst = raw.get(vid)
            if inst is None or inst.status in GONE:
                new.append(ProviderEvent(kind=EventKind.LOST, at=now, vm_id=vid, zone=vm.zone, gpu_type=vm.gpu_type,
                                         market=vm.market, detail={"signal": "instance-state",
                                                                   "state": inst.status if inst else "DELETED"}))
        new += self._price_moves(vms.values(), lambda v: self._instance_type(v, raw))
        return self._record_events(run_id, new, self._types, now, since)

    def terminate(self, vm_ids: Sequence[str]) -> None:
        c = self.c
        ops = []
        for vid in vm_ids:
            if not vid or vid.startswith("dry-run:") or "/" not in vid:
                continue
            zone, name = vid.split("/", 1)
            self._removed_by_us.add(vid)
            try:
                ops.append(c.instances.delete(project=self.project, zone=zone, instance=name))
            except Exception as e:
                if type(e).__name__ != "NotFound":
                    raise ProviderError(f"cannot delete {vid}: {e}; to fix: rerun `sailor infra cleanup`") from e
        for op in ops:
            op.result(timeout=self.config.op_timeout_s)

    def cleanup(self, run_id: str | None = None, *, dry_run: bool = False) -> list[str]:
        """Remove everything the run left (all runs if None); return the VM ids removed."""
        return [x for x in self.cleanup_resources(run_id, dry_run=dry_run) if not x.startswith("firewall/")]

    def cleanup_resources(self, run_id: str | None = None, *, dry_run: bool = False) -> list[str]:
        """Like `cleanup`, returning every resource: VMs (`zone/name`) and `firewall/NAME`."""
        removed = sorted(self._list(run_id))
        if not dry_run:
            self.terminate(removed)
        c = self.c
        want = self._firewall_name(run_id) if run_id else None
        for fw in c.firewalls.list(project=self.project):
            ours = fw.name == want if want else (fw.name.startswith("sailor-") and fw.name.endswith("-ports")
                                                  and fw.description.startswith("sailor run "))
            if ours:
                removed.append(f"firewall/{fw.name}")
                if not dry_run:
                    c.firewalls.delete(project=self.project, firewall=fw.name).result(timeout=self.config.op_timeout_s)
        return removed


def _instance_type(inst: Any) -> str:
    mt = inst.machine_type.rsplit("/", 1)[-1]
    accs = list(inst.guest_accelerators)
    return f"{mt}+{accs[0].accelerator_type.rsplit('/', 1)[-1]}:{accs[0].accelerator_count}" if accs else mt


def _json(obj: Any) -> str:

    return json.dumps(obj)
