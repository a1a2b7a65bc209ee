"""Pieces the cloud providers (infra/aws, infra/gcp) share; no cloud SDK here.

Contract:
- `format_dry_run` prints a `DryRunReport` (infra/provider.py: what `provision(..., dry_run=True)`
  would send, as `ApiCall`s, and what it would cost per hour); `dry_run_text(provider, requests)`
  makes and prints one for any provider. A dry run rents nothing.
- `EventSource` is the protocol of an injectable feed of provider events for a run's VMs;
  `ScriptedEventSource` lets a test or a scenario push spot interruptions, rebalance
  recommendations and preemptions that the clouds' own APIs (moto, the local fake) cannot emit.
- `EventLog` keeps each run's events once (a VM seen terminated twice is one event) and answers
  `since` queries; `PriceWatch` turns moving quotes into PRICE_CHANGE events.
- `FallbackRecord` says where a capacity error moved a VM.
- `forbid_credentials` refuses environment handed to a VM that carries cloud credentials: VMs get
  their rights from an instance role or service account, never from copied secrets.
- `CloudProvider` is the base of AwsProvider and GcpProvider: what both do alike (offerings,
  provision with its dry run, zone fallbacks and all-or-nothing cleanup, price lookups, the spot
  cooldown, the event log) over hooks for each cloud's own calls. `choose_shape` picks a request's
  shape; `fallback_zones` orders the zones to try a VM in.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Generic, Protocol, TypeVar, runtime_checkable

from infra.catalog import PriceQuote, PriceSource, lookup
from infra.provider import ApiCall, DryRunReport, DryRunReporting, EventKind, Provider, ProviderEvent, Vm, VmRequest
from sailor_core.domain import Capacity, Market, default_region
from sailor_core.errors import CapacityError, ProviderError

RUN_TAG = "sailor:run"  # AWS tag key; GCP label key is "sailor-run" (labels allow no ':')
# Ports the job opens between its own VMs: torchrun's c10d rendezvous and the data/collective range.
RENDEZVOUS_PORT = 29400
DATA_PORTS = (29500, 29600)


class Shape(Protocol):
    """What choose_shape needs of a cloud's VM shape (AWS instance type, GCE machine shape)."""

    @property
    def instance_type(self) -> str: ...
    @property
    def gpu_type(self) -> str: ...
    @property
    def gpus(self) -> int: ...
    @property
    def vcpus(self) -> int: ...


S = TypeVar("S", bound=Shape)


def choose_shape(
    r: VmRequest,
    shapes: Mapping[str, S],
    quotes: Callable[[Sequence[str], Sequence[str], Sequence[Market]], list[PriceQuote]],
    *,
    kind: str,
) -> S:
    """The VM shape for a request: the one it names, else the cheapest shape with exactly its GPUs
    that is priced in its zone and market (what offerings() showed), else the fewest vCPUs."""
    if r.instance_type:
        shape = shapes.get(r.instance_type)
        if shape is None:
            raise ProviderError(f"{r.name}: unknown {kind} {r.instance_type!r}; to fix: use one of {sorted(shapes)}")
        return shape
    cands = sorted((s for s in shapes.values() if s.gpu_type == r.gpu_type and s.gpus == r.gpus),
                   key=lambda s: (s.vcpus, s.instance_type))
    if not cands:
        have = sorted({(s.gpu_type, s.gpus) for s in shapes.values() if s.gpu_type == r.gpu_type})
        raise ProviderError(f"{r.name}: no {kind} has {r.gpus}x {r.gpu_type}; to fix: ask for one of "
                            f"{have or sorted({s.gpu_type for s in shapes.values()})}")
    try:
        qs = quotes([s.instance_type for s in cands], [r.region or default_region(r.zone)], [r.market])
    except Exception:  # a price feed being down must not stop provisioning
        qs = []
    priced = [(q.usd_per_hour, s.vcpus, s.instance_type, s) for s in cands
              if (q := lookup(qs, instance_type=s.instance_type, zone=r.zone, market=r.market)) is not None]
    if priced:
        return min(priced, key=lambda t: t[:3])[3]
    return cands[0]


def utcnow() -> datetime:
    return datetime.now(UTC)


def dry_run_text(provider: Provider, requests: Sequence[VmRequest]) -> str:
    """What renting `requests` would send and cost, for any provider: a flow's `dry_run` prints this.

    Cloud providers list their exact API requests (`last_dry_run`); others list the VMs and cost.
    """
    vms = provider.provision(list(requests), dry_run=True)
    report = provider.last_dry_run if isinstance(provider, DryRunReporting) else None
    if report is None:
        report = DryRunReport(provider=provider.name, calls=(), vms=tuple(vms))
    return format_dry_run(report)


def format_dry_run(report: DryRunReport) -> str:
    lines = [f"dry run on {report.provider}: {len(report.calls)} API request(s), nothing rented"]
    lines += [f"  {c.render()}" for c in report.calls]
    # a price of 0 means no quote was found (the feed is down or has no such offering), never free
    unknown = [v for v in report.vms if not v.usd_per_hour > 0]
    for v in report.vms:
        price = f"${v.usd_per_hour:.4f}/h" if v.usd_per_hour > 0 else "an unknown price (no quote from the price feed)"
        lines.append(f"  vm {v.name}: {v.gpus}x {v.gpu_type} {v.market.value} in {v.zone} at {price}")
    if unknown:
        lines.append(f"hourly cost: unknown ({len(unknown)} of {len(report.vms)} VM(s) have no price quote; the others "
                     f"cost ${report.usd_per_hour:.4f}/h)")
    else:
        lines.append(f"hourly cost: ${report.usd_per_hour:.4f}/h")
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class FallbackRecord:
    name: str
    requested_zone: str
    zone: str
    reason: str


@runtime_checkable
class EventSource(Protocol):
    """A feed of events about a run's VMs (cloud notices, a metadata relay, a test script)."""

    def poll(self, run_id: str, vms: Sequence[Vm], since: datetime | None) -> list[ProviderEvent]: ...


@dataclass
class ScriptedEventSource:
    """Events pushed by a test or scenario, delivered on the next poll of their VM's run."""

    clock: Callable[[], datetime] = utcnow
    _pending: list[ProviderEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def push(self, event: ProviderEvent) -> None:
        with self._lock:
            self._pending.append(event)

    def spot_interruption(self, vm: Vm, *, action: str = "terminate", notice_s: float = 120.0) -> ProviderEvent:
        """AWS's two-minute notice (instance-action), as the VM's metadata service would show it."""
        now = self.clock()
        ev = ProviderEvent(kind=EventKind.PREEMPTION, at=now, vm_id=vm.vm_id, zone=vm.zone, gpu_type=vm.gpu_type,
                           market=vm.market, detail={"signal": "spot-instance-action", "action": action,
                                                     "notice_s": notice_s, "run_id": vm.run_id})
        self.push(ev)
        return ev

    def rebalance_recommendation(self, vm: Vm) -> ProviderEvent:
        ev = ProviderEvent(kind=EventKind.CAPACITY_CHANGE, at=self.clock(), vm_id=vm.vm_id, zone=vm.zone,
                           gpu_type=vm.gpu_type, market=vm.market,
                           detail={"signal": "rebalance-recommendation", "run_id": vm.run_id})
        self.push(ev)
        return ev

    def preemption(self, vm: Vm) -> ProviderEvent:
        ev = ProviderEvent(kind=EventKind.PREEMPTION, at=self.clock(), vm_id=vm.vm_id, zone=vm.zone,
                           gpu_type=vm.gpu_type, market=vm.market,
                           detail={"signal": "instance-preempted", "run_id": vm.run_id})
        self.push(ev)
        return ev

    def poll(self, run_id: str, vms: Sequence[Vm], since: datetime | None) -> list[ProviderEvent]:
        ids = {v.vm_id for v in vms}
        with self._lock:
            mine = [e for e in self._pending if e.detail.get("run_id") == run_id or e.vm_id in ids]
            self._pending = [e for e in self._pending if e not in mine]
        return mine


class EventLog:
    """Per-run event history; an event with the same (kind, vm, signal) is recorded once."""

    def __init__(self) -> None:
        self._events: dict[str, list[ProviderEvent]] = {}
        self._keys: dict[str, set[tuple[str, str, str]]] = {}
        self._lock = threading.Lock()

    def add(self, run_id: str, events: Iterable[ProviderEvent]) -> None:
        with self._lock:
            log = self._events.setdefault(run_id, [])
            keys = self._keys.setdefault(run_id, set())
            for e in events:
                key = (e.kind.value, e.vm_id, str(e.detail.get("signal", "")) + str(e.detail.get("key", "")))
                if e.kind is EventKind.PRICE_CHANGE or key not in keys:
                    keys.add(key)
                    log.append(e)

    def since(self, run_id: str, since: datetime | None) -> list[ProviderEvent]:
        with self._lock:
            log = list(self._events.get(run_id, []))
        return [e for e in log if since is None or e.at > since]


@dataclass
class PriceWatch:
    """Remembers the last price seen per (instance type, zone, market); reports moves as events."""

    source: PriceSource
    cloud: str
    last: dict[tuple[str, str, Market], PriceQuote] = field(default_factory=dict)

    def remember(self, quotes: Iterable[PriceQuote]) -> None:
        for q in quotes:
            self.last[(q.instance_type, q.zone or q.region, q.market)] = q

    def check(self, vms: Sequence[Vm], instance_type_of: Callable[[Vm], str]) -> list[ProviderEvent]:
        shapes = {(instance_type_of(v), v.zone, v.market, v.gpu_type, v.gpus) for v in vms}
        if not shapes:
            return []
        quotes = self.source.quotes(
            instance_types=sorted({s[0] for s in shapes}), regions=sorted({default_region(s[1]) for s in shapes}),
            markets=sorted({s[2] for s in shapes}),
        )
        out = []
        for itype, zone, market, gpu, gpus in sorted(shapes):
            q = lookup(quotes, instance_type=itype, zone=zone, market=market)
            if q is None:
                continue
            prev = self.last.get((itype, zone, market)) or self.last.get((itype, default_region(zone), market))
            self.last[(itype, zone, market)] = q
            if prev is not None and abs(prev.usd_per_hour - q.usd_per_hour) > 1e-9:
                out.append(ProviderEvent(
                    kind=EventKind.PRICE_CHANGE, at=q.fetched_at, zone=zone, gpu_type=gpu, market=market,
                    detail={"instance_type": itype, "old_usd_per_gpu_hour": prev.usd_per_hour / gpus,
                            "new_usd_per_gpu_hour": q.usd_per_hour / gpus, "source": q.source},
                ))
        return out


class CloudConfig(Protocol):
    """The settings CloudProvider reads; AwsConfig and GcpConfig have them and more."""

    regions: tuple[str, ...]
    max_vms_per_offering: int
    interruption_cooldown_s: float


FreeGpus = Callable[[str, S, Market], int]  # (zone, shape, market) -> GPUs still rentable there


def fallback_zones(
    r: VmRequest, regions: Sequence[str], zones_of: Callable[[str], Iterable[str]],
    offers: Callable[[str], bool] = lambda zone: True,
) -> list[str]:
    """Where to try a VM: its requested zone first, then the other zones of its region, then those of
    the other configured regions, each as `zones_of(region)` lists them and only where `offers(zone)`
    (asked only of zones not listed yet)."""
    region = r.region or default_region(r.zone)
    out = [r.zone]
    for reg in [region] + [x for x in regions if x != region]:
        if reg in regions:
            out += [z for z in zones_of(reg) if z not in out and offers(z)]
    return out


class CloudProvider(ABC, Generic[S]):
    """What the AWS and GCP providers do alike; a subclass adds only its cloud's API calls.

    Shared here: the state every cloud provider keeps (price watch, event log, fallbacks, the spot
    cooldown), `offerings()` (regions, GPU types and markets filtered, priced from one quote call,
    sold-out offerings kept at count 0), `provision()` (regions checked, shapes chosen, dry run, all
    or nothing), the zone-by-zone placement with its fallback records and CapacityError, and the
    end of `events()` (price moves, spot cooldowns, the per-run log).
    The hooks: `_region_capacity` (where a region offers which shapes, and how many GPUs are free),
    `_candidates` (the zones to try a VM in), `_place` (start it in one zone), `_dry_run_calls`,
    `_before_launch` / `_after_launch` (the run's network) and `terminate`.
    """

    name: str
    SHAPES: Mapping[str, S]  # the cloud's shapes by instance type
    SHAPE_KIND: str  # how an error names a shape ("AWS instance type")
    SPOT_LOSS: str  # what the cloud does to a spot VM ("interrupted", "preempted")
    config: CloudConfig

    def __init__(
        self, config: CloudConfig, *, prices: PriceSource, event_source: EventSource | None,
        clock: Callable[[], datetime],
    ) -> None:
        self.config = config
        self.prices = prices
        self.event_source = event_source
        self.clock = clock
        self.fallbacks: list[FallbackRecord] = []
        self.last_dry_run: DryRunReport | None = None
        self._log = EventLog()
        self._watch = PriceWatch(prices, self.name)
        self._blocked: dict[tuple[str, str], datetime] = {}  # (zone, instance type) -> spot unusable until
        self._removed_by_us: set[str] = set()  # VM ids we terminated: their end is not LOST

    # -- hooks ---------------------------------------------------------------------------------
    @abstractmethod
    def _region_capacity(self, region: str, shapes: Sequence[S],
                         markets: Sequence[Market]) -> tuple[list[tuple[str, S]], FreeGpus[S]]:
        """(zone, shape) pairs the region offers, in the order offerings() lists them, and the GPUs
        still rentable in one (zone, shape, market)."""

    @abstractmethod
    def _candidates(self, r: VmRequest, shape: S) -> list[str]:
        """The zones to try the VM in, in order (see fallback_zones)."""

    @abstractmethod
    def _place(self, r: VmRequest, shape: S, zone: str) -> Vm | str:
        """Start the VM in `zone`: the Vm, or why the zone has no room (a capacity code); any other
        failure raises ProviderError."""

    @abstractmethod
    def _dry_run_calls(self, requests: Sequence[VmRequest], shapes: Mapping[str, S]) -> list[ApiCall]:
        """The exact requests provision() would send, in order."""

    def _before_launch(self, requests: Sequence[VmRequest]) -> None:
        """Set up the run's network before any VM starts (default: nothing)."""

    def _after_launch(self, requests: Sequence[VmRequest], started: list[Vm]) -> list[Vm]:
        """Finish the run's network once its VMs run; returns the VMs as provision() reports them."""
        return started

    @abstractmethod
    def terminate(self, vm_ids: Sequence[str]) -> None: ...

    # -- shared --------------------------------------------------------------------------------
    def _spot_blocked(self, zone: str, instance_type: str, market: Market) -> bool:
        until = self._blocked.get((zone, instance_type))
        return market is Market.SPOT and until is not None and self.clock() < until

    def _quotes(self, types: Sequence[str], regions: Sequence[str], markets: Sequence[Market]) -> list[PriceQuote]:
        """Quotes from the price source, remembered by the price watch (its baseline for PRICE_CHANGE)."""
        qs = self.prices.quotes(instance_types=list(types), regions=list(regions), markets=list(markets))
        self._watch.remember(qs)
        return qs

    def _shape(self, r: VmRequest) -> S:
        return choose_shape(r, self.SHAPES, self._quotes, kind=self.SHAPE_KIND)

    def _price(self, shape: S, zone: str, market: Market) -> float:
        """The hourly price last quoted for this shape (asks the source once if none is known)."""
        q = self._watch.last.get((shape.instance_type, zone, market)) or \
            self._watch.last.get((shape.instance_type, default_region(zone), market))
        if q is None:
            try:
                q = lookup(self._quotes([shape.instance_type], [default_region(zone)], [market]),
                           instance_type=shape.instance_type, zone=zone, market=market)
            except Exception:  # a VM is still reported when its price feed is down
                q = None
        return q.usd_per_hour if q else 0.0

    def _cap_left(self, zone: str, shape: S, market: Market, in_use: Iterable[tuple[str, str, Market]]) -> int:
        """VMs of the shape still allowed under max_vms_per_offering, given the live (zone, type, market)s."""
        used = sum(1 for z, t, m in in_use if z == zone and t == shape.instance_type and m is market)
        return max(0, self.config.max_vms_per_offering - used)

    def offerings(
        self, *, regions: Sequence[str] | None = None, gpu_types: Sequence[str] | None = None,
        markets: Sequence[Market] | None = None,
    ) -> list[Capacity]:
        regs = [r for r in self.config.regions if not regions or r in regions]
        mks = [Market.parse(m) for m in markets] if markets else list(Market)
        shapes = [s for s in self.SHAPES.values() if not gpu_types or s.gpu_type in gpu_types]
        if not regs or not shapes:
            return []
        quotes = self._quotes([s.instance_type for s in shapes], regs, mks)
        out = []
        for region in regs:
            places, free_gpus = self._region_capacity(region, shapes, mks)
            for zone, shape in places:
                for m in mks:
                    q = lookup(quotes, instance_type=shape.instance_type, zone=zone, market=m)
                    if q is None:
                        continue
                    # Sold out (quota or cap used, or spot just interrupted) still reports its price
                    # with 0 GPUs: a caller holding VMs there needs it.
                    gpus = 0 if self._spot_blocked(zone, shape.instance_type, m) else free_gpus(zone, shape, m)
                    out.append(Capacity(
                        cloud=self.name, region=region, zone=zone, gpu_type=shape.gpu_type, market=m, gpus=gpus,
                        gpus_per_vm=shape.gpus, usd_per_gpu_hour=q.usd_per_hour / shape.gpus,
                        instance_type=shape.instance_type, price_fetched_at=q.fetched_at))
        return out

    def provision(self, requests: Sequence[VmRequest], *, dry_run: bool = False) -> list[Vm]:
        for r in requests:
            region = r.region or default_region(r.zone)
            if region not in self.config.regions:
                raise ProviderError(f"{r.name}: region {region} is not among the provider's regions "
                                    f"{list(self.config.regions)}; to fix: add it to "
                                    f"{type(self.config).__name__}.regions")
        shapes = {r.name: self._shape(r) for r in requests}
        if dry_run:
            return self._dry_run(requests, shapes)
        started: list[Vm] = []
        try:
            self._before_launch(requests)
            for r in requests:
                started.append(self._launch(r, shapes[r.name]))
            return self._after_launch(requests, started)
        except BaseException:
            self.terminate([v.vm_id for v in started])
            raise

    def _dry_run(self, requests: Sequence[VmRequest], shapes: Mapping[str, S]) -> list[Vm]:
        calls = self._dry_run_calls(requests, shapes)
        vms = [Vm(vm_id=f"dry-run:{r.name}", run_id=r.run_id, name=r.name, zone=r.zone,
                  gpu_type=shapes[r.name].gpu_type, gpus=shapes[r.name].gpus, market=r.market, state="planned",
                  usd_per_hour=self._price(shapes[r.name], r.zone, r.market)) for r in requests]
        self.last_dry_run = DryRunReport(provider=self.name, calls=tuple(calls), vms=tuple(vms))
        return vms

    def _launch(self, r: VmRequest, shape: S) -> Vm:
        """The first candidate zone that takes the VM; a zone other than the requested one is recorded
        in `fallbacks` and as a CAPACITY_CHANGE event."""
        tried: list[str] = []
        for zone in self._candidates(r, shape):
            if self._spot_blocked(zone, shape.instance_type, r.market):
                tried.append(f"{zone} (spot {self.SPOT_LOSS} there recently)")
                continue
            vm = self._place(r, shape, zone)
            if isinstance(vm, str):
                tried.append(f"{zone} ({vm})")
                continue
            if zone != r.zone:
                self.fallbacks.append(FallbackRecord(name=r.name, requested_zone=r.zone, zone=zone,
                                                     reason="; ".join(tried)))
                self._log.add(r.run_id, [ProviderEvent(
                    kind=EventKind.CAPACITY_CHANGE, at=self.clock(), vm_id=vm.vm_id, zone=r.zone,
                    gpu_type=shape.gpu_type, market=r.market,
                    detail={"signal": "capacity-fallback", "key": r.name, "requested_zone": r.zone, "zone": zone,
                            "tried": list(tried)})])
            return vm
        raise CapacityError(f"{r.name}: no capacity for {shape.instance_type} ({r.market.value}) in any allowed "
                            f"zone; tried {', '.join(tried)}; to fix: allow more regions or zones, another GPU "
                            f"type or the other market")

    def _price_moves(self, vms: Iterable[Vm], instance_type_of: Callable[[Vm], str]) -> list[ProviderEvent]:
        """PRICE_CHANGE events for the running VMs' shapes; none while the price feed is down."""
        live = [v for v in vms if v.state == "running"]
        try:
            return self._watch.check(live, instance_type_of)
        except Exception:  # a price feed being down is not an event; the last prices stay in force
            return []

    def _record_events(self, run_id: str, new: Sequence[ProviderEvent], types: Mapping[str, str],
                       now: datetime, since: datetime | None) -> list[ProviderEvent]:
        """Log `new` for the run and return the run's events after `since`. A spot VM lost or preempted
        without our asking takes its (zone, instance type from `types`) out of spot offerings and
        placement for `interruption_cooldown_s`."""
        for e in new:
            if e.kind in (EventKind.PREEMPTION, EventKind.LOST) and e.market is Market.SPOT and e.vm_id in types \
                    and e.vm_id not in self._removed_by_us:
                self._blocked[(e.zone, types[e.vm_id])] = now + timedelta(seconds=self.config.interruption_cooldown_s)
        self._log.add(run_id, new)
        return self._log.since(run_id, since)


CREDENTIAL_MARKERS = ("SECRET", "TOKEN", "PASSWORD", "CREDENTIAL", "ACCESS_KEY", "PRIVATE_KEY")


def forbid_credentials(env: Mapping[str, str], *, where: str) -> None:
    bad = sorted(k for k in env if any(m in k.upper() for m in CREDENTIAL_MARKERS))
    if bad:
        raise ProviderError(
            f"{where}: refusing to copy {bad} to a VM; to fix: give the VM an instance role (AWS) or a "
            f"service account (GCP) with the rights it needs instead of passing secrets"
        )
