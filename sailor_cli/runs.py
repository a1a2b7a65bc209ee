"""`sailor runs list|show`: the run history kept in the store (runs, events, decisions, plans, measurements).

Contract: `list [--store URI] [--json]` prints every run (id, name, status, start, steps, cost) and
which store it read (the default store is `.sailor/store` under the current folder unless
$SAILOR_STORE says otherwise, so another folder has other runs); runs of the `sailor` flow and of
`sailor train` alike. `show RUN_ID [--store URI] [--json]` prints one run: status, its events in
time order (each with a `kind` such as preemption, price_change, capacity_change, replan,
reconfigured, and its `time`), decisions with their reasons, plans, measured vs estimated iteration
times, and the steps its state recorded (each trained step once; `--json` lists them under
`steps`). `--plot PNG` draws the loss and tokens/s of every step the run saved under its state
(`metrics/v<version>.jsonl`), each reconfiguration marked: the picture of its Prefect "curves"
artifact. A run's state is read where the run kept it: a local folder (also the testbed's object
store, whose objects are plain files that outlive its server), or `<store>/runs/<run id>` of an
s3:// or gs:// store reached with this `--store`'s settings; never a bucket named by a default. An
unknown run id is a one-line error naming recent ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from sailor_cli.options import Json, Store, open_store
from sailor_core.errors import SailorError
from sailor_core.files import check_output_file, write_atomic
from sailor_core.units import sig, usd

app = typer.Typer(help="Runs of the sailor flow: status, events, decisions and plans from the store.",
                  no_args_is_help=True)


@app.command("list")
def list_runs(store: Store = None, as_json: Json = False) -> None:
    """List the runs in the store, oldest first."""
    opened = open_store(store)
    from tasks.history import RunHistory

    runs = RunHistory(opened).list_runs()
    if as_json:
        typer.echo(json.dumps(runs, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    typer.echo(f"{len(runs)} run(s) in the store {opened.uri}")
    t = Table()
    for c in ("run_id", "name", "status", "started (UTC)", "steps", "USD", "wall s"):
        t.add_column(c, no_wrap=c in ("run_id", "started (UTC)"))
    for r in runs:
        t.add_row(r["run_id"], r.get("name", ""), r.get("status", ""), r["started_at"][:19],
                  str(r.get("steps_done", "")), usd(r["usd_total"]) if "usd_total" in r else "",
                  str(r.get("wall_s", "")))
    Console(width=max(Console().width, 130)).print(t)
    if not runs:
        typer.echo("runs made from another folder are in that folder's .sailor/store; to see them: pass --store "
                   "or set SAILOR_STORE", err=True)


@app.command("show")
def show(
    run_id: Annotated[str, typer.Argument(help="a run id from `sailor runs list`")],
    store: Store = None,
    as_json: Json = False,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="draw the run's loss and tokens/s per step, reconfigurations marked, to this PNG")] = None,
) -> None:
    """Show one run: status, events, decisions with reasons, plans, measured vs estimated, steps recorded."""
    if plot is not None:  # a regular file or a new path: a device, folder or link there is refused, not replaced
        check_output_file("--plot", plot)
    opened = open_store(store)
    from tasks.history import RunHistory

    run = RunHistory(opened).show(run_id)
    rows, unread = _steps(run, opened.location.uri)
    if plot is not None:
        _plot(run, rows, unread, plot)
    if as_json:
        run["steps"] = [{k: r.get(k) for k in STEP_FIELDS if k in r} for r in rows]
        if unread:
            run["steps_unread"] = unread
        typer.echo(json.dumps(run, indent=2, default=str))
        return
    _print(run, rows, unread)


STEP_FIELDS = ("step", "plan_version", "loss", "iteration_time_s", "tokens_per_s", "samples", "time")


def _print(run: dict[str, Any], rows: list[Any], unread: str) -> None:
    """The run as tables, for people (full reasons, wrapped at words)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    con = Console(width=max(Console().width, 130))
    # Reasons are text, never markup: a worker's error such as "[/__w/pytorch/...pair.cc:553]" broke the table.
    con.print(f"[bold]{escape(run['run_id'])}[/bold] ({escape(run.get('name', ''))}): [bold]{run.get('status')}"
              f"[/bold] {escape(str(run.get('status_reason', '')))}")
    for k in ("started_at", "ended_at", "steps_done", "usd_total", "wall_s"):
        if k in run:
            con.print(f"  {k}: {usd(run[k]) if k == 'usd_total' else run[k]}")
    con.print(Text(f"  steps recorded: {_steps_line(rows) if rows else unread or 'none'}"))
    t = Table(title="events")
    for c in ("time (UTC)", "kind", "reason"):
        t.add_column(c, no_wrap=c != "reason")
    for e in run["events"]:
        t.add_row(e["time"][11:23], e["kind"], Text(str(e.get("reason", ""))))
    con.print(t)
    t = Table(title="decisions")
    for c in ("time (UTC)", "decision", "reason"):
        t.add_column(c, no_wrap=c != "reason")
    for d in run["decisions"]:
        t.add_row(d["time"][11:23], d["kind"], Text(str(d["reason"])))
    con.print(t)
    t = Table(title="plans")
    for c in ("version", "s/iteration (est.)", "USD/hour", "reason"):
        t.add_column(c, no_wrap=c != "reason")
    for p in run["plans"]:
        est = p.get("estimate") or {}
        t.add_row(str(p["version"]), sig(est.get("iteration_time_s", 0)), usd(est.get("usd_per_hour", 0)),
                  Text(str(p.get("reason", ""))))
    con.print(t)
    meas = [m for m in run["measurements"] if m["kind"] == "iteration_time"]
    if meas:
        t = Table(title="measured vs estimated iteration time")
        for c in ("plan version", "measured s", "estimated s", "ratio"):
            t.add_column(c)
        for m in meas:
            t.add_row(str(m.get("plan_version")), sig(m["measured_s"]), sig(m["estimated_s"]), f"{m['ratio']:.2f}")
        con.print(t)


def _steps_line(rows: list[Any]) -> str:
    """E.g. `1-120, each once (plan v1: 1-29, v2: 30-120)`, or the gaps where steps are missing."""
    steps = [int(r["step"]) for r in rows]
    missing = sorted(set(range(1, steps[-1] + 1)) - set(steps))
    by_version: dict[int, list[int]] = {}
    for r in rows:
        by_version.setdefault(int(r.get("plan_version", 0)), []).append(int(r["step"]))
    parts = ", ".join(f"v{v}: {min(s)}-{max(s)}" for v, s in sorted(by_version.items()))
    gaps = f"; missing {len(missing)}: {_ranges(missing)}" if missing else ""
    return f"{steps[0]}-{steps[-1]}, each once (plan {parts}){gaps}"


def _ranges(steps: list[int]) -> str:
    out, start = [], None
    for i, s in enumerate(steps):
        start = s if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(f"{start}-{s}" if s != start else str(s))
            start = None
    return ", ".join(out)


def _state_uri(run: dict[str, Any], store_uri: str) -> tuple[str | None, str]:
    """Where the run's state can be read now, or why it cannot (see the module's contract)."""
    from tasks.runstate import join

    recorded = (run.get("cluster") or {}).get("state_uri") or ""
    if not recorded:
        return None, "the run recorded no state folder (it trained nothing)"
    if "://" not in recorded:
        return (recorded, "") if Path(recorded).is_dir() else \
            (None, f"its state folder {recorded} is gone (removed with its work folder)")
    if store_uri.startswith(("s3://", "gs://")) and recorded.split("://", 1)[0] == store_uri.split("://", 1)[0]:
        return join(store_uri, "runs", str(run["run_id"])), ""
    # A run from before the testbed's state was named by its folder: the objects are plain files there.
    workdir = (run.get("params") or {}).get("workdir")
    if workdir and recorded.startswith("s3://sailor-runs/"):
        folder = Path(workdir) / "objects" / recorded.removeprefix("s3://")
        if folder.is_dir():
            return str(folder), ""
        return None, (f"its state was on the testbed's object store, whose files were under {folder}, which is "
                      f"gone")
    return None, f"its state is at {recorded}, outside this store; to read it: pass that run's --store"


def _steps(run: dict[str, Any], store_uri: str) -> tuple[list[Any], str]:
    """The run's step records, each trained step once, and why none could be read (empty when read)."""
    from tasks.runstate import RunState, read_metrics

    uri, why = _state_uri(run, store_uri)
    if uri is None:
        return [], why
    try:
        return read_metrics(RunState(uri=uri, flow_uri=uri, vm_uri=uri)), ""
    except SailorError as e:
        return [], f"its state at {uri} cannot be read: {e}"
    except OSError as e:
        return [], f"its state at {uri} cannot be read: {e}"


def _plot(run: dict[str, Any], rows: list[Any], unread: str, out: Path) -> None:
    """The run's training curves from the per-step records under its state, as a PNG."""
    from tasks.reporting import curves_png

    if not rows:
        raise SailorError(f"run {run['run_id']} has no per-step records to plot: "
                          f"{unread or 'it saved none under its state'}; to fix: plot a run that trained at "
                          f"least one step, from the folder (or with the --store) it ran with")
    write_atomic("--plot", out, curves_png(rows, title=f"{run['run_id']} ({run.get('status', '')})"))
    typer.echo(f"wrote {out}: {len(rows)} steps, {len({r.get('plan_version', 0) for r in rows})} plan version(s)",
               err=True)
