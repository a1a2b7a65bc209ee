"""Scenario files: what the local provider offers, how its zones are linked, which events it scripts.

Contract: `load_scenario(path)` / `parse_scenario(dict)` return a validated, frozen `Scenario` or
raise `ScenarioError` listing every problem with its location and how to fix it. Pure data: the
local provider applies the events (infra/local.py) and the testbed builds the network (infra/testbed.py).

Two forms. The short one (scenarios/demo.yaml) is one zone `local` of 1-device `cpu` VMs:

    offerings:                       # default: 4 on-demand cpu VMs
      - {market: spot, count: 4, usd_per_gpu_hour: 0.10}
      - {market: on-demand, count: 4, usd_per_gpu_hour: 0.30}

The testbed form (scenarios/geo.yaml) has regions of zones, device types and links:

    device_types:                    # a device's speed: the CPU cores one device may use (cpu cgroup quota);
      cpu-fast: {cpu_per_device: 0.5}   # memory_gib: what the planner may fill per device (default 8)
      cpu-slow: {cpu_per_device: 0.25, memory_gib: 4}
    regions:
      eu:                            # region -> zone -> offerings
        eu-west:
          - {device_type: cpu-fast, devices_per_vm: 2, market: on-demand, count: 1, usd_per_gpu_hour: 0.40}
        eu-north:
          - {device_type: cpu-slow, devices_per_vm: 1, market: spot, count: 2, usd_per_gpu_hour: 0.05}
      us:
        us-east:
          - {device_type: cpu-slow, devices_per_vm: 1, market: spot, count: 1, usd_per_gpu_hour: 0.04}
    links:                           # Gbit/s into a VM from another VM, per zone pair (both directions)
      same_zone_gbps: 2.0            # defaults per class of pair (these values when omitted)
      same_region_gbps: 0.5
      cross_region_gbps: 0.1
      pairs:                         # overrides for one zone pair
        - {zones: [eu-west, us-east], gbps: 0.05}
    cpu_budget_cores: 2              # the quotas of every offered VM together must fit (default 2)

An offering's `count` is a number of VMs (each with `devices_per_vm` devices: 1, 2 or 4); its price
is per device and hour. Parsed, an offering is a `Capacity` (sailor_core/domain.py): `vms` VMs of
`gpus_per_vm` devices, `gpus` their product. A (zone, device type, market) appears once. Latency is
not part of the format: this machine's kernel has no netem, so only bandwidth is emulated
(docs/orchestration.md).

    events:                          # each fires once, when its trigger is reached
      - {at_step: 8, kind: preemption, market: spot, zone: eu-north}   # the newest matching VM (no market,
                                                                       # zone: the newest VM of the run; or vm: N)
      - {at_step: 16, kind: price_change, market: spot, usd_per_gpu_hour: 0.6}   # every matching offering
      - {at_s: 40, kind: capacity_change, zone: eu-north, market: spot, count: 2}   # exactly one offering

`zone` and `device_type` narrow which offerings (or VMs) an event concerns; `market` is required
except for a preemption by `vm`. A `capacity_change` sets the offering's VM count: lower takes
capacity away, higher makes it return (e.g. spot VMs back after a preemption). `at_step` counts
training steps of the run (the highest step any worker reported); `at_s` counts seconds since the
run's first VM was provisioned. When a run trains past several `at_step` triggers between two
looks of the flow, the provider hands out one step's events per look, in step order, so each is a
change of its own. A preemption sends the VM's worker a notice (SIGUSR1), waits
`grace_s` (default 2), then kills it; the VM's capacity is gone with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sailor_core.domain import Capacity, Market
from sailor_core.errors import ScenarioError as ScenarioError  # re-exported: tests import it from here
from sailor_core.errors import ValidationError
from sailor_core.files import check_name, parse_yaml, read_text, shown, shown_path

GPU_TYPE = "cpu"
ZONE = "local"
REGION = "local"
CLOUD = "local"
EVENT_KINDS = ("preemption", "price_change", "capacity_change")
# `demo:` says what job `sailor demo --scenario FILE` trains on this cluster (its flags still win).
DEMO_KEYS: dict[str, Any] = {"model": str, "global_batch_size": int, "steps": int, "workers": int,
                             "objective": str, "max_usd_per_hour": (int, float)}
DEVICES_PER_VM = (1, 2, 4)
DEFAULT_LINKS_GBPS = {"same_zone_gbps": 2.0, "same_region_gbps": 0.5, "cross_region_gbps": 0.1}
DEFAULT_CPU_BUDGET_CORES = 2.0
# Limits (docs/formats.md, "Limits"): a scenario runs on this machine, so far below these.
MAX_SCENARIO_BYTES = 256 << 10
MAX_VMS = 253  # VMs of one offering (the testbed's most per zone)
MAX_NUMBER = 1e6  # any other number of a scenario (prices, cores, GiB, Gbit/s, seconds are far below)
MAX_STEP = 10**12
MAX_PROBLEMS = 20
_FIX = "to fix: see scenarios/demo.yaml (one zone) or scenarios/geo.yaml (zones, device types, links)"


DEFAULT_MEMORY_GIB = 8.0  # the catalog's `cpu` type (sailor_core/catalog.py)


@dataclass(frozen=True, kw_only=True)
class DeviceType:
    """A device type of the testbed; `cpu_per_device` cores per device (None: no quota), its memory."""

    name: str
    cpu_per_device: float | None = None
    memory_gib: float = DEFAULT_MEMORY_GIB


@dataclass(frozen=True, kw_only=True)
class Links:
    """Bandwidth between zones, Gbit/s per direction; `pairs` maps a sorted zone pair to an override."""

    same_zone_gbps: float = DEFAULT_LINKS_GBPS["same_zone_gbps"]
    same_region_gbps: float = DEFAULT_LINKS_GBPS["same_region_gbps"]
    cross_region_gbps: float = DEFAULT_LINKS_GBPS["cross_region_gbps"]
    pairs: tuple[tuple[str, str, float], ...] = ()


@dataclass(frozen=True, kw_only=True)
class ScenarioEvent:
    index: int
    kind: str
    at_step: int | None = None
    at_s: float | None = None
    market: Market | None = None
    zone: str | None = None
    gpu_type: str | None = None
    vm: int | None = None
    usd_per_gpu_hour: float | None = None
    vms: int | None = None  # a capacity_change's new VM count (the file's `count`)
    grace_s: float = 2.0

    def due(self, *, step: int, elapsed_s: float) -> bool:
        if self.at_step is not None:
            return step >= self.at_step
        assert self.at_s is not None
        return elapsed_s >= self.at_s

    def matches(self, offering: Capacity) -> bool:
        """Does this event concern that offering (its zone, device type and market filters)?"""
        return ((self.market is None or offering.market == self.market)
                and (self.zone is None or offering.zone == self.zone)
                and (self.gpu_type is None or offering.gpu_type == self.gpu_type))


@dataclass(frozen=True, kw_only=True)
class Scenario:
    offerings: tuple[Capacity, ...]
    events: tuple[ScenarioEvent, ...] = ()
    name: str = ""
    device_types: tuple[DeviceType, ...] = (DeviceType(name=GPU_TYPE),)
    links: Links = field(default_factory=Links)
    cpu_budget_cores: float = DEFAULT_CPU_BUDGET_CORES
    demo: dict[str, Any] = field(default_factory=dict)  # the job `sailor demo` runs here (its defaults)

    @property
    def zones(self) -> tuple[tuple[str, str], ...]:
        """(zone, region) in the order the file lists them."""
        seen: dict[str, str] = {}
        for o in self.offerings:
            seen.setdefault(o.zone, o.region)
        return tuple(seen.items())

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r for _, r in self.zones))

    def region_of(self, zone: str) -> str:
        return dict(self.zones)[zone]

    def device_type(self, name: str) -> DeviceType:
        for d in self.device_types:
            if d.name == name:
                return d
        return DeviceType(name=name)

    def link_gbps(self, zone_a: str, zone_b: str) -> float:
        """Bandwidth between a VM in `zone_a` and one in `zone_b` (either direction), Gbit/s."""
        pair = tuple(sorted((zone_a, zone_b)))
        for a, b, gbps in self.links.pairs:
            if (a, b) == pair:
                return gbps
        if zone_a == zone_b:
            return self.links.same_zone_gbps
        zones = dict(self.zones)
        if zones.get(zone_a) is not None and zones.get(zone_a) == zones.get(zone_b):
            return self.links.same_region_gbps
        return self.links.cross_region_gbps

    def offering(self, key: str) -> Capacity:
        for o in self.offerings:
            if o.key == key:
                return o
        raise KeyError(key)


def local_offering(*, market: Market, vms: int, usd_per_gpu_hour: float, gpu_type: str = GPU_TYPE,
                   zone: str = ZONE, region: str = REGION, gpus_per_vm: int = 1) -> Capacity:
    """One scenario offering: `vms` VMs of `gpus_per_vm` devices (the one-zone form's defaults)."""
    return Capacity(zone=zone, region=region, gpu_type=gpu_type, market=market, gpus=vms * gpus_per_vm,
                    gpus_per_vm=gpus_per_vm, usd_per_gpu_hour=usd_per_gpu_hour, cloud=CLOUD)


DEFAULT_OFFERINGS = (local_offering(market=Market.ON_DEMAND, vms=4, usd_per_gpu_hour=0.20),)


def default_scenario(slots: int = 4, usd_per_gpu_hour: float = 0.20) -> Scenario:
    return Scenario(
        offerings=(local_offering(market=Market.ON_DEMAND, vms=slots, usd_per_gpu_hour=usd_per_gpu_hour),),
        name="default",
    )


def load_scenario(path: str | Path) -> Scenario:
    """The scenario in the file at `path`, read within `MAX_SCENARIO_BYTES` as YAML without aliases, duplicate
    keys or non-finite numbers (sailor_core/files.py); every problem is one `ScenarioError`."""
    p = Path(path)
    text = read_text(p, max_bytes=MAX_SCENARIO_BYTES, what="scenario file", error=ScenarioError)
    raw = parse_yaml(text, source=f"scenario file {shown_path(p)}", error=ScenarioError)
    return parse_scenario(raw or {}, name=p.stem)


def _num(d: dict[str, Any], key: str, where: str, errors: list[str], *, integer: bool = False,
         minimum: float = 0.0, positive: bool = False, maximum: float = MAX_NUMBER) -> Any:
    if key not in d or d[key] is None:
        return None
    v = d[key]
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if isinstance(v, bool) or not ok or not minimum <= v <= maximum or (positive and v <= 0):
        kind = "an integer" if integer else "a number"
        bound = "> 0" if positive else f">= {minimum:g}"
        errors.append(f"{where}.{key}: must be {kind} {bound} and at most {maximum:g}, got {shown(v)}")
        return None
    return v


def _unknown(d: dict[str, Any], allowed: set[str], where: str, errors: list[str]) -> None:
    extra = set(d) - allowed
    if extra:
        errors.append(f"{where}: unknown keys {shown(sorted(map(str, extra)))} (allowed: {', '.join(sorted(allowed))})")


_OFFERING_KEYS = {"market", "count", "usd_per_gpu_hour", "device_type", "devices_per_vm"}


def _offering(o: Any, where: str, zone: str, region: str, testbed: bool, errors: list[str]) -> Capacity | None:
    if not isinstance(o, dict):
        errors.append(f"{where}: must be a mapping, got {shown(o)}")
        return None
    _unknown(o, _OFFERING_KEYS if testbed else _OFFERING_KEYS - {"device_type", "devices_per_vm"}, where, errors)
    try:
        market = Market.parse(o.get("market", "on-demand"))
    except ValidationError as e:
        errors.append(f"{where}.market: {e}")
        return None
    count = _num(o, "count", where, errors, integer=True, maximum=MAX_VMS)
    price = _num(o, "usd_per_gpu_hour", where, errors)
    devices = _num(o, "devices_per_vm", where, errors, integer=True) if testbed else None
    if devices is not None and devices not in DEVICES_PER_VM:
        errors.append(f"{where}.devices_per_vm: must be one of {', '.join(map(str, DEVICES_PER_VM))}, got {devices}")
        return None
    gpu_type = check_name(o.get("device_type", GPU_TYPE), f"{where}.device_type", errors)
    if gpu_type is None:
        return None
    if count is None or price is None:
        if "count" not in o or "usd_per_gpu_hour" not in o:
            errors.append(f"{where}: needs count and usd_per_gpu_hour")
        return None
    return local_offering(market=market, vms=count, usd_per_gpu_hour=float(price), gpu_type=gpu_type, zone=zone,
                          region=region, gpus_per_vm=devices or 1)


def _device_types(raw: Any, errors: list[str]) -> tuple[DeviceType, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        errors.append(f"device_types: must be a mapping of name -> {{cpu_per_device: CORES}}, got {shown(raw)}")
        return ()
    out = []
    for key, spec in raw.items():
        name = check_name(key, "device_types: a name", errors)
        where = f"device_types.{name}"
        if name is None:
            continue
        if not isinstance(spec, dict):
            errors.append(f"{where}: must be a mapping like {{cpu_per_device: 0.5}}, got {shown(spec)}")
            continue
        _unknown(spec, {"cpu_per_device", "memory_gib"}, where, errors)
        cpu = _num(spec, "cpu_per_device", where, errors, positive=True)
        mem = _num(spec, "memory_gib", where, errors, positive=True)
        if "cpu_per_device" not in spec:
            errors.append(f"{where}: needs cpu_per_device (the cores one device may use, e.g. 0.5)")
        out.append(DeviceType(name=str(name), cpu_per_device=None if cpu is None else float(cpu),
                              memory_gib=DEFAULT_MEMORY_GIB if mem is None else float(mem)))
    return tuple(out)


def _links(raw: Any, zones: dict[str, str], errors: list[str]) -> Links:
    if raw is None:
        return Links()
    if not isinstance(raw, dict):
        errors.append(
            f"links: must be a mapping (same_zone_gbps, same_region_gbps, cross_region_gbps, pairs), got {shown(raw)}"
        )
        return Links()
    _unknown(raw, {*DEFAULT_LINKS_GBPS, "pairs"}, "links", errors)
    rates = {}
    for key, default in DEFAULT_LINKS_GBPS.items():
        v = _num(raw, key, "links", errors, positive=True)
        rates[key] = default if v is None else float(v)
    pairs: list[tuple[str, str, float]] = []
    for i, p in enumerate(raw.get("pairs") or []):
        where = f"links.pairs[{i}]"
        if not isinstance(p, dict):
            errors.append(f"{where}: must be a mapping like {{zones: [A, B], gbps: 0.1}}, got {shown(p)}")
            continue
        _unknown(p, {"zones", "gbps"}, where, errors)
        gbps = _num(p, "gbps", where, errors, positive=True)
        zs = p.get("zones")
        if not (isinstance(zs, list) and len(zs) == 2 and all(isinstance(z, str) for z in zs)):
            errors.append(f"{where}.zones: must be two zone names, got {shown(zs)}")
            continue
        missing = [z for z in zs if z not in zones]
        if missing:
            errors.append(f"{where}.zones: {', '.join(missing)} not among the zones ({', '.join(zones) or 'none'})")
            continue
        if gbps is None:
            if "gbps" not in p:
                errors.append(f"{where}: needs gbps")
            continue
        a, b = sorted(zs)
        if any((x, y) == (a, b) for x, y, _ in pairs):
            errors.append(f"{where}: zones {a}, {b} listed twice")
            continue
        pairs.append((a, b, float(gbps)))
    return Links(**rates, pairs=tuple(pairs))


def _regions(raw: Any, errors: list[str]) -> list[Capacity]:
    if not isinstance(raw, dict) or not raw:
        errors.append(f"regions: must be a mapping region -> zone -> list of offerings, got {shown(raw)}")
        return []
    out: list[Capacity] = []
    seen_zones: dict[str, str] = {}
    for region_key, zones in raw.items():
        region = check_name(region_key, "regions: a region", errors)
        if region is None:
            continue
        if not isinstance(zones, dict) or not zones:
            errors.append(f"regions.{region}: must be a mapping zone -> list of offerings, got {shown(zones)}")
            continue
        for zone_key, offers in zones.items():
            zone = check_name(zone_key, f"regions.{region}: a zone", errors)
            if zone is None:
                continue
            where = f"regions.{region}.{zone}"
            if zone in seen_zones:
                errors.append(f"{where}: zone {zone} is already in region {seen_zones[zone]}; zone names are unique")
                continue
            seen_zones[str(zone)] = str(region)
            if not isinstance(offers, list) or not offers:
                errors.append(f"{where}: must be a non-empty list of offerings, got {shown(offers)}")
                continue
            for i, o in enumerate(offers):
                off = _offering(o, f"{where}[{i}]", str(zone), str(region), True, errors)
                if off is not None:
                    out.append(off)
    return out


def _event(
    e: Any, where: str, index: int, offerings: list[Capacity], errors: list[str]
) -> ScenarioEvent | None:
    if not isinstance(e, dict):
        errors.append(f"{where}: must be a mapping, got {shown(e)}")
        return None
    _unknown(e, {"at_step", "at_s", "kind", "market", "zone", "device_type", "vm", "usd_per_gpu_hour", "count",
                 "grace_s"}, where, errors)
    kind = e.get("kind")
    if kind not in EVENT_KINDS:
        errors.append(f"{where}.kind: must be one of {', '.join(EVENT_KINDS)}, got {shown(kind)}")
        return None
    at_step = _num(e, "at_step", where, errors, integer=True, maximum=MAX_STEP)
    at_s = _num(e, "at_s", where, errors)
    if (at_step is None) == (at_s is None):
        errors.append(f"{where}: give exactly one trigger, at_step or at_s")
        return None
    market = None
    if e.get("market") is not None:
        try:
            market = Market.parse(e["market"])
        except ValidationError as err:
            errors.append(f"{where}.market: {err}")
            return None
    vm = _num(e, "vm", where, errors, integer=True)
    price = _num(e, "usd_per_gpu_hour", where, errors)
    count = _num(e, "count", where, errors, integer=True, maximum=MAX_VMS)
    grace = _num(e, "grace_s", where, errors)
    zone, gpu_type = (check_name(e[k], f"{where}.{k}", errors) if e.get(k) is not None else None
                      for k in ("zone", "device_type"))
    if kind == "price_change" and (market is None or price is None):
        errors.append(f"{where}: a price_change needs market and usd_per_gpu_hour")
        return None
    if kind == "capacity_change" and (market is None or count is None):
        errors.append(f"{where}: a capacity_change needs market and count")
        return None
    ev = ScenarioEvent(
        index=index, kind=kind, at_step=at_step, at_s=at_s, market=market, zone=zone, gpu_type=gpu_type, vm=vm,
        usd_per_gpu_hour=None if price is None else float(price), vms=count,
        grace_s=2.0 if grace is None else float(grace),
    )
    if market is not None or zone is not None or gpu_type is not None:
        hits = [o for o in offerings if ev.matches(o)]
        if not hits and offerings:
            wanted = ", ".join(f"{k} {v}" for k, v in (("zone", zone), ("device_type", gpu_type),
                                                      ("market", market.value if market else None)) if v)
            have = ", ".join(o.key for o in offerings)
            errors.append(f"{where}: no offering with {wanted} (offerings: {have})")
            return None
        if kind == "capacity_change" and len(hits) > 1:
            errors.append(f"{where}: a capacity_change must name exactly one offering, {len(hits)} match "
                          f"({', '.join(o.key for o in hits)}); add zone and device_type")
            return None
    return ev


def parse_scenario(raw: dict[str, Any], *, name: str = "") -> Scenario:
    errors: list[str] = []
    if not isinstance(raw, dict):
        raise ScenarioError(f"a scenario must be a mapping with 'offerings' (or 'regions') and 'events'; {_FIX}")
    _unknown(raw, {"offerings", "events", "name", "regions", "device_types", "links", "cpu_budget_cores", "demo"},
             "scenario", errors)
    demo = raw.get("demo") or {}
    if not isinstance(demo, dict):
        errors.append("demo: must be a mapping such as {global_batch_size: 1, steps: 40}")
        demo = {}
    _unknown(demo, set(DEMO_KEYS), "demo", errors)
    for key, kind in DEMO_KEYS.items():
        if key in demo and not isinstance(demo[key], kind):
            errors.append(f"demo.{key}: must be {getattr(kind, '__name__', 'a number')}, got {shown(demo[key])}")
    testbed = "regions" in raw
    offerings: list[Capacity] = []
    if testbed:
        if raw.get("offerings"):
            errors.append("scenario: give either offerings (one local zone) or regions (zones), not both")
        offerings = _regions(raw["regions"], errors)
    else:
        for key in ("device_types", "links"):
            if key in raw:
                errors.append(f"{key}: only with regions (the testbed form); move the offerings under regions")
        for i, o in enumerate(raw.get("offerings") or []):
            off = _offering(o, f"offerings[{i}]", ZONE, REGION, False, errors)
            if off is not None:
                offerings.append(off)
    seen: set[str] = set()
    for o in offerings:
        if o.key in seen:
            where = "offerings" if not testbed else f"regions.{o.region}.{o.zone}"
            errors.append(f"{where}: {o.gpu_type} on {o.market.value} listed twice in zone {o.zone}; merge the counts")
        seen.add(o.key)
    device_types = _device_types(raw.get("device_types"), errors) if testbed else ()
    known = {d.name for d in device_types}
    if testbed:
        for o in offerings:
            if o.gpu_type not in known:
                errors.append(f"regions.{o.region}.{o.zone}: device_type {o.gpu_type!r} is not under device_types "
                              f"({', '.join(sorted(known)) or 'none'})")
    zones = {o.zone: o.region for o in offerings}
    links = _links(raw.get("links"), zones, errors) if testbed else Links()
    budget = _num(raw, "cpu_budget_cores", "scenario", errors, positive=True)
    budget = DEFAULT_CPU_BUDGET_CORES if budget is None else float(budget)
    quota = {d.name: d.cpu_per_device for d in device_types}
    total = sum(o.gpus * (quota.get(o.gpu_type) or 0.0) for o in offerings)
    if total > budget + 1e-9:
        errors.append(f"device quotas: all offered VMs together may use {total:g} cores, more than cpu_budget_cores "
                      f"{budget:g} (VMs running at once would contend and a device type's speed would be whatever "
                      f"the scheduler gives it); lower counts or cpu_per_device")
    events: list[ScenarioEvent] = []
    for i, e in enumerate(raw.get("events") or []):
        ev = _event(e, f"events[{i}]", i, offerings, errors)
        if ev is not None:
            events.append(ev)
    if errors:
        more = f"; and {len(errors) - MAX_PROBLEMS} more problem(s)" if len(errors) > MAX_PROBLEMS else ""
        raise ScenarioError("invalid scenario: " + "; ".join(errors[:MAX_PROBLEMS]) + more + f"; {_FIX}")
    return Scenario(
        offerings=tuple(offerings) or DEFAULT_OFFERINGS, events=tuple(events), name=str(raw.get("name") or name),
        device_types=device_types or (DeviceType(name=GPU_TYPE),), links=links, cpu_budget_cores=budget,
        demo=dict(demo),
    )
