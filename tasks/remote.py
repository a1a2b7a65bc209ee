"""One-off commands on rented VMs: what the profile subflow runs where the store lacks a profile.

Contract (no Prefect here):
- `VmCommands(provider, controller, state, code, run_id)` rents VMs from the provider's offerings
  (`rent(offering)`, one VM, named `profile-<n>`), runs `sailor <command...>` on several of them at
  once through the same bootstrap as training (infra/bootstrap.py: the run's wheel, the controller,
  the run's secret; `run([(vm, argv), ...])`), and waits until each VM reports its command's exit
  status to the controller (`jobs/<vm id>/<job>`), or the timeout. `release()` terminates every VM
  it rented; it is also what the caller's `finally` calls.
- Commands write their results to object storage under the run's state (`store_uri("vm")` is a
  profile store there, `store_uri("flow")` the same one as the flow reaches it), never to the
  flow's disk.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from infra.provider import Offering, Provider, Vm, VmRequest, WorkerAssignment
from sailor_core.errors import SailorError
from tasks.jobs import CodeRef
from tasks.runstate import RunState, join


class VmCommands:
    def __init__(self, provider: Provider, controller: Any, state: RunState, code: CodeRef, run_id: str,
                 *, poll_s: float = 0.5) -> None:
        self.provider, self.controller, self.state, self.code, self.run_id = provider, controller, state, code, run_id
        self.poll_s = poll_s
        self.rented: list[Vm] = []
        self._jobs = 0

    def store_uri(self, side: str, name: str) -> str:
        """A profile store under the run's state, as the VMs (`vm`) or the flow (`flow`) reach it."""
        return join(self.state.vm_uri if side == "vm" else self.state.flow_uri, "profiles", name)

    def rent(self, offer: Offering) -> Vm:
        req = VmRequest(run_id=self.run_id, name=f"profile-{len(self.rented)}", zone=offer.zone,
                        region=offer.region, gpu_type=offer.gpu_type, gpus=offer.gpus_per_node, market=offer.market,
                        instance_type=offer.instance_type)
        vm = self.provider.provision([req])[0]
        self.rented.append(vm)
        return vm

    def run(self, jobs: Sequence[tuple[Vm, Sequence[str]]], *, timeout_s: float = 900.0) -> dict[str, int]:
        """Run each command on its VM, all at once; returns each VM's exit status. Raises on a timeout."""
        from sailor_core.runtime.protocol import job_key

        self._jobs += 1
        job = 1_000_000 + self._jobs  # job ids live beside plan versions; never the same number
        for vm, argv in jobs:
            self.provider.bootstrap(vm, WorkerAssignment(
                run_id=self.run_id, plan_version=job, plan_json="{}", rendezvous_endpoint=self.controller.endpoint,
                ranks=(), world_size=0, run_secret=self.controller.secret, devices=max(vm.gpus, 1),
                wheel_url=self.code.url, wheel_sha256=self.code.sha256, extras=self.code.extras,
                log_uri=self.state.logs("vm"), advertise_address=vm.address, command=tuple(argv)))
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int] = {}
        exit_code = getattr(self.provider, "agent_exit_code", None)
        gone: dict[str, float] = {}
        failed_at: float | None = None
        while len(codes) < len(jobs):
            for vm, _ in jobs:
                raw = self.controller.server.get(job_key(vm.vm_id, job))
                if raw is not None and vm.vm_id not in codes:
                    codes[vm.vm_id] = int(raw)
                elif raw is None and exit_code is not None and exit_code(vm.vm_id) is not None:
                    # the VM's bootstrap ended without reporting (killed, or failed before the command)
                    if time.monotonic() - gone.setdefault(vm.vm_id, time.monotonic()) > 5.0:
                        codes[vm.vm_id] = int(exit_code(vm.vm_id) or 1) or 1
            if any(codes.values()):
                failed_at = failed_at or time.monotonic()
                if time.monotonic() - failed_at > 5.0:
                    # one end failed: the others (a link's other end waiting for it) would never finish
                    return {vm.vm_id: codes.get(vm.vm_id, 1) for vm, _ in jobs}
            if time.monotonic() > deadline:
                missing = [vm.vm_id for vm, _ in jobs if vm.vm_id not in codes]
                raise SailorError(f"profiling on {missing} did not finish within {timeout_s:.0f}s; to fix: see the "
                                  f"VMs' logs under {self.state.logs('public')}")
            time.sleep(self.poll_s)
        return codes

    def release(self) -> None:
        if self.rented:
            self.provider.terminate([v.vm_id for v in self.rented])
            self.rented = []
