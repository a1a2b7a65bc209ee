"""Pieces the cloud providers (infra/aws, infra/gcp) share; no cloud SDK here.

Contract:
- `ApiCall` is one request a provider would send (service, region or zone, operation, exact
  parameters); `DryRunReport` is what `provision(..., dry_run=True)` would send and what it would
  cost per hour; `format_dry_run` prints it, `dry_run_text(provider, requests)` does both for any
  provider. A dry run rents nothing.
- `EventSource` is the protocol of an injectable feed of provider events for a run's VMs;
  `ScriptedEventSource` lets a test or a scenario push spot interruptions, rebalance
  recommendations and preemptions that the clouds' own APIs (moto, the local fake) cannot emit.
- `EventLog` keeps each run's events once (a VM seen terminated twice is one event) and answers
  `since` queries; `PriceWatch` turns moving quotes into PRICE_CHANGE events.
- `FallbackRecord` says where a capacity error moved a VM.
- `forbid_credentials` refuses environment handed to a VM that carries cloud credentials: VMs get
  their rights from an instance role or service account, never from copied secrets.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar, runtime_checkable

from infra.catalog import PriceQuote, PriceSource, lookup
from infra.provider import EventKind, ProviderError, ProviderEvent, Vm, VmRequest
from sailor_core.domain import Market, default_region

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
    r: VmRequest, shapes: Mapping[str, S], quotes: Callable[[Sequence[str], Sequence[str], Sequence[Market]], list[PriceQuote]],
    *, kind: str,
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


@dataclass(frozen=True, kw_only=True)
class ApiCall:
    service: str
    location: str  # region or zone the call goes to
    operation: str
    params: Mapping[str, Any]

    def render(self) -> str:
        return f"{self.service}.{self.operation} [{self.location}] {json.dumps(self.params, sort_keys=True, default=str)}"


@dataclass(frozen=True, kw_only=True)
class DryRunReport:
    provider: str
    calls: tuple[ApiCall, ...]
    vms: tuple[Vm, ...]

    @property
    def usd_per_hour(self) -> float:
        return sum(v.usd_per_hour for v in self.vms)


def dry_run_text(provider: Any, requests: Sequence[Any]) -> str:
    """What renting `requests` would send and cost, for any provider: a flow's `dry_run` prints this.

    Cloud providers list their exact API requests (`last_dry_run`); others list the VMs and cost.
    """
    vms = provider.provision(list(requests), dry_run=True)
    report = getattr(provider, "last_dry_run", None)
    if report is None:
        report = DryRunReport(provider=str(getattr(provider, "name", "?")), calls=(), vms=tuple(vms))
    return format_dry_run(report)


def format_dry_run(report: DryRunReport) -> str:
    lines = [f"dry run on {report.provider}: {len(report.calls)} API request(s), nothing rented"]
    lines += [f"  {c.render()}" for c in report.calls]
    for v in report.vms:
        lines.append(f"  vm {v.name}: {v.gpus}x {v.gpu_type} {v.market.value} in {v.zone} at ${v.usd_per_hour:.4f}/h")
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


CREDENTIAL_MARKERS = ("SECRET", "TOKEN", "PASSWORD", "CREDENTIAL", "ACCESS_KEY", "PRIVATE_KEY")


def forbid_credentials(env: Mapping[str, str], *, where: str) -> None:
    bad = sorted(k for k in env if any(m in k.upper() for m in CREDENTIAL_MARKERS))
    if bad:
        raise ProviderError(
            f"{where}: refusing to copy {bad} to a VM; to fix: give the VM an instance role (AWS) or a "
            f"service account (GCP) with the rights it needs instead of passing secrets"
        )


def _csv(value: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in value.split(",") if x.strip())


DEFAULT_REGIONS = {"aws": ("us-east-1", "us-west-2"), "gcp": ("us-central1", "europe-west4")}


def provider_from_env(
    name: str, *, env: Mapping[str, str], regions: Sequence[str] | None = None,
    event_source: EventSource | None = None,
) -> Any:
    """Build the aws or gcp provider from settings in `env` (the caller passes os.environ).

    aws: regions from `regions`, else SAILOR_AWS_REGIONS (comma list); boto3's standard credential
    chain (AWS_PROFILE, env, SSO, instance role); SAILOR_AWS_ENDPOINT_URL points EC2 elsewhere
    (boto3 also honours AWS_ENDPOINT_URL); SAILOR_AWS_IMAGE_IDS=region=ami,...; SAILOR_AWS_INSTANCE_PROFILE.
    gcp: SAILOR_GCP_PROJECT (else GOOGLE_CLOUD_PROJECT), regions or SAILOR_GCP_REGIONS; google-auth's
    application default credentials; SAILOR_GCE_ENDPOINT points Compute elsewhere (a loopback
    endpoint uses anonymous credentials); SAILOR_GCP_LIVE_PRICES=0 skips the billing catalog.
    Both: SAILOR_<CLOUD>_CATALOG is a SkyPilot-format CSV used as the price fallback.
    """
    name = name.lower()
    if name == "aws":
        from infra.aws import from_environment as aws_from_env

        regs = tuple(regions or _csv(env.get("SAILOR_AWS_REGIONS", "")) or DEFAULT_REGIONS["aws"])
        images = dict(kv.split("=", 1) for kv in _csv(env.get("SAILOR_AWS_IMAGE_IDS", "")) if "=" in kv)
        extra: dict[str, Any] = {"image_ids": images} if images else {}
        if env.get("SAILOR_AWS_INSTANCE_PROFILE"):
            extra["instance_profile"] = env["SAILOR_AWS_INSTANCE_PROFILE"]
        return aws_from_env(regs, catalog_csv=env.get("SAILOR_AWS_CATALOG") or None,
                            endpoint_url=env.get("SAILOR_AWS_ENDPOINT_URL") or None, event_source=event_source,
                            **extra)
    if name == "gcp":
        from infra.gcp import from_environment as gcp_from_env

        project = env.get("SAILOR_GCP_PROJECT") or env.get("GOOGLE_CLOUD_PROJECT", "")
        if not project:
            raise ProviderError("no GCP project set; to fix: export SAILOR_GCP_PROJECT=my-project")
        regs = tuple(regions or _csv(env.get("SAILOR_GCP_REGIONS", "")) or DEFAULT_REGIONS["gcp"])
        return gcp_from_env(project, regs, catalog_csv=env.get("SAILOR_GCP_CATALOG") or None,
                            endpoint=env.get("SAILOR_GCE_ENDPOINT") or None, event_source=event_source,
                            live_prices=env.get("SAILOR_GCP_LIVE_PRICES", "1") != "0")
    raise ProviderError(f"unknown cloud provider {name!r}; to fix: use aws or gcp")
