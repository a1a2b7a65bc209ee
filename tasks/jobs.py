"""A training job as the orchestration sees it: a plan version running on a set of VMs.

Contract (no Prefect here, so it is testable alone):
- `nodes(plan)`: the plan's VMs: its replicas packed into VMs of `gpus_per_node` devices exactly as
  the simulator packs them; `node_requests(run_id, version, plan)` rents them; `vm_matches(vm, node)`
  tells whether a VM already rented can be a node of a new plan, so a reconfiguration provisions
  only the difference (`place`).
- `vm_ranks(job)`: the global ranks each VM runs (stage-major: stage 0 replica 0 gets ranks 0..tp-1,
  then stage 0 replica 1, ...), one per device, so a tp=2 replica runs on one 2-device VM.
- `assignments(job, ...)`: the `WorkerAssignment` of each VM: the plan as JSON, its ranks and devices,
  the world size, the run's controller and secret, the run's wheel, and where checkpoints and logs
  live (the run's state in object storage, tasks/runstate.py: nothing on the flow's disk).
- `Job`: a plan version as it runs; how it started (`ColdStart` on VMs rented for it, or a `Switch`
  from an earlier version) and what monitoring measured of it are typed fields, set as it goes.
- `read_progress(job)`: what the workers reported to the controller (one record per step, at least
  `step`, `loss`, `iteration_time_s`): the highest step finished, recent iteration times, the latest
  loss. Steps count from 1 and are global over plan versions (a resumed worker goes on from the
  checkpoint's step).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from infra.provider import Vm, VmRequest, WorkerAssignment
from sailor_core.domain import ParallelPlan, Replica
from sailor_core.plan_format import plan_to_dict
from sailor_core.simulator.core import place_nodes
from tasks.control import Controller
from tasks.records import MetricRow
from tasks.retention import prune_wheel_cache
from tasks.runstate import RunState, build_wheel, project_root, publish_wheel


@dataclass(frozen=True, kw_only=True)
class Slot:
    stage: int
    replica: int
    spec: Replica

    @property
    def name(self) -> str:
        return f"s{self.stage}r{self.replica}"


def slots(plan: ParallelPlan) -> list[Slot]:
    return [Slot(stage=i, replica=j, spec=r) for i, st in enumerate(plan.stages) for j, r in enumerate(st.replicas)]


@dataclass(frozen=True, kw_only=True)
class Node:
    """One VM of a plan: replicas of one (zone, device type, market) packed into a VM of the replicas'
    `gpus_per_node` devices exactly as the simulator packs them (sailor_core.simulator.place_nodes), so
    replicas the simulator puts on one node (a TP group, or stages that talk over the node's own
    links) share one VM."""

    index: int
    slots: tuple[Slot, ...]

    @property
    def spec(self) -> Replica:
        return self.slots[0].spec

    @property
    def devices(self) -> int:
        return max(self.spec.gpus_per_node, self.used)

    @property
    def used(self) -> int:
        return sum(s.spec.tp for s in self.slots)

    @property
    def name(self) -> str:
        return f"n{self.index}"


def nodes(plan: ParallelPlan) -> list[Node]:

    ids = place_nodes(plan)
    groups: dict[int, list[Slot]] = {}
    for s in slots(plan):
        groups.setdefault(ids[s.stage][s.replica], []).append(s)
    return [Node(index=i, slots=tuple(group)) for i, (_, group) in enumerate(sorted(groups.items()))]


def vm_matches(vm: Vm, node: Node) -> bool:
    r = node.spec
    return vm.gpu_type == r.gpu_type and vm.zone == r.zone and vm.market == r.market and vm.gpus >= node.used


def node_request(run_id: str, version: int, node: Node) -> VmRequest:
    r = node.spec
    return VmRequest(run_id=run_id, name=f"v{version}-{node.name}", zone=r.zone, region=r.region,
                     gpu_type=r.gpu_type, gpus=node.devices, market=r.market)


def node_requests(run_id: str, version: int, plan: ParallelPlan) -> list[VmRequest]:
    return [node_request(run_id, version, n) for n in nodes(plan)]


def place(plan: ParallelPlan, reusable: list[Vm]) -> tuple[dict[int, Vm], list[Node]]:
    """Map the plan's nodes to VMs we already have; return (node index -> VM, nodes still needing a VM)."""
    free = list(reusable)
    placed: dict[int, Vm] = {}
    missing: list[Node] = []
    for n in nodes(plan):
        vm = next((v for v in free if vm_matches(v, n)), None)
        if vm is None:
            missing.append(n)
        else:
            placed[n.index] = vm
            free.remove(vm)
    return placed, missing


@dataclass(frozen=True, kw_only=True)
class CodeRef:
    """The wheel every VM of the run installs (tasks/runstate.py)."""

    url: str = ""
    sha256: str = ""
    extras: str = ""


def ship_code(state: RunState | None, provider: str, *, ship: bool = True) -> CodeRef:
    """This checkout as a wheel beside the run's `state`, for every VM of `provider` to install (an
    empty CodeRef where nothing is shipped: `ship` False or no state; the VMs run what they have).
    The wheel cache keeps only this build (tasks/retention.py)."""
    if not ship or state is None:
        return CodeRef()
    cache = project_root() / "build" / "sailor-wheels"
    wheel = build_wheel(cache)
    prune_wheel_cache(cache, keep=wheel.parent)
    url, sha = publish_wheel(state, wheel)
    return CodeRef(url=url, sha256=sha, extras=provider if provider in ("aws", "gcp") else "")


@dataclass(frozen=True, kw_only=True)
class ColdStart:
    """A plan version started on VMs rented for it: its first step measures the cold start."""

    provisioned_at: float  # wall time the VMs were provisioned
    requested_at: float | None = None  # wall time they were asked for (the VM start is measured from it)
    provider: str = ""  # whose VMs they are (the store keeps VM starts per provider)


@dataclass(frozen=True, kw_only=True)
class Switch:
    """A plan version a reconfiguration started: its first step measures how long the switch took."""

    trigger_at: float  # wall time of the earliest event that triggered the switch
    trigger: tuple[str, ...]  # the kinds of those events (and "iteration_time" for a calibration)
    pids_before: Mapping[str, Mapping[str, int | None]]  # each kept VM's worker pids before the switch
    new_vms: int = 0  # VMs rented for it (0: a switch in place, on VMs already held)


@dataclass(kw_only=True)
class Job:
    run_id: str
    version: int
    plan: ParallelPlan
    vms: list[Vm]  # one per node of the plan (tasks.jobs.nodes), in node order
    run_dir: Path
    total_steps: int
    checkpoint_interval: int
    state: RunState
    seed: int = 0
    data_uri: str = ""
    code: CodeRef = field(default_factory=CodeRef)
    launched_at: float = 0.0
    start_step: int = 0  # steps done when this version launched (the checkpoint it resumes from)
    estimate_s: float = 0.0  # simulator's iteration time for this plan (calibrated)
    controller: Controller | None = None  # one per run, shared by its plan versions
    started_by: ColdStart | Switch | None = None
    members: list[str] = field(default_factory=list)  # the generation's workers in rank order (hand-out)
    # What monitoring measured of this version (tasks/steps.py), set as it trains:
    first_step_at: float | None = None  # wall time of its first trained step
    reconfiguration_s: float | None = None  # a switch: trigger to first step
    cold_start_s: float | None = None  # a cold start: provisioning to first step
    calibrated: bool = False  # measured iteration time compared with the estimate (once a version)

    @property
    def num_layers(self) -> int:
        return self.plan.stages[-1].last_layer + 1


def vm_ranks(job: Job) -> list[tuple[Vm, tuple[int, ...]]]:
    """The global ranks each VM runs: its nodes' replicas' TP ranks (ranks are stage-major, as
    sailor_core.runtime.topology lays them out), one per device."""
    first, rank = {}, 0
    for s in slots(job.plan):
        first[(s.stage, s.replica)] = rank
        rank += s.spec.tp
    out = []
    for n, vm in zip(nodes(job.plan), job.vms, strict=True):
        ranks = [first[(s.stage, s.replica)] + t for s in n.slots for t in range(s.spec.tp)]
        out.append((vm, tuple(ranks)))
    return out


def assign_job(job: Job, *, resume: bool, collective_timeout_s: float = 30.0) -> list[str]:
    """Hand generation `job.version` to every worker of the job's VMs through its run's controller; the
    members, in rank order, are also kept on the job (the generation a plan change ends)."""
    from sailor_core.runtime.engine import TrainSettings  # torch: imported only when a job is handed out

    assert job.controller is not None, "a job is handed out through its run's controller"
    settings = TrainSettings(
        model=job.plan.model, steps=job.total_steps, seed=job.seed, data=job.data_uri or None,
        checkpoint_uri=job.state.checkpoints("vm"), checkpoint_interval=job.checkpoint_interval, resume=resume,
        plan_version=job.version, timeout_s=collective_timeout_s,
    )
    vms = [(vm.vm_id, max(vm.gpus, 1), ranks) for vm, ranks in vm_ranks(job)]
    job.members = job.controller.assign(job.version, plan=job.plan, settings=settings.to_dict(), vms=vms,
                                        resume=resume, start_step=job.start_step, total_steps=job.total_steps)
    return job.members


def assignments(job: Job) -> list[tuple[Vm, WorkerAssignment]]:
    plan_json = json.dumps(plan_to_dict(job.plan))
    world = job.plan.num_gpus
    ctl = job.controller
    out = []
    for n, (vm, ranks) in zip(nodes(job.plan), vm_ranks(job), strict=True):
        out.append((vm, WorkerAssignment(
            run_id=job.run_id, plan_version=job.version, plan_json=plan_json,
            rendezvous_endpoint=ctl.endpoint if ctl else "", ranks=ranks, world_size=world,
            checkpoint_uri=job.state.checkpoints("vm"), data_uri=job.data_uri, model=job.plan.model,
            total_steps=job.total_steps, checkpoint_interval=job.checkpoint_interval, seed=job.seed,
            run_secret=ctl.secret if ctl else "", devices=max(vm.gpus, 1), wheel_url=job.code.url,
            wheel_sha256=job.code.sha256, extras=job.code.extras, log_uri=job.state.logs("vm"),
            first_generation=job.version, advertise_address=vm.address,
            env={"SAILOR_REPLICAS": ",".join(f"s{s.stage}r{s.replica}" for s in n.slots)},
        )))
    return out


@dataclass(frozen=True, kw_only=True)
class Progress:
    step: int  # highest step finished (0: none yet under any version)
    steps_this_version: int  # steps finished since this version launched
    loss: float | None
    recent_iteration_s: float | None  # median of the last few steps of this version
    first_step_at: float | None  # wall time of the first step under this version
    iteration_times: tuple[float, ...] = ()


def read_progress(job: Job, *, warmup_steps: int = 2, window: int = 10) -> Progress:
    rows = job.controller.metrics(job.version) if job.controller is not None else []
    rows_by_step: dict[int, MetricRow] = {}
    for r in rows:
        if "step" in r:
            rows_by_step[int(r["step"])] = cast(MetricRow, {**rows_by_step.get(int(r["step"]), {}),
                                                            **{k: v for k, v in r.items() if v is not None}})
    if not rows_by_step:
        return Progress(
            step=job.start_step, steps_this_version=0, loss=None, recent_iteration_s=None, first_step_at=None
        )
    steps = sorted(rows_by_step)
    top = steps[-1]
    times = [float(rows_by_step[s]["iteration_time_s"]) for s in steps if "iteration_time_s" in rows_by_step[s]]
    steady = times[warmup_steps:] if len(times) > warmup_steps else []
    loss = next((rows_by_step[s].get("loss") for s in reversed(steps) if rows_by_step[s].get("loss") is not None), None)
    first_at = rows_by_step[steps[0]].get("time")
    return Progress(
        step=max(top, job.start_step),
        steps_this_version=len(steps),
        loss=None if loss is None else float(loss),
        recent_iteration_s=statistics.median(steady[-window:]) if steady else None,
        first_step_at=float(first_at) if first_at is not None else None,
        iteration_times=tuple(times),
    )
