"""One-off commands on rented VMs: what the profile subflow runs where the store lacks a profile.

Contract (no Prefect here):
- `VmCommands(provider, controller, state, code, run_id)` rents VMs from the provider's offerings
  (`rent(offering)`, one VM, named `profile-<n>`), runs `sailor <command...>` on several of them at
  once through the same bootstrap as training (infra/bootstrap.py: the run's wheel, the controller,
  the run's secret; `run([(vm, argv), ...])`), and waits until each VM reports its command's exit
  status to the controller (`jobs/<vm id>/<job>`), or the timeout. Each VM keeps its command's output
  under the run's logs before it reports (infra/bootstrap.py): `output(vm_id)` reads the last job's,
  and `failure(codes)` turns failed exit statuses into an error that quotes it. `release()` terminates
  every VM it rented; it is also what the caller's `finally` calls.
- Commands write their results to object storage under the run's state (`store_uri("vm")` is a
  profile store there, `store_uri("flow")` the same one as the flow reaches it), never to the
  flow's disk.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from infra.provider import AgentExitCodes, Provider, Vm, VmRequest, WorkerAssignment
from sailor_core.domain import Capacity
from sailor_core.errors import Failure, SailorError
from sailor_core.runtime.protocol import job_key
from tasks.control import Controller
from tasks.jobs import CodeRef
from tasks.runstate import RunState, join

UNFINISHED = -1  # the exit status `run` gives a VM whose command was still running when another one's failed


class VmCommands:
    def __init__(self, provider: Provider, controller: Controller, state: RunState, code: CodeRef, run_id: str,
                 *, poll_s: float = 0.5) -> None:
        self.provider, self.controller, self.state, self.code, self.run_id = provider, controller, state, code, run_id
        self.poll_s = poll_s
        self.rented: list[Vm] = []
        self._jobs = 0
        self.job = 0  # the last job's id

    def store_uri(self, side: str, name: str) -> str:
        """A profile store under the run's state, as the VMs (`vm`) or the flow (`flow`) reach it."""
        return join(self.state.vm_uri if side == "vm" else self.state.flow_uri, "profiles", name)

    def rent(self, offer: Capacity) -> Vm:
        req = VmRequest(run_id=self.run_id, name=f"profile-{len(self.rented)}", zone=offer.zone,
                        region=offer.region, gpu_type=offer.gpu_type, gpus=offer.gpus_per_vm, market=offer.market,
                        instance_type=offer.instance_type)
        vm = self.provider.provision([req])[0]
        self.rented.append(vm)
        return vm

    def run(self, jobs: Sequence[tuple[Vm, Sequence[str]]], *, timeout_s: float = 900.0) -> dict[str, int]:
        """Run each command on its VM, all at once; returns each VM's exit status (`UNFINISHED` for one still
        running 5 s after another failed: a link's other end would wait for ever). Raises on a timeout."""

        self._jobs += 1
        job = self.job = 1_000_000 + self._jobs  # job ids live beside plan versions; never the same number
        for vm, argv in jobs:
            self.provider.bootstrap(vm, WorkerAssignment(
                run_id=self.run_id, plan_version=job, plan_json="{}", rendezvous_endpoint=self.controller.endpoint,
                ranks=(), world_size=0, run_secret=self.controller.secret, devices=max(vm.gpus, 1),
                wheel_url=self.code.url, wheel_sha256=self.code.sha256, extras=self.code.extras,
                log_uri=self.state.logs("vm"), advertise_address=vm.address, command=tuple(argv)))
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int] = {}
        exit_code = self.provider.agent_exit_code if isinstance(self.provider, AgentExitCodes) else None
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
                    return {vm.vm_id: codes.get(vm.vm_id, UNFINISHED) for vm, _ in jobs}
            if time.monotonic() > deadline:
                missing = [vm.vm_id for vm, _ in jobs if vm.vm_id not in codes]
                raise SailorError(f"profiling on {missing} did not finish within {timeout_s:.0f}s; to fix: see the "
                                  f"VMs' logs under {self.state.logs('public')}")
            time.sleep(self.poll_s)
        return codes

    def output(self, vm_id: str, *, tail_chars: int = 1500) -> str:
        """The end of what the last job's command printed on `vm_id` ('' when the VM kept nothing)."""
        from sailor_core.runtime.checkpoint import open_storage

        try:
            text = open_storage(self.state.logs("flow")).read(f"jobs/{vm_id}-{self.job}.log").decode(errors="replace")
        except Exception:  # noqa: BLE001 - the VM died before it kept its output: say so, do not fail here
            return ""
        return text[-tail_chars:]

    def failure(self, what: str, codes: dict[str, int]) -> Failure:
        """The error of a job whose commands failed on some VMs: each one's exit status and output's end."""
        parts = []
        for vm_id, rc in codes.items():
            if rc == UNFINISHED:
                parts.append(f"{vm_id} had not finished when another VM's command failed")
            elif rc:
                out = self.output(vm_id).strip() or "(no output kept: the VM ended before its command did)"
                parts.append(f"{vm_id} exited {rc}:\n{out}")
        where = join(self.state.logs("public"), "jobs", f"<vm>-{self.job}.log")
        return Failure(f"{what} failed on the VMs; to fix: read their output below (kept in {where})\n"
                           + "\n".join(parts))

    def release(self) -> None:
        if self.rented:
            self.provider.terminate([v.vm_id for v in self.rented])
            self.rented = []
