"""`sailor worker`: the per-VM agent. Runs one worker process per device; they take their work from the controller.

Contract: see sailor_core.runtime.agent, sailor_core.runtime.protocol and docs/runtime.md. The run's
secret comes from $SAILOR_RUN_SECRET (never a flag: command lines are visible to every user of the
VM). Exit code 0 when its workers finish or the agent is stopped (SIGTERM), 1 when a worker fails,
2 on bad input.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from sailor_core.domain import SailorError


def worker(
    control: str = typer.Option(..., "--control", envvar="SAILOR_CONTROL", help="The run's controller, HOST:PORT"),
    vm_id: str = typer.Option(..., "--vm-id", envvar="SAILOR_VM_ID", help="This VM's id within the run"),
    devices: int = typer.Option(1, "--devices", envvar="SAILOR_DEVICES", help="Devices (GPUs) on this VM: one worker each"),
    run_dir: Path = typer.Option(Path("sailor-vm"), "--run-dir", help="This VM's folder for worker logs"),
    log_uri: str | None = typer.Option(None, "--log-uri", envvar="SAILOR_LOG_URI",
                                       help="Copy worker logs here (the run's state in object storage)"),
    advertise_addr: str = typer.Option("127.0.0.1", "--advertise-addr", envvar="SAILOR_ADVERTISE_ADDR",
                                       help="The address other VMs reach this one at"),
    first_generation: int = typer.Option(0, "--first-generation", envvar="SAILOR_FIRST_GENERATION",
                                         help="The generation to wait for first (a VM joining a running job)"),
    events_out: Path | None = typer.Option(None, "--events-out", help="Append JSON-line events here (default: stdout)"),
    heartbeat_s: float = typer.Option(2.0, "--heartbeat", help="Seconds between heartbeats"),
    grace_s: float = typer.Option(30.0, "--grace", help="Seconds workers get to checkpoint when stopped"),
) -> None:
    """Run this VM's share of a training job: one worker per device, heartbeats, logs."""
    from sailor_core.runtime.agent import WorkerAgent
    from sailor_core.runtime.protocol import SECRET_ENV

    secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise SailorError(f"no run secret; to fix: set ${SECRET_ENV} to the secret the run's controller was given")
    if devices < 1:
        raise SailorError(f"--devices must be >= 1, got {devices}; to fix: pass the VM's GPU count")
    out = open(events_out, "a") if events_out else sys.stdout  # noqa: SIM115 - closed below
    try:
        code = WorkerAgent(control, vm_id, devices, secret=secret, run_dir=str(run_dir.resolve()), log_uri=log_uri,
                           events=out, heartbeat_s=heartbeat_s, grace_s=grace_s, first_generation=first_generation,
                           advertise_addr=advertise_addr).run()
    finally:
        if out is not sys.stdout:
            out.close()
    if code:
        raise typer.Exit(code)
