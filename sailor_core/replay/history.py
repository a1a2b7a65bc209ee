"""A run the flow really made, as a replay: its trace and its job, from the run's stored history.

Contract: pure. `run_trace(run, initial)` takes the run as `RunHistory.show` returns it (plain
dicts: params, events, decisions) and the pool the run started with (the provider's offerings at the
start; for the local provider, its scenario's), and returns a step-based `Trace` with one point per
replan the flow made, at the step it made it, holding the pool as the stored events left it by then:
a preemption takes the preempted VM from the job and its GPUs from the place's capacity, a lost
worker takes its VM from the job (the capacity stays), a price change sets the place's price, a
capacity change sets its number of VMs (the death of a VM the job had already given up, preempted or
released, takes nothing again). Each point names what woke the replan (the replan's trigger) and
carries what the flow had measured by then: its calibration factors (online corrections of each GPU
type's layer times, from the run's start and from its `iteration_time` replans) and the
reconfiguration time the flow assumed there: `known_reconfiguration`, the flow's own function, over
the run's switches in place so far and the store's measurements (`measured`: their times and
figures) recorded before that replan, never one recorded later. `run_job(run, ...)` is the
`ReplayJob` of the run's parameters, deciding as the flow does (its reconfiguration estimate, its
search, no plan reuse across pools, replacements weighed with the VM start and state-loading rate
its first replan after a loss recorded). Replayed under the `sailor` policy, the replay meets the
same events at the same steps and decides with the same planner, `best_replacement` and
`decide_switch`; `decisions_of(run)` lists what the flow decided, to compare.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sailor_core.decisions import Measured, known_reconfiguration
from sailor_core.domain import Capacity, Market, ResourcePool
from sailor_core.errors import SailorError
from sailor_core.planner import Constraints, Objective, Restrictions, SearchOptions
from sailor_core.planner.risk import DEFAULT_RECONFIGURATION_S, planning_checkpoint_interval
from sailor_core.replay.engine import DEFAULT_GRACE_S, ReplayJob
from sailor_core.replay.trace import Place, Trace, TracePoint

Key = tuple[str, str, Market]


def _key(row: Mapping[str, Any]) -> Key | None:
    if not row.get("zone") or not row.get("gpu_type") or not row.get("market"):
        return None
    return (str(row["zone"]), str(row["gpu_type"]), Market.parse(str(row["market"])))


def run_trace(run: Mapping[str, Any], initial: ResourcePool, calibration: Mapping[str, float] | None = None,
              measured: Sequence[tuple[datetime, Measured]] = ()) -> Trace:
    """`calibration`: the factors the run started with (the newest per GPU type from earlier runs);
    `measured`: the store's reconfiguration and VM start measurements, each with the time it was recorded."""
    entries: dict[Key, Capacity] = {(e.zone, e.gpu_type, e.market): e for e in initial.entries}
    if not entries:
        raise SailorError(
            f"run {run.get('run_id')}: the starting pool is empty; to fix: pass the offerings it began with"
        )
    order = list(entries)
    count = {k: e.gpus for k, e in entries.items()}
    price = {k: e.usd_per_gpu_hour for k, e in entries.items()}
    places = tuple(Place(zone=e.zone, gpu_type=e.gpu_type, market=e.market, region=e.region, cloud=e.cloud,
                         gpus_per_node=e.gpus_per_vm) for e in entries.values())

    taken = {k: 0 for k in order}
    factors = dict(calibration or {})
    in_place: list[float] = []  # this run's switches that rented no VM
    known: list[Measured] = []  # the store's measurements recorded so far
    gone: set[str] = set()  # VMs the job no longer holds (preempted, lost, released)
    provider = str((run.get("params") or {}).get("provider", ""))

    def point(at_step: int | None, happened: tuple[str, ...] = ()) -> TracePoint:
        reconf = None if at_step is None else known_reconfiguration(
            run_id=str(run.get("run_id", "")), provider=provider, this_run_in_place_s=in_place, measured=known,
            assumed_s=DEFAULT_RECONFIGURATION_S)[0]  # the flow's own figure at this replan
        pt = TracePoint(at_s=0.0, counts=tuple(count[k] for k in order),
                        usd_per_gpu_hour=tuple(price[k] for k in order), at_step=at_step,
                        taken=tuple(taken[k] for k in order) if any(taken.values()) else (),
                        calibration=tuple(sorted(factors.items())), reconfiguration_s=reconf, happened=happened)
        for k in order:
            taken[k] = 0
        return pt

    # The run's events, its calibrations and the store's measurements, in the order they were recorded.
    rows = [(_when(e.get("time")), 0, e) for e in run.get("events", [])]
    rows += [(_when(m.get("time")), 1, {**m, "kind": "calibration"}) for m in run.get("measurements", [])
             if m.get("kind") == "calibration"]
    rows += [(t if t.tzinfo else t.replace(tzinfo=UTC), 1, {"kind": "measured", "measured": m}) for t, m in measured]
    rows.sort(key=lambda r: (r[0], r[1]))
    points = [point(None)]
    for _, _, ev in rows:
        kind = ev.get("kind")
        k = _key(ev)
        if kind == "preemption" and k in count:
            gone.add(str(ev.get("vm_id") or ""))
            count[k] = max(0, count[k] - entries[k].gpus_per_vm)  # the VM and its capacity go
            taken[k] += entries[k].gpus_per_vm
        elif kind == "lost" and not (ev.get("vm_id") and ev["vm_id"] in gone):
            # A worker that died: its VM is released, the capacity stays. A worker's own report
            # names no place: the plan lost a worker wherever it runs. The death of a VM the job
            # had already given up (preempted, released) is no loss (the flow's replan ignores it).
            gone.add(str(ev.get("vm_id") or ""))
            for x in [k] if k in taken else order:
                taken[x] += entries[x].gpus_per_vm
        elif kind == "provisioned":
            gone.update(str(v) for v in ev.get("released") or ())
        elif kind == "price_change" and k in price and ev.get("new_usd_per_gpu_hour") is not None:
            price[k] = float(ev["new_usd_per_gpu_hour"])
        elif kind == "capacity_change" and k in count and ev.get("new_count") is not None:
            count[k] = int(ev["new_count"]) * entries[k].gpus_per_vm
        elif kind == "calibration" and ev.get("gpu_type") and ev.get("factor") is not None:
            factors[str(ev["gpu_type"])] = float(ev["factor"])  # the factor in force, not a further scaling
        elif kind == "measured":
            known.append(ev["measured"])
        elif kind == "reconfigured" and ev.get("reconfiguration_s") is not None and not ev.get("new_vms"):
            in_place.append(float(ev["reconfiguration_s"]))  # a switch in place (the flow's rule)
        elif kind == "replan":
            # The prices the replan read: a change stamped before it that its read missed, or the reverse,
            # is priced at this point as the flow priced it.
            for row in ev.get("prices") or ():
                if (pk := _key(row)) in price and row.get("usd_per_gpu_hour") is not None:
                    price[pk] = float(row["usd_per_gpu_hour"])
            points.append(point(int(ev.get("step", 0)), tuple(str(t) for t in ev.get("trigger") or ())))
    return Trace(name=f"run {run.get('run_id', '')}", places=places, points=tuple(points))


def _when(iso: object) -> datetime:
    """A history row's time (rows without one sort first, in the order given)."""
    if not iso:
        return datetime.min.replace(tzinfo=UTC)
    t = datetime.fromisoformat(str(iso))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def run_job(run: Mapping[str, Any], *, sequence_length: int,
            reconfiguration_s: float = DEFAULT_RECONFIGURATION_S) -> ReplayJob:
    p = run.get("params") or {}
    if not p:
        raise SailorError(f"run {run.get('run_id')} has no stored parameters; to fix: replay a run the flow recorded")
    gbs = int(p["global_batch_size"])
    steps = p.get("steps") or max(1, math.ceil(int(p["token_budget"]) / (gbs * sequence_length)))
    workers = p.get("workers")
    max_gpus = p.get("max_gpus")
    if p.get("provider") == "local" and workers:  # the flow's rule (RunContext.plan_request)
        max_gpus = min(max_gpus or workers, workers)
    search = SearchOptions(max_stages=int(p["max_stages"])) if p.get("max_stages") else SearchOptions()
    graces = [float(e["grace_s"]) for e in run.get("events", []) if e.get("kind") == "preemption" and "grace_s" in e]
    startup = next((d["detail"]["startup"] for d in run.get("decisions", [])
                    if isinstance(d.get("detail"), Mapping) and d["detail"].get("startup")
                    and len(d["detail"].get("replacements") or ()) > 1), None)
    return ReplayJob(
        model=str(p["model"]), global_batch_size=gbs, total_steps=int(steps), tokens_per_step=gbs * sequence_length,
        objective=Objective.parse(p.get("objective", "min-cost")).value,
        constraints=Constraints(max_usd_per_iteration=p.get("max_usd_per_iteration"),
                                max_usd_per_hour=p.get("max_usd_per_hour"),
                                min_iterations_per_s=p.get("min_iterations_per_s")),
        restrictions=Restrictions(clouds=tuple(p.get("clouds") or ()), regions=tuple(p.get("regions") or ()),
                                  gpu_types=tuple(p.get("gpu_types") or ()),
                                  markets=tuple(Market.parse(m) for m in p.get("markets") or ()), max_gpus=max_gpus),
        search=search, checkpoint_interval=planning_checkpoint_interval(int(p.get("checkpoint_interval") or 0)),
        reconfiguration_s=reconfiguration_s,
        min_gain=float(p.get("min_gain", 0.0)), reuse_dominating_plans=False,
        vm_start_s=float(startup["vm_start_s"]) if startup else 0.0,
        load_bytes_per_s=float(startup["load_bytes_per_s"]) if startup else math.inf,
        grace_s=max(graces) if graces else DEFAULT_GRACE_S,
    )


def decisions_of(run: Mapping[str, Any]) -> list[tuple[str, int]]:
    """What the flow decided at each replan: (switch | stay, step)."""
    return [(str(d["kind"]), int((d.get("detail") or {}).get("step", -1))) for d in run.get("decisions", [])]
