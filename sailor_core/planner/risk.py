"""Spot risk: the expected useful throughput of a plan whose spot VMs can be preempted.

Contract: pure functions of their arguments. `SpotRisk` holds what the planner knows about
preemptions: a rate per spot market (preemptions per VM-hour of (zone, GPU type) spot capacity;
on-demand VMs are not preempted), the reconfiguration time R (seconds from a preemption to the
first step of the new plan) and the checkpoint interval (steps). `useful_fraction` applies the
model below to one plan; `rates_from_history` and `reconfiguration_from_history` turn a store's
run history (plain rows, no I/O here) into those inputs.

Model. Preemptions of the plan's spot VMs arrive as a Poisson process of rate
    Lambda = sum over spot markets k of nodes_k x lambda_k      (nodes: VMs of gpus_per_node GPUs)
Each one costs the work since the last checkpoint and R seconds before training resumes (the
VMs are billed meanwhile). With a checkpoint every I = steps x iteration time seconds, the
expected wall time to get I seconds of work done is (exponential failures, restart R, Daly 2006)
    E = e^(Lambda R) (e^(Lambda I) - 1) / Lambda
so a fraction u = I / E of the time trains (u -> 1 as Lambda -> 0; u ~ 1 - Lambda (R + I/2) for
small Lambda). Expected throughput = nominal x u; expected USD per useful iteration = USD per
iteration / u. `max-goodput` maximises useful iterations per dollar, i.e. minimises the latter;
with every rate 0 it is `min-cost`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sailor_core.domain import Market, ModelSpec, ParallelPlan
from sailor_core.errors import ValidationError

SECONDS_PER_HOUR = 3600.0
# The flow's defaults (flows/sailor.py: reconfiguration_estimate_s, checkpoint_interval), used when
# the store has measured no reconfiguration and the caller names no interval.
DEFAULT_RECONFIGURATION_S = 15.0
DEFAULT_CHECKPOINT_INTERVAL_STEPS = 10
# A checkpoint interval of 0 asks for the automatic one, the default of every entry point (the flow's
# `checkpoint_interval`, `--checkpoint-interval` of `sailor train`, `plan` and `replay`): the flow
# chooses one per plan version by Young/Daly (`checkpoint_interval` below, tasks/checkpointing.py).
# Where no plan exists yet to time (the planner weighing spot risk, `sailor plan`, `sailor replay`)
# it stands for DEFAULT_CHECKPOINT_INTERVAL_STEPS (`planning_checkpoint_interval`).
AUTO_CHECKPOINT_INTERVAL = 0


def planning_checkpoint_interval(given: int) -> int:
    """The interval a plan's spot risk is weighed with: `given`, or for automatic (0) the flow's
    stand-in before it has a plan to time."""
    return given if given >= 1 else DEFAULT_CHECKPOINT_INTERVAL_STEPS
# History estimates a market's rate only from at least this much observed spot time; below it the
# pool file's rate (or 0) stands. One VM-hour: a handful of minutes on a few VMs says nothing.
MIN_EXPOSURE_VM_HOURS = 1.0


@dataclass(frozen=True, kw_only=True)
class SpotRisk:
    """Preemption rates per spot market, reconfiguration time and checkpoint interval."""

    # ((zone, gpu_type), preemptions per VM-hour) for spot capacity; markets not listed use the default
    preemptions_per_vm_hour: tuple[tuple[tuple[str, str], float], ...] = ()
    default_preemptions_per_vm_hour: float = 0.0
    reconfiguration_s: float = DEFAULT_RECONFIGURATION_S
    checkpoint_interval_steps: int = DEFAULT_CHECKPOINT_INTERVAL_STEPS
    # where each number came from, for the answer (e.g. "us-central1-a A100-40: history, 3 in 40.0 VM-h")
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        rates = [r for _, r in self.preemptions_per_vm_hour] + [self.default_preemptions_per_vm_hour]
        bad = [r for r in rates if not (r >= 0 and math.isfinite(r))]
        if bad:
            raise ValidationError(f"preemption rates must be numbers >= 0 per VM-hour, got {bad}")
        if not (self.reconfiguration_s >= 0 and math.isfinite(self.reconfiguration_s)):
            raise ValidationError(f"reconfiguration_s must be >= 0, got {self.reconfiguration_s!r}")
        if self.checkpoint_interval_steps < 1:
            raise ValidationError(f"checkpoint_interval_steps must be >= 1, got {self.checkpoint_interval_steps}")

    def rate(self, zone: str, gpu_type: str, market: Market) -> float:
        """Preemptions per VM-hour of this market (0 for on-demand)."""
        if market is not Market.SPOT:
            return 0.0
        for key, r in self.preemptions_per_vm_hour:
            if key == (zone, gpu_type):
                return r
        return self.default_preemptions_per_vm_hour

    @property
    def riskless(self) -> bool:
        return self.default_preemptions_per_vm_hour == 0 and all(r == 0 for _, r in self.preemptions_per_vm_hour)

    def to_json(self) -> dict[str, Any]:
        return {
            "preemptions_per_vm_hour": {f"{z}/{g}": r for (z, g), r in self.preemptions_per_vm_hour},
            "default_preemptions_per_vm_hour": self.default_preemptions_per_vm_hour,
            "reconfiguration_s": self.reconfiguration_s,
            "checkpoint_interval_steps": self.checkpoint_interval_steps,
            "sources": list(self.sources),
        }


def useful_fraction_of(preemptions_per_hour: float, iteration_s: float, risk: SpotRisk) -> float:
    """u = I / E for a plan hit by `preemptions_per_hour` (Lambda) at this iteration time."""
    lam = preemptions_per_hour / SECONDS_PER_HOUR
    if lam <= 0:
        return 1.0
    interval = risk.checkpoint_interval_steps * iteration_s
    x = lam * interval
    # E = e^(lam R) (e^(lam I) - 1) / lam; u = I / E = x e^(-lam R) / expm1(x), in logs against overflow
    log_u = math.log(x) - lam * risk.reconfiguration_s - (x + math.log1p(-math.exp(-x)) if x > 30 else
                                                         math.log(math.expm1(x)))
    return math.exp(log_u)


def plan_preemptions_per_hour(nodes: Mapping[tuple[str, str, Market], int], risk: SpotRisk) -> float:
    """Lambda: the plan's VMs per (zone, GPU type, market) times each market's rate."""
    return sum(n * risk.rate(z, g, mk) for (z, g, mk), n in nodes.items())


def plan_nodes(plan: ParallelPlan) -> dict[tuple[str, str, Market], int]:
    """VMs a plan rents per (zone, GPU type, market): its GPUs there in nodes of gpus_per_node."""
    gpn: dict[tuple[str, str, Market], int] = {}
    for st in plan.stages:
        for r in st.replicas:
            gpn[(r.zone, r.gpu_type, r.market)] = r.gpus_per_node
    return {k: -(-n // gpn[k]) for k, n in plan.gpus_by_place().items()}


# What a rank's checkpoint shard holds per parameter: fp32 weights and AdamW's two fp32 moments.
STATE_BYTES_PER_PARAM = 12
# New VMs, from the provisioning request to the first trained step, before the store has measured a
# provider's (`vm_start` measurements, written at every run's cold start): stated assumptions. A cloud VM
# boots in one to two minutes and its agent then installs the run's wheel and starts torch workers; the
# local provider starts plain processes.
ASSUMED_VM_START_S = {"aws": 180.0, "gcp": 180.0, "local": 10.0}
ASSUMED_VM_START_OTHER_S = 180.0  # a provider not listed
# A rank reading its shard of the checkpoint, before the run has measured a checkpoint of its own: one
# stream from object storage (as tasks/checkpointing.py assumes for writing).
ASSUMED_LOAD_BYTES_PER_S = 100e6


def largest_shard_bytes(plan: ParallelPlan, model: ModelSpec) -> int:
    """The training state the largest rank holds: one TP rank's shard of its stage's layers (what it writes
    to a checkpoint, and what a rank on a new VM loads before its first step)."""
    most = 0
    for st in plan.stages:
        tp = st.replicas[0].tp
        params = sum(model.layer(li, tp).params for li in range(st.first_layer, st.last_layer + 1))
        most = max(most, params * STATE_BYTES_PER_PARAM)
    return most


def vm_start_from_history(measured_s: Iterable[float]) -> float | None:
    """The median of a provider's measured VM starts (None when none was measured): one slow start (an image
    pulled for the first time) does not set every later decision."""
    xs = sorted(float(x) for x in measured_s if x is not None and math.isfinite(float(x)) and float(x) >= 0)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def assumed_vm_start_s(provider: str) -> float:
    return ASSUMED_VM_START_S.get(provider, ASSUMED_VM_START_OTHER_S)


# A VM that fails with no notice at all (a host fault, a kernel panic, a lost network path): about once a
# VM-month. An assumption, not a measurement, stated so that an on-demand job still checkpoints; the
# spot rates above come from the store's history or the user.
UNNOTICED_FAILURES_PER_VM_HOUR = 1.0 / (30 * 24)


@dataclass(frozen=True, kw_only=True)
class CheckpointInterval:
    """How often a job checkpoints, and why (the numbers the rule used)."""

    steps: int
    seconds: float
    reason: str


def checkpoint_interval(*, iteration_s: float, write_s: float, stall_s: float, notice_s: float | None,
                        spot_preemptions_per_hour: float, vms: int, total_steps: int) -> CheckpointInterval:
    """The checkpoint interval of a job (Young 1974, Daly 2006).

    A checkpoint costs training `stall_s` (the snapshot the step waits for) plus whatever of its
    `write_s` (the background write to storage) outlasts the next step, which commits only once the
    write is durable (so a write that fails loses at most one interval). Failures that lose work arrive at rate lambda:
    every VM's unnoticed failures, plus the plan's spot preemptions when their notice is too short
    for a just-in-time checkpoint (the step in flight, then the write: iteration_s + write_s; a
    notice at least that long costs no steps). With M = 1 / lambda, the expected waste per unit of
    time, stall_s / T + T / (2 M), is least at Young's T = sqrt(2 stall_s M); Daly's first order,
    T = sqrt(2 stall_s M) - stall_s, for stall_s < M / 2. T is never below write_s (a checkpoint must
    be written before the next begins, or the step waits), and is counted in whole steps, at least 1
    and at most the job's."""
    if not (iteration_s > 0 and write_s >= 0 and stall_s >= 0 and vms >= 1 and total_steps >= 1):
        raise ValidationError(f"checkpoint_interval needs iteration_s > 0, write_s and stall_s >= 0, vms and "
                              f"total_steps >= 1; got {iteration_s}, {write_s}, {stall_s}, {vms}, {total_steps}")
    jit_s = iteration_s + write_s
    noticed = notice_s is not None and notice_s >= jit_s
    lam = (vms * UNNOTICED_FAILURES_PER_VM_HOUR + (0.0 if noticed else spot_preemptions_per_hour)) / SECONDS_PER_HOUR
    mtbf = 1.0 / lam
    # A checkpoint is never free: its snapshot copies every tensor once.
    stall = max(stall_s + max(0.0, write_s - iteration_s), 1e-3)
    young = math.sqrt(2 * stall * mtbf)
    t = young - stall if stall < mtbf / 2 else young
    steps = max(1, math.ceil(write_s / iteration_s), round(t / iteration_s))
    steps = min(steps, total_steps)
    why = ("spot preemptions are answered by their notice" if noticed else
           "no spot preemptions expected" if spot_preemptions_per_hour == 0 else
           f"spot preemptions count ({spot_preemptions_per_hour:.3g}/h): their notice "
           f"{'is unknown' if notice_s is None else f'{notice_s:.0f} s'} is shorter than a step and a write "
           f"({jit_s:.1f} s)")
    reason = (f"every {steps} steps ({steps * iteration_s:.0f} s): Young/Daly sqrt(2 x {stall:.2f} s stall x "
              f"MTBF {mtbf / 3600:.1f} h) - stall = {t:.0f} s, at least one write ({write_s:.1f} s); {why}")
    return CheckpointInterval(steps=steps, seconds=steps * iteration_s, reason=reason)


@dataclass(frozen=True, kw_only=True)
class Goodput:
    """A plan's nominal and expected (preemption-aware) throughput and cost."""

    nominal_iterations_per_s: float
    expected_iterations_per_s: float
    useful_fraction: float
    preemptions_per_hour: float
    usd_per_iteration: float
    expected_usd_per_useful_iteration: float

    def to_json(self) -> dict[str, Any]:
        return {
            "nominal_iterations_per_s": self.nominal_iterations_per_s,
            "expected_iterations_per_s": self.expected_iterations_per_s,
            "useful_fraction": self.useful_fraction,
            "preemptions_per_hour": self.preemptions_per_hour,
            "usd_per_iteration": self.usd_per_iteration,
            "expected_usd_per_useful_iteration": self.expected_usd_per_useful_iteration,
        }


def goodput(plan: ParallelPlan, iteration_s: float, usd_per_iteration: float, risk: SpotRisk) -> Goodput:
    lam = plan_preemptions_per_hour(plan_nodes(plan), risk)
    u = useful_fraction_of(lam, iteration_s, risk)
    return Goodput(
        nominal_iterations_per_s=1.0 / iteration_s,
        expected_iterations_per_s=u / iteration_s,
        useful_fraction=u,
        preemptions_per_hour=lam,
        usd_per_iteration=usd_per_iteration,
        expected_usd_per_useful_iteration=usd_per_iteration / u if u > 0 else math.inf,
    )


# --- from a store's run history (rows passed in; the caller reads them) -------------------------


def spot_exposure_vm_hours(plan_rows: Iterable[tuple[str, datetime, ParallelPlan]],
                           run_ends: Mapping[str, datetime]) -> dict[tuple[str, str], float]:
    """Spot VM-hours per (zone, GPU type): each plan of a run rented its spot VMs from its own row's
    time until the run's next plan (or the run's end; a run still going counts nothing after its
    last plan, since its end is unknown)."""
    by_run: dict[str, list[tuple[datetime, ParallelPlan]]] = defaultdict(list)
    for run_id, t, pl in plan_rows:
        by_run[run_id].append((t, pl))
    out: dict[tuple[str, str], float] = defaultdict(float)
    for run_id, rows in by_run.items():
        rows.sort(key=lambda r: r[0])
        for i, (t, pl) in enumerate(rows):
            end = rows[i + 1][0] if i + 1 < len(rows) else run_ends.get(run_id)
            if end is None or end <= t:
                continue
            hours = (end - t).total_seconds() / SECONDS_PER_HOUR
            for (z, g, mk), n in plan_nodes(pl).items():
                if mk is Market.SPOT:
                    out[(z, g)] += n * hours
    return dict(out)


def rates_from_history(preemptions: Iterable[tuple[str, str, str | None]],
                       exposure_vm_hours: Mapping[tuple[str, str], float]
                       ) -> dict[tuple[str, str], tuple[float, int, float]]:
    """(zone, GPU type) -> (preemptions per VM-hour, preemptions, VM-hours) for spot markets observed
    at least MIN_EXPOSURE_VM_HOURS. `preemptions`: (zone, gpu_type, market) of each preemption event."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for zone, gpu, market in preemptions:
        if market in (None, Market.SPOT.value):
            counts[(zone, gpu)] += 1
    return {key: (counts.get(key, 0) / hours, counts.get(key, 0), hours)
            for key, hours in exposure_vm_hours.items() if hours >= MIN_EXPOSURE_VM_HOURS}


def reconfiguration_from_history(measured_s: Iterable[float]) -> float | None:
    """The mean measured reconfiguration time (None when none was measured)."""
    xs = [float(x) for x in measured_s if x is not None and math.isfinite(float(x)) and float(x) >= 0]
    return sum(xs) / len(xs) if xs else None
