"""The orchestration's side of the worker control protocol (sailor_core/runtime/protocol.py).

Contract (no Prefect):
- `Controller(host=...)`: one per run. Its server binds `host`, the one address the run's VMs reach
  the flow at (loopback for VMs on this machine, the testbed's bridge address, the flow's VM
  address on a cloud), and refuses any client without the run's `secret`. Plan version v is
  generation v: `assign(version, plan=..., settings=..., vms=..., ...)` hands every worker of every VM
  its assignment (one worker per device; a job's ranks per VM: tasks/jobs.assign_job, which calls it);
  `heartbeats(vm_ids)` reads the agents' beats,
  `statuses(vm_ids, version)` what each VM's workers reported at the end of a generation (a VM is
  `failed: ...` as soon as one of its workers is), `metrics(version)` the per-step records.
- `HeartbeatBoard`: the latest heartbeat time and training step per VM, written by the monitor from
  the controller and read by the local provider (its `heartbeats` source), so a hung worker is found
  by the provider's own timeout the same way a dead one is. Once it `follow`s the run's controller,
  a read also sees the beats the controller got since: a flow busy elsewhere (a replan, a Prefect
  call that waits) never makes a healthy VM look silent.
- Scripted steps: `hold_steps` (the provider's scripted event steps) go into each generation's
  assignment; rank 0 holds at such a step (`held()`) until `release`d (tasks/pump.py).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from infra.provider import Vm
from sailor_core.domain import ParallelPlan
from sailor_core.plan_format import plan_to_dict
from sailor_core.runtime.protocol import (
    ControlServer,
    abort_key,
    assign_generation,
    heartbeat_key,
    held_key,
    loaded_key,
    metrics_key,
    release_key,
    status_key,
    stop_key,
    vm_heartbeat_key,
    worker_id,
)
from tasks.records import MetricRow

# Each VM's worker processes as its agent reported them: {vm id: {worker id: pid, or None once exited}}.
WorkerPids = dict[str, dict[str, int | None]]


class HeartbeatBoard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._beats: dict[str, dict[str, float]] = {}
        self._controller: Controller | None = None

    def follow(self, controller: Controller) -> None:
        """Reads also see the beats `controller` received (by its clock), however long ago the monitor looked."""
        self._controller = controller

    def beat(self, vm_id: str, *, at: float | None = None, step: int | None = None) -> None:
        with self._lock:
            cur = dict(self._beats.get(vm_id, {}))
            if at is not None:
                cur["time"] = max(at, cur.get("time", 0.0))
            if step is not None:
                cur["step"] = step
            self._beats[vm_id] = cur

    def get(self, vm_id: str) -> dict[str, float] | None:
        with self._lock:
            b = dict(self._beats.get(vm_id) or {})
        ctl = self._controller
        at = ctl.heartbeats([vm_id]).get(vm_id) if ctl is not None else None
        if at is not None:
            b["time"] = max(at, b.get("time", 0.0))
        return b or None

    def max_step(self) -> int:
        """The highest training step any VM was seen at (0: none yet)."""
        with self._lock:
            return max((int(b.get("step") or 0) for b in self._beats.values()), default=0)


def checkpoint_steps(checkpoint_uri: str, num_layers: int, *, retry_s: float | None = None) -> int | None:
    """Newest complete checkpoint step under the folder (None: there is none). Only "not found" means
    none: an object store that keeps failing raises StorageUnavailable after `retry_s` of retries
    (default checkpoint_storage.STORAGE_RETRY_S), so a hiccup never restarts a job from step 0."""
    from sailor_core.runtime import checkpoint as ckpt

    storage = ckpt.open_storage(checkpoint_uri, **({} if retry_s is None else {"retry_s": retry_s}))
    return ckpt.latest_valid_step(storage, num_layers)


class Controller:
    def __init__(self, *, host: str = "127.0.0.1") -> None:

        self.server = ControlServer(host=host)
        self.endpoint, self.secret = self.server.endpoint, self.server.secret
        self._devices: dict[str, int] = {}
        self._metrics: dict[int, list[MetricRow]] = {}
        self.flushed: dict[int, int] = {}  # rows of each version saved under the run's state (tasks/steps.py)
        # The steps of scripted events still to come (a ScriptedEvents provider's): generations hold there.
        self.hold_steps: Callable[[], Sequence[int]] = tuple
        self.generation = -1  # the newest generation handed out, and its VMs
        self.generation_vms: list[str] = []

    def assign(self, version: int, *, plan: ParallelPlan, settings: Mapping[str, object],
               vms: Sequence[tuple[str, int, tuple[int, ...]]], resume: bool, start_step: int,
               total_steps: int) -> list[str]:
        """Generation `version` of `plan` for every worker of `vms` ((VM id, devices, global ranks) each),
        with the workers' training `settings` (TrainSettings.to_dict()); returns the members in rank order.
        The generation holds at the scripted steps after `start_step` (up to `total_steps`)."""

        self._devices.update({v: n for v, n, _ in vms})
        holds = tuple(s for s in self.hold_steps() if start_step < s <= total_steps)
        members = assign_generation(self.server, version, plan=plan_to_dict(plan), settings=dict(settings),
                                    resume=resume, vms=list(vms), hold_at_steps=holds)
        self.generation, self.generation_vms = version, [v for v, _, _ in vms]
        return members

    def held(self) -> tuple[int, int] | None:
        """(generation, step) when the newest generation's rank 0 holds at a step not yet released."""

        gen = self.generation
        raw = self.server.get(held_key(gen)) if gen >= 0 else None
        if raw is None or not raw.isdigit() or self.server.get(release_key(gen, int(raw))) is not None:
            return None
        return gen, int(raw)

    def release(self, gen: int, step: int) -> None:
        """Let generation `gen` go on past `step`."""

        self.server.set(release_key(gen, step), "released")

    def metric_versions(self) -> list[int]:
        """The plan versions whose workers reported step records (this process's view)."""
        return [v for v in range(self.generation + 1) if self.metrics(v)]

    def watch(self, vms: list[Vm]) -> None:
        """Know these VMs' device counts before they are handed a generation (for `ready`)."""
        self._devices.update({v.vm_id: max(v.gpus, 1) for v in vms})

    def heartbeats(self, vm_ids: list[str]) -> dict[str, float]:

        # When a beat arrived, by this machine's clock (a VM's clock or a slow answer must not make it
        # late), from the agent or any of its workers: a VM is alive while any of them beats.
        out = {}
        for v in vm_ids:
            keys = [vm_heartbeat_key(v)] + [heartbeat_key(worker_id(v, i)) for i in range(self._devices.get(v, 1))]
            times = [t for k in keys if (t := self.server.received_at(k)) is not None]
            if times:
                out[v] = max(times)
        return out

    def statuses(self, vm_ids: list[str], version: int) -> dict[str, str]:

        out = {}
        for v in vm_ids:
            got = [s for i in range(self._devices.get(v, 1))
                   if (s := self.server.get(status_key(version, worker_id(v, i)))) is not None]
            failed = [s for s in got if s.startswith("failed")]
            if failed:
                out[v] = failed[0]
            elif got:
                out[v] = "stopped" if "stopped" in got else got[0]
        return out

    def worker_pids(self, vm_ids: list[str]) -> WorkerPids:
        """Each VM's worker processes as its agent last reported them: {worker id: pid, or None if exited}."""

        out = {}
        for v in vm_ids:
            raw = self.server.get(vm_heartbeat_key(v))
            if raw is not None:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    out[v] = dict(json.loads(raw)["workers"])
        return out

    def loaded_from(self, version: int) -> dict[str, int]:
        """How the workers of generation `version` got their state: counts of memory / checkpoint / none."""

        counts: dict[str, int] = {}
        for v, n in self._devices.items():
            for i in range(n):
                how = self.server.get(loaded_key(version, worker_id(v, i)))
                if how is not None:
                    counts[how] = counts.get(how, 0) + 1
        return counts

    def end_generation(
        self, version: int, members: list[str], *, broken: bool, timeout_s: float = 60.0
    ) -> dict[str, str]:
        """Ask generation `version` to stop at its next step with a checkpoint (its workers go on to the
        next generation, state kept); a broken one (a member lost) is aborted instead. Waits until
        every member reported, or `timeout_s`; returns their statuses."""

        self.server.set(abort_key(version) if broken else stop_key(version), "plan change")
        deadline = time.monotonic() + timeout_s
        while True:
            got = {w: s for w in members if (s := self.server.get(status_key(version, w))) is not None}
            if len(got) == len(members) or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def ready(self, vm_ids: list[str]) -> bool:
        """Whether every worker of these VMs has started (beats its heartbeat)."""

        return all(self.server.get(heartbeat_key(worker_id(v, i))) is not None
                   for v in vm_ids for i in range(self._devices.get(v, 1)))

    def metrics(self, version: int) -> list[MetricRow]:

        rows = self._metrics.setdefault(version, [])
        for line in self.server.read_list(metrics_key(version), start=len(rows)):
            try:
                rows.append(json.loads(line))  # a worker's step record (sailor_core/runtime/engine.py)
            except ValueError:
                rows.append({})
        return rows

    def close(self) -> None:
        self.server.close()


def now() -> float:
    return time.time()
