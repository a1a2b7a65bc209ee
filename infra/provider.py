"""The Provider protocol: what a cloud (or this machine) must offer the orchestration.

Contract: a provider reports offerings (what can be rented now, at what price: `Capacity` with its
`instance_type` and `price_fetched_at`, `gpus` in whole VMs of `gpus_per_vm`), provisions VMs for
a run, bootstraps the worker agent on them, reports events (preemption notices, lost VMs,
capacity and price changes) and terminates. Input and output models are separate frozen
dataclasses. Every resource a provider creates is tagged with the run id so `cleanup(run_id)`
finds it. Providers receive their side effects (clients, clocks, event sources) in their
constructor; nothing reaches for a global. Every implementation passes tests/provider_contract.py.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from sailor_core.domain import Capacity, Market


@dataclass(frozen=True, kw_only=True)
class VmRequest:
    """One VM to rent for a run: where, what, which market, and its name within the run."""

    run_id: str
    name: str
    zone: str
    gpu_type: str
    gpus: int
    market: Market = Market.ON_DEMAND
    region: str = ""
    instance_type: str = ""


@dataclass(frozen=True, kw_only=True)
class Vm:
    """A rented VM as the provider reports it."""

    vm_id: str
    run_id: str
    name: str
    zone: str
    gpu_type: str
    gpus: int
    market: Market
    address: str = ""
    state: str = "running"
    usd_per_hour: float = 0.0


class EventKind(enum.StrEnum):
    PREEMPTION = "preemption"  # a notice: the VM will go away soon
    LOST = "lost"  # the VM or its worker is gone (no heartbeat, terminated)
    CAPACITY_CHANGE = "capacity_change"
    PRICE_CHANGE = "price_change"


class Reporter(enum.StrEnum):
    """Who saw an event: the provider (the VM itself went, or stopped beating) or the VM's workers
    (their generation failed, which may be only because a peer elsewhere went: collateral)."""

    PROVIDER = "provider"
    WORKERS = "workers"


@dataclass(frozen=True, kw_only=True)
class ProviderEvent:
    kind: EventKind
    at: datetime
    vm_id: str = ""
    zone: str = ""
    gpu_type: str = ""
    market: Market | None = None
    detail: dict[str, object] = field(default_factory=dict)
    reported_by: Reporter = Reporter.PROVIDER


@dataclass(frozen=True, kw_only=True)
class WorkerAssignment:
    """What the worker agent on a VM needs: the plan, its ranks, where to meet and where to write."""

    run_id: str
    plan_version: int
    plan_json: str
    rendezvous_endpoint: str
    ranks: tuple[int, ...]
    world_size: int
    checkpoint_uri: str = ""
    data_uri: str = ""
    env: dict[str, str] = field(default_factory=dict)
    # What to train and how long; where to report. The agent writes one JSON line per step (at least
    # step, loss, samples, iteration_time_s) to `metrics_uri` and beats its heartbeat while it runs;
    # it resumes from the newest complete checkpoint under `checkpoint_uri` when one exists.
    model: str = ""
    total_steps: int = 0
    checkpoint_interval: int = 0
    seed: int = 0
    metrics_uri: str = ""
    # How the VM joins (infra/bootstrap.py AGENT_SCRIPT): `rendezvous_endpoint` is the run's controller,
    # `run_secret` the key every control message carries; the VM installs exactly the wheel at
    # `wheel_url` (checked against `wheel_sha256`, with `extras`), runs one worker per device and
    # copies its worker logs under `log_uri`. `first_generation`: the generation a VM joining a running
    # job waits for; `advertise_address`: where the other VMs reach it (empty: its first address).
    run_secret: str = field(default="", repr=False)
    devices: int = 1
    wheel_url: str = ""
    wheel_sha256: str = ""
    extras: str = ""
    log_uri: str = ""
    first_generation: int = 0
    advertise_address: str = ""
    command: tuple[str, ...] = ()  # a one-off `sailor` command to run instead of the worker (e.g. profiling)


@runtime_checkable
class Provider(Protocol):
    name: str

    def offerings(
        self, *, regions: Sequence[str] | None = None, gpu_types: Sequence[str] | None = None,
        markets: Sequence[Market] | None = None,
    ) -> list[Capacity]: ...

    def provision(self, requests: Sequence[VmRequest], *, dry_run: bool = False) -> list[Vm]: ...

    def bootstrap(self, vm: Vm, assignment: WorkerAssignment) -> None: ...

    def events(self, run_id: str, *, since: datetime | None = None) -> list[ProviderEvent]: ...

    def list_vms(self, run_id: str | None = None) -> list[Vm]: ...

    def terminate(self, vm_ids: Sequence[str]) -> None: ...

    def cleanup(self, run_id: str | None = None, *, dry_run: bool = False) -> list[str]:
        """Remove every resource tagged with the run (all runs if None); return what was removed."""
        ...


# -- optional capabilities -------------------------------------------------------------------------


@runtime_checkable
class AgentExitCodes(Protocol):
    """The provider sees its VMs' agent processes: their exit status (None while one runs)."""

    def agent_exit_code(self, vm_id: str) -> int | None: ...


@runtime_checkable
class ClusterInfo(Protocol):
    """The provider can say where a run's VMs live (isolation, zones, addresses), for the run history."""

    def cluster_info(self, run_id: str) -> dict[str, object]: ...


@dataclass(frozen=True, kw_only=True)
class ApiCall:
    """One request a cloud provider would send: service, region or zone, operation, exact parameters."""

    service: str
    location: str  # region or zone the call goes to
    operation: str
    params: Mapping[str, Any]

    def render(self) -> str:
        return (
            f"{self.service}.{self.operation} [{self.location}] {json.dumps(self.params, sort_keys=True, default=str)}"
        )


@dataclass(frozen=True, kw_only=True)
class DryRunReport:
    """What `provision(..., dry_run=True)` would send (`calls`) and rent (`vms`), and what it would cost."""

    provider: str
    calls: tuple[ApiCall, ...]
    vms: tuple[Vm, ...]

    @property
    def usd_per_hour(self) -> float:
        return sum(v.usd_per_hour for v in self.vms)


@runtime_checkable
class DryRunReporting(Protocol):
    """A cloud provider: after `provision(..., dry_run=True)`, the exact API requests it would send."""

    last_dry_run: DryRunReport | None


@runtime_checkable
class ScriptedEvents(Protocol):
    """A provider whose events are scripted at training steps (the local provider's scenario file): the
    steps still to come, where the flow holds its workers until the provider has seen the step (so an
    event happens at its step however fast the job trains), and the scripted events that could not
    happen (no VM matched, or the run ended before their step), in the user's words."""

    def scripted_steps(self, run_id: str) -> list[int]: ...

    def missed_events(self, run_id: str, *, last_step: int) -> list[str]: ...


@runtime_checkable
class HostedVms(Protocol):
    """VMs hosted on this machine (the local provider): where they reach the flow, how they are isolated,
    and the environment every VM's agent gets."""

    isolation: str
    env: dict[str, str]

    def host_address(self, run_id: str) -> str: ...
