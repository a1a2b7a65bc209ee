"""Spot risk from what the store has watched: the planner's `SpotRisk` for `sailor plan` and the flow.

Contract: `spot_risk_from_store(store, ...)` starts from the given rates (a pool file's, or the flow's
parameter) and replaces each (zone, GPU type) the store's run history has watched for long enough
with the rate measured there (preemption events over spot VM-hours of adopted plans); the
reconfiguration time is the caller's when given, else the mean the store measured, else the default.
`sources` says where each number came from. A store that cannot be read leaves the given rates
standing (planning must not fail on a damaged history). Reads only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sailor_core.errors import SailorError
from sailor_core.plan_format import plan_from_dict
from sailor_core.planner.risk import (
    DEFAULT_CHECKPOINT_INTERVAL_STEPS,
    DEFAULT_RECONFIGURATION_S,
    SpotRisk,
    rates_from_history,
    reconfiguration_from_history,
    spot_exposure_vm_hours,
)

RateKey = tuple[str, str]  # (zone, GPU type)

__all__ = ["spot_risk_from_store"]


def _measured(store: Any) -> tuple[dict[RateKey, tuple[float, int, float]], float | None]:
    """Per (zone, GPU type): (rate, preemptions, spot VM-hours) from the history; the mean reconfiguration."""
    plan_rows = []
    for rec in store.read_history("plans"):
        try:
            plan_rows.append((rec.run_id, rec.time, plan_from_dict(dict(rec.payload["plan"]))))
        except (KeyError, TypeError, ValueError, SailorError):
            continue  # a row this version cannot read tells nothing about exposure
    ends = {rec.run_id: rec.time for rec in sorted(store.read_history("runs"), key=lambda r: r.time)
            if rec.kind in ("completed", "failed", "cancelled", "crashed")}
    events = [(str(e.payload.get("zone", "")), str(e.payload.get("gpu_type", "")), e.payload.get("market"))
              for e in store.read_history("events", kind="preemption")]
    rates = rates_from_history(events, spot_exposure_vm_hours(plan_rows, ends))
    reconf = reconfiguration_from_history(
        float(m.payload["reconfiguration_s"]) for m in store.read_history("measurements", kind="reconfiguration")
        if "reconfiguration_s" in m.payload)
    return rates, reconf


def spot_risk_from_store(store: Any, *, rates: Sequence[tuple[RateKey, float]] = (), default_rate: float = 0.0,
                         checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL_STEPS,
                         reconfiguration_s: float | None = None, given_as: str = "pool file") -> SpotRisk:
    """The given rates overlaid with the store's measured ones (see the module's contract)."""
    by_market = dict(rates)
    sources = {key: f"{key[0]} {key[1]}: {given_as}" for key in by_market}
    measured_reconf = None
    if store is not None:
        try:
            measured, measured_reconf = _measured(store)
        except Exception as e:  # noqa: BLE001 - no readable history: the given rates stand, and the answer says so
            measured = {}
            sources[("*", "*")] = f"run history unreadable ({str(e).splitlines()[0][:120]}): given rates only"
        for key, (rate, n, hours) in measured.items():
            by_market[key] = rate
            sources[key] = f"{key[0]} {key[1]}: history, {n} preemption(s) in {hours:.1f} spot VM-hours"
    if reconfiguration_s is not None:
        reconf, src = reconfiguration_s, "given"
    elif measured_reconf is not None:
        reconf, src = measured_reconf, "measured mean in the store"
    else:
        reconf, src = DEFAULT_RECONFIGURATION_S, "default"
    notes = [*sources.values(), f"reconfiguration {reconf:.1f} s: {src}"]
    if default_rate:
        notes.insert(0, f"other spot markets: {default_rate:g} preemptions per VM-hour ({given_as})")
    return SpotRisk(
        preemptions_per_vm_hour=tuple(sorted(by_market.items())),
        default_preemptions_per_vm_hour=default_rate,
        reconfiguration_s=reconf,
        checkpoint_interval_steps=checkpoint_interval,
        sources=tuple(notes),
    )
