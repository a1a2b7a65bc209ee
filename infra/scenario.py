"""Scenario files: what the local provider offers and which events it scripts, at which step or time.

Contract: `load_scenario(path)` / `parse_scenario(dict)` return a validated, frozen `Scenario` or
raise `ScenarioError` listing every problem with its location and how to fix it. Pure data: the
local provider applies the events (infra/local.py). Format (YAML):

    offerings:                       # what this machine rents out; default: 4 on-demand cpu slots
      - {market: spot, count: 4, usd_per_gpu_hour: 0.10}
      - {market: on-demand, count: 4, usd_per_gpu_hour: 0.30}
    events:                          # each fires once, when its trigger is reached
      - {at_step: 8, kind: preemption, market: spot}          # the newest VM of that market (or vm: N)
      - {at_step: 16, kind: price_change, market: spot, usd_per_gpu_hour: 0.6}
      - {at_s: 40, kind: capacity_change, market: on-demand, count: 2}

`at_step` counts training steps of the run (the highest step any worker reported); `at_s` counts
seconds since the run's first VM was provisioned. A preemption sends the VM's worker a notice
(SIGUSR1), waits `grace_s` (default 2), then kills it; the slot's capacity is gone with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sailor_core.domain import Market, SailorError, ValidationError

GPU_TYPE = "cpu"
ZONE = "local"
REGION = "local"
CLOUD = "local"
EVENT_KINDS = ("preemption", "price_change", "capacity_change")


class ScenarioError(SailorError):
    """A scenario file is malformed; the message lists every problem."""


@dataclass(frozen=True, kw_only=True)
class ScenarioOffering:
    market: Market
    count: int
    usd_per_gpu_hour: float
    gpu_type: str = GPU_TYPE


@dataclass(frozen=True, kw_only=True)
class ScenarioEvent:
    index: int
    kind: str
    at_step: int | None = None
    at_s: float | None = None
    market: Market | None = None
    vm: int | None = None
    usd_per_gpu_hour: float | None = None
    count: int | None = None
    grace_s: float = 2.0

    def due(self, *, step: int, elapsed_s: float) -> bool:
        if self.at_step is not None:
            return step >= self.at_step
        assert self.at_s is not None
        return elapsed_s >= self.at_s


@dataclass(frozen=True, kw_only=True)
class Scenario:
    offerings: tuple[ScenarioOffering, ...]
    events: tuple[ScenarioEvent, ...] = ()
    name: str = ""


DEFAULT_OFFERINGS = (ScenarioOffering(market=Market.ON_DEMAND, count=4, usd_per_gpu_hour=0.20),)


def default_scenario(slots: int = 4, usd_per_gpu_hour: float = 0.20) -> Scenario:
    return Scenario(
        offerings=(ScenarioOffering(market=Market.ON_DEMAND, count=slots, usd_per_gpu_hour=usd_per_gpu_hour),),
        name="default",
    )


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"scenario file {p} does not exist; to fix: check the path (examples in scenarios/)") from None
    except yaml.YAMLError as e:
        raise ScenarioError(f"scenario file {p} is not valid YAML: {e}; to fix: see scenarios/demo.yaml") from None
    return parse_scenario(raw or {}, name=p.stem)


def _num(d: dict[str, Any], key: str, where: str, errors: list[str], *, integer: bool = False,
         minimum: float = 0.0) -> Any:
    if key not in d or d[key] is None:
        return None
    v = d[key]
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if isinstance(v, bool) or not ok or v < minimum:
        kind = "an integer" if integer else "a number"
        errors.append(f"{where}.{key}: must be {kind} >= {minimum:g}, got {v!r}")
        return None
    return v


def parse_scenario(raw: dict[str, Any], *, name: str = "") -> Scenario:
    errors: list[str] = []
    if not isinstance(raw, dict):
        raise ScenarioError("a scenario must be a mapping with 'offerings' and 'events'; see scenarios/demo.yaml")
    unknown = set(raw) - {"offerings", "events", "name"}
    if unknown:
        errors.append(f"unknown top-level keys {sorted(unknown)} (allowed: offerings, events, name)")
    offerings: list[ScenarioOffering] = []
    for i, o in enumerate(raw.get("offerings") or []):
        where = f"offerings[{i}]"
        if not isinstance(o, dict):
            errors.append(f"{where}: must be a mapping, got {o!r}")
            continue
        try:
            market = Market.parse(o.get("market", "on-demand"))
        except ValidationError as e:
            errors.append(f"{where}.market: {e}")
            continue
        count = _num(o, "count", where, errors, integer=True)
        price = _num(o, "usd_per_gpu_hour", where, errors)
        if count is None or price is None:
            if "count" not in o or "usd_per_gpu_hour" not in o:
                errors.append(f"{where}: needs count and usd_per_gpu_hour")
            continue
        if any(x.market == market for x in offerings):
            errors.append(f"{where}: market {market.value} listed twice; merge the counts")
        offerings.append(ScenarioOffering(market=market, count=count, usd_per_gpu_hour=float(price)))
    events: list[ScenarioEvent] = []
    for i, e in enumerate(raw.get("events") or []):
        where = f"events[{i}]"
        if not isinstance(e, dict):
            errors.append(f"{where}: must be a mapping, got {e!r}")
            continue
        kind = e.get("kind")
        if kind not in EVENT_KINDS:
            errors.append(f"{where}.kind: must be one of {', '.join(EVENT_KINDS)}, got {kind!r}")
            continue
        at_step = _num(e, "at_step", where, errors, integer=True)
        at_s = _num(e, "at_s", where, errors)
        if (at_step is None) == (at_s is None):
            errors.append(f"{where}: give exactly one trigger, at_step or at_s")
            continue
        market = None
        if e.get("market") is not None:
            try:
                market = Market.parse(e["market"])
            except ValidationError as err:
                errors.append(f"{where}.market: {err}")
                continue
        vm = _num(e, "vm", where, errors, integer=True)
        price = _num(e, "usd_per_gpu_hour", where, errors)
        count = _num(e, "count", where, errors, integer=True)
        grace = _num(e, "grace_s", where, errors)
        if kind == "price_change" and (market is None or price is None):
            errors.append(f"{where}: a price_change needs market and usd_per_gpu_hour")
            continue
        if kind == "capacity_change" and (market is None or count is None):
            errors.append(f"{where}: a capacity_change needs market and count")
            continue
        if kind == "preemption" and market is None and vm is None:
            errors.append(f"{where}: a preemption needs market (its newest VM) or vm (index in provisioning order)")
            continue
        if market is not None and not any(o.market == market for o in offerings) and offerings:
            errors.append(f"{where}.market: {market.value} is not among the offerings")
            continue
        events.append(ScenarioEvent(
            index=i, kind=kind, at_step=at_step, at_s=at_s, market=market, vm=vm,
            usd_per_gpu_hour=None if price is None else float(price), count=count,
            grace_s=2.0 if grace is None else float(grace),
        ))
    if errors:
        raise ScenarioError("invalid scenario: " + "; ".join(errors) + "; to fix: see scenarios/demo.yaml")
    return Scenario(offerings=tuple(offerings) or DEFAULT_OFFERINGS, events=tuple(events), name=str(raw.get("name") or name))
