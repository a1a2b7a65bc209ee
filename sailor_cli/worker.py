"""`sailor worker`: the per-VM agent. Reads its assignment, runs its ranks, reports JSON lines.

Contract: see sailor_core.runtime.agent and docs/runtime.md. Exit code 0 when its ranks finish or
the run is cancelled (SIGTERM, or "cancel": true in the assignment), 1 when they fail.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer


def worker(
    assignment: Path = typer.Option(..., "--assignment", help="Assignment JSON file (rewritten for each plan version)"),
    events_out: Path | None = typer.Option(None, "--events-out", help="Append JSON-line events here (default: stdout)"),
    vm_id: str = typer.Option("", "--vm-id", help="Name of this VM in events (default: hostname)"),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Directory for worker logs and per-rank metrics"),
    heartbeat_s: float = typer.Option(2.0, "--heartbeat", help="Seconds between heartbeats"),
    grace_s: float = typer.Option(30.0, "--grace", help="Seconds workers get to checkpoint when cancelled"),
) -> None:
    """Run this VM's share of a training job and report heartbeats, metrics and status."""
    from sailor_core.runtime.agent import WorkerAgent

    out = open(events_out, "a") if events_out else sys.stdout  # noqa: SIM115 - closed below
    try:
        code = WorkerAgent(str(assignment), events=out, vm_id=vm_id, run_dir=str(run_dir) if run_dir else None,
                           heartbeat_s=heartbeat_s, grace_s=grace_s).run()
    finally:
        if out is not sys.stdout:
            out.close()
    if code:
        raise typer.Exit(code)
