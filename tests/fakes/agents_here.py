"""A cloud provider whose VMs are real API objects (moto, the Compute fake) but whose agents run here.

On a real VM the startup script starts the runtime's worker once the assignment arrives. Offline
there is no VM to run it, so `AgentsHere` wraps a cloud provider and does every provider call
through it (the assignment still goes out by SSM or instance metadata), then also runs that VM's
bootstrap (the same script the startup script installs: the run's wheel, then `sailor worker`) as
a process on this machine, as the local provider does. `reclaim(vm)`
plays the cloud taking a spot VM back: its worker is killed like a VM that powers off.
The worker's environment is scrubbed of cloud credentials, as a VM's would lack the controller's.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra.local import default_agent_command, prepare_vm_folder
from infra.provider import Vm, WorkerAssignment

SCRUB = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS")


class AgentsHere:
    def __init__(self, cloud: Any, root: Path) -> None:
        self.cloud = cloud
        self.name = cloud.name
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started: list[str] = []

    # -- delegated -------------------------------------------------------------------------------
    def offerings(self, **kw: Any):
        return self.cloud.offerings(**kw)

    def provision(self, requests, *, dry_run: bool = False):
        return self.cloud.provision(requests, dry_run=dry_run)

    def events(self, run_id: str, *, since=None):
        return self.cloud.events(run_id, since=since)

    def list_vms(self, run_id: str | None = None):
        return self.cloud.list_vms(run_id)

    def terminate(self, vm_ids: Sequence[str]) -> None:
        self.stop_agents(vm_ids)
        self.cloud.terminate(vm_ids)

    def cleanup(self, run_id: str | None = None, *, dry_run: bool = False):
        if not dry_run:
            self.stop_agents([v for v in self.procs])
        return self.cloud.cleanup(run_id, dry_run=dry_run)

    # -- the agent the VM would run ----------------------------------------------------------------
    def bootstrap(self, vm: Vm, assignment: WorkerAssignment) -> None:
        self.cloud.bootstrap(vm, assignment)  # the real hand-off: SSM command or instance metadata
        self.stop_agents([vm.vm_id])
        slot = self.root / vm.vm_id.replace("/", "_")
        slot.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in SCRUB}
        # "The VM" is this machine: its workers meet on loopback, never at the cloud's (fake) address.
        here = dataclasses.replace(assignment, advertise_address="127.0.0.1")
        env.update(prepare_vm_folder(slot, vm, here), PYTHONUNBUFFERED="1")
        log = open(slot / f"agent-v{assignment.plan_version}.log", "ab")
        try:
            self.procs[vm.vm_id] = subprocess.Popen(default_agent_command(vm, assignment, slot), stdout=log,
                                                    stderr=subprocess.STDOUT, env=env, cwd=str(slot),
                                                    start_new_session=True)
        finally:
            log.close()
        self.started.append(vm.vm_id)

    def stop_agents(self, vm_ids: Sequence[str], *, hard: bool = False) -> None:
        for vid in list(vm_ids):
            p = self.procs.pop(vid, None)
            if p is None or p.poll() is not None:
                continue
            try:
                os.killpg(p.pid, signal.SIGKILL if hard else signal.SIGTERM)
                p.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)

    def agent_exit_code(self, vm_id: str) -> int | None:
        p = self.procs.get(vm_id)
        return None if p is None else p.poll()

    def reclaim(self, vm_id: str) -> None:
        """The VM powers off: its worker dies with it."""
        self.stop_agents([vm_id], hard=True)

    def alive(self) -> list[str]:
        return [v for v, p in self.procs.items() if p.poll() is None]
