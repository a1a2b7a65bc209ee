"""`sailor runs list|show`: the run history kept in the store (runs, events, decisions, plans, measurements).

Contract: `list [--store URI] [--json]` prints every run (id, name, status, start, steps, cost);
`show RUN_ID [--store URI] [--json]` prints one run: status, its events in time order (each with a
`kind` such as preemption, price_change, capacity_change, replan, reconfigured, and its `time`),
decisions with their reasons, plans and measured vs estimated iteration times. `--json` prints one
JSON document. `--plot PNG` draws the loss and tokens/s of every step the run saved under its state
(`metrics/v<version>.jsonl`), each reconfiguration marked: the picture of its Prefect "curves" artifact.
An unknown run id is a one-line error naming recent ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from sailor_cli.options import Json, Store, open_store
from sailor_core.errors import SailorError

app = typer.Typer(help="Runs of the sailor flow: status, events, decisions and plans from the store.",
                  no_args_is_help=True)


def _history(store: str | None) -> Any:
    from tasks.history import RunHistory

    return RunHistory(open_store(store))


@app.command("list")
def list_runs(store: Store = None, as_json: Json = False) -> None:
    """List the runs in the store, oldest first."""
    runs = _history(store).list_runs()
    if as_json:
        typer.echo(json.dumps(runs, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{len(runs)} run(s)")
    for c in ("run_id", "name", "status", "started (UTC)", "steps", "USD", "wall s"):
        t.add_column(c, no_wrap=True)
    for r in runs:
        t.add_row(r["run_id"], r.get("name", ""), r.get("status", ""), r["started_at"][:19],
                  str(r.get("steps_done", "")), f"{r['usd_total']:.6f}" if "usd_total" in r else "",
                  str(r.get("wall_s", "")))
    Console(width=max(Console().width, 130)).print(t)


@app.command("show")
def show(
    run_id: Annotated[str, typer.Argument(help="a run id from `sailor runs list`")],
    store: Store = None,
    as_json: Json = False,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="draw the run's loss and tokens/s per step, reconfigurations marked, to this PNG")] = None,
) -> None:
    """Show one run: status, events, decisions with reasons, plans, measured vs estimated."""
    run = _history(store).show(run_id)
    if plot is not None:
        _plot(run, plot)
    if as_json:
        typer.echo(json.dumps(run, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 130))
    con.print(f"[bold]{run['run_id']}[/bold] ({run.get('name', '')}): [bold]{run.get('status')}[/bold] "
              f"{run.get('status_reason', '')}")
    for k in ("started_at", "ended_at", "steps_done", "usd_total", "wall_s"):
        if k in run:
            con.print(f"  {k}: {run[k]}")
    t = Table(title="events")
    for c in ("time (UTC)", "kind", "reason"):
        t.add_column(c)
    for e in run["events"]:
        t.add_row(e["time"][11:23], e["kind"], e.get("reason", ""))
    con.print(t)
    t = Table(title="decisions")
    for c in ("time (UTC)", "decision", "reason"):
        t.add_column(c)
    for d in run["decisions"]:
        t.add_row(d["time"][11:23], d["kind"], d["reason"])
    con.print(t)
    t = Table(title="plans")
    for c in ("version", "s/iteration (est.)", "USD/hour", "reason"):
        t.add_column(c)
    for p in run["plans"]:
        est = p.get("estimate") or {}
        t.add_row(str(p["version"]), f"{est.get('iteration_time_s', 0):.4f}", f"{est.get('usd_per_hour', 0):.4f}",
                  str(p.get("reason", ""))[:120])
    con.print(t)
    meas = [m for m in run["measurements"] if m["kind"] == "iteration_time"]
    if meas:
        t = Table(title="measured vs estimated iteration time")
        for c in ("plan version", "measured s", "estimated s", "ratio"):
            t.add_column(c)
        for m in meas:
            t.add_row(str(m.get("plan_version")), f"{m['measured_s']:.4f}", f"{m['estimated_s']:.4f}",
                      f"{m['ratio']:.2f}")
        con.print(t)


def _plot(run: dict[str, Any], out: Path) -> None:
    """The run's training curves from the per-step records under its state, as a PNG."""
    from tasks.reporting import curves_png
    from tasks.runstate import RunState, read_metrics

    uri = (run.get("cluster") or {}).get("state_uri")
    if not uri:
        raise SailorError(f"run {run['run_id']} recorded no state folder, so no per-step records to plot; to fix: "
                          f"plot a run of the sailor flow that trained")
    if "://" not in uri and not Path(uri).is_dir():
        raise SailorError(f"run {run['run_id']}'s state folder {uri} is gone; to fix: plot a run whose work folder "
                          f"is still there")
    if out.is_dir():
        raise SailorError(f"--plot {out} is a folder; to fix: name a .png file")
    try:
        rows = read_metrics(RunState(uri=uri, flow_uri=uri, vm_uri=uri))
    except SailorError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. the testbed's object store, which lived with the run
        raise SailorError(f"could not read the per-step records under {uri}: {e}; to fix: plot while its "
                          f"storage is reachable") from None
    if not rows:
        raise SailorError(f"run {run['run_id']} saved no per-step records under {uri}; to fix: plot a run that "
                          f"trained at least one step")
    out.write_bytes(curves_png(rows, title=f"{run['run_id']} ({run.get('status', '')})"))
    typer.echo(f"wrote {out}: {len(rows)} steps, {len({r.get('plan_version', 0) for r in rows})} plan version(s)",
               err=True)
