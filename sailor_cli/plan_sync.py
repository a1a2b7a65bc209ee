"""`sailor plan --sync semi[:H]|auto`: the answer of the semi-synchronous planner (planner/islands.py).

Contract: `answer(request, book, mode, out=..., as_json=...)` runs `plan_with_sync`, writes the chosen
plan to `out` (an island plan, format "sailor-islands", or a plan file when the synchronous plan was
kept), and prints either tables or one JSON object: feasible, sync ("every-step" or "semi:H"), plan,
estimate (the keys of `sailor simulate --json`'s top level; an island plan's also "semi_sync" and
"islands"), summary, explanation, frontier (synchronous and semi-synchronous plans side by side:
sync, iterations_per_s, tokens_per_s, usd_per_million_tokens, usd_per_iteration,
egress_usd_per_iteration, num_gpus, summary, chosen), synchronous (the every-step plan's summary and
estimate), search_time_s. Exit 1 when nothing is feasible.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import typer

from sailor_core.plan_format import plan_to_dict, save_plan_file
from sailor_core.planner import PlanRequest, summarize
from sailor_core.planner.islands import SyncMode, SyncPlanResult, plan_with_sync, summarize_islands
from sailor_core.profiles import ProfileBook
from sailor_core.semisync import islands_to_dict


def to_json(r: SyncPlanResult, search_time_s: float) -> dict[str, Any]:
    s = r.synchronous
    c = r.chosen
    if c is not None and c.plan is not None and c.estimate is not None:
        plan: Any = islands_to_dict(c.plan)
        estimate: Any = c.estimate.to_json()
        summary = summarize_islands(c.plan)
    else:
        plan = plan_to_dict(s.plan) if s.plan is not None else None
        estimate = s.estimate.to_json() if s.estimate is not None else None
        summary = summarize(s.plan) if s.plan is not None else ""
    return {
        "feasible": plan is not None,
        "sync": r.sync_label,
        "plan": plan,
        "estimate": estimate,
        "summary": summary,
        "explanation": r.explanation,
        "nearest_miss": s.nearest_miss,
        "frontier": r.frontier(),
        "synchronous": {"summary": summarize(s.plan) if s.plan is not None else "",
                        "estimate": s.estimate.to_json() if s.estimate is not None else None},
        "search_time_s": search_time_s,
    }


def _print(r: SyncPlanResult, out: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 160)
    c = r.chosen
    if c is not None and c.plan is not None:
        con.print(f"[bold]plan[/bold] ({r.sync_label}): {summarize_islands(c.plan)}")
    elif r.synchronous.plan is not None:
        con.print(f"[bold]plan[/bold] (every-step): {summarize(r.synchronous.plan)}")
    else:
        con.print(f"[red]no feasible plan[/red]: {r.synchronous.nearest_miss}")
    con.print(r.explanation)
    if out:
        con.print(f"written to {out}")
    t = Table(title="synchronous and semi-synchronous plans (simulated)")
    for h in ("sync", "it/s", "tokens/s", "USD/M tokens", "egress USD/it", "GPUs", "plan"):
        t.add_column(h)
    for row in r.frontier():
        egress = row["egress_usd_per_iteration"]
        t.add_row(row["sync"], f"{row['iterations_per_s']:.4f}", f"{row['tokens_per_s']:,.0f}",
                  f"{row['usd_per_million_tokens']:.4f}", "-" if egress is None else f"{egress:.5f}",
                  str(row["num_gpus"]), ("(chosen) " if row["chosen"] else "") + row["summary"])
    con.print(t)


def answer(request: PlanRequest, book: ProfileBook, mode: SyncMode, *, out: str | None, as_json: bool) -> None:
    """Plan under `mode`, write, print (see the module's contract); exit 1 when nothing is feasible."""
    t0 = time.perf_counter()
    r = plan_with_sync(request, book, mode)
    elapsed = time.perf_counter() - t0
    c = r.chosen
    if out and c is not None and c.plan is not None:
        from pathlib import Path

        Path(out).write_text(json.dumps(islands_to_dict(c.plan), indent=1) + "\n")
    elif out and r.synchronous.plan is not None:
        save_plan_file(r.synchronous.plan, out)
    if as_json:
        typer.echo(json.dumps(to_json(r, elapsed)))
    else:
        _print(r, out)
    if (c is None or c.plan is None) and r.synchronous.plan is None:
        raise SystemExit(1)
