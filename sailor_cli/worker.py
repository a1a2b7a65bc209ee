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
from typing import Annotated

import typer

from sailor_core.errors import SailorError


def worker(
    control: Annotated[str, typer.Option("--control", envvar="SAILOR_CONTROL", help="the run's controller, HOST:PORT")],
    vm_id: Annotated[str, typer.Option("--vm-id", envvar="SAILOR_VM_ID", help="this VM's id within the run")],
    devices: Annotated[int, typer.Option(
        "--devices", envvar="SAILOR_DEVICES", help="devices (GPUs) on this VM: one worker each")] = 1,
    run_dir: Annotated[Path, typer.Option("--run-dir", help="this VM's folder for worker logs")] = Path("sailor-vm"),
    log_uri: Annotated[str | None, typer.Option(
        "--log-uri", envvar="SAILOR_LOG_URI", help="copy worker logs here (the run's state in object storage)")] = None,
    advertise_addr: Annotated[str, typer.Option(
        "--advertise-addr", envvar="SAILOR_ADVERTISE_ADDR",
        help="the address other VMs reach this one at")] = "127.0.0.1",
    first_generation: Annotated[int, typer.Option(
        "--first-generation", envvar="SAILOR_FIRST_GENERATION",
        help="the generation to wait for first (a VM joining a running job)")] = 0,
    events_out: Annotated[Path | None, typer.Option(
        "--events-out", help="append JSON-line events here (default: stdout)")] = None,
    heartbeat_s: Annotated[float, typer.Option("--heartbeat", help="seconds between heartbeats")] = 2.0,
    grace_s: Annotated[float, typer.Option("--grace", help="seconds workers get to checkpoint when stopped")] = 30.0,
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
