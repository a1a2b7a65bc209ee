"""`sailor plan`: the best plan for a pool of GPUs, its estimate, the cost/throughput frontier, what-ifs.

Contract: reads the pool file (docs/planner.md) and the model's ProfileBook (the same loader as
`sailor simulate`, sailor_cli.options.load_book, so `sailor simulate` on the written plan gives the
same estimate when the pool's prices are the store's), runs `sailor_core.planner.plan`, and prints a
readable answer, or one JSON object with --json: plan, estimate (the keys of `sailor simulate --json`),
search_time_s, frontier, explanation, nearest_miss, stats and what_if. An infeasible request prints the
nearest miss and exits 1; user errors are `SailorError`s (one line with the fix, exit 2).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from sailor_cli import plan_sync
from sailor_cli.options import (
    CheckpointInterval,
    Clouds,
    GlobalBatchSize,
    GpuTypes,
    Json,
    Markets,
    MaxGpus,
    MaxUsdPerHour,
    MaxUsdPerIteration,
    MinIterationsPerS,
    Model,
    ModelConfig,
    ObjectiveName,
    ReconfigurationS,
    Regions,
    SeqLen,
    Store,
    Zones,
    load_model_book,
    split_values,
)
from sailor_core.domain import MAX_PLAIN_GLOBAL_BATCH, Market
from sailor_core.errors import SailorError
from sailor_core.files import check_output_files, shown_path, write_atomic
from sailor_core.plan_format import plan_to_dict, save_plan_file
from sailor_core.planner import (
    Constraints,
    Objective,
    PlanRequest,
    PlanResult,
    Restrictions,
    SearchOptions,
    apply_what_if,
    parse_pool,
    summarize,
)
from sailor_core.planner import (
    plan as run_planner,
)
from sailor_core.planner.islands import SyncMode
from sailor_core.planner.pool import parse_preemption_rates, read_pool_document
from sailor_core.planner.request import stage_range
from sailor_core.planner.risk import AUTO_CHECKPOINT_INTERVAL, SpotRisk, planning_checkpoint_interval
from sailor_core.units import sig, usd

# `sailor plan` stops searching after this long unless told otherwise (a pool of thousands of GPUs in many
# zones; the answer then says how far from optimal it may be).
DEFAULT_MAX_SEARCH_S = 60.0


def plan(
    pool_file: Annotated[str, typer.Option("--pool", help="pool file (YAML or JSON), see docs/planner.md")],
    global_batch_size: GlobalBatchSize,
    model: Model = None,
    objective: ObjectiveName = "max-throughput",
    max_usd_per_iteration: MaxUsdPerIteration = None,
    max_usd_per_hour: MaxUsdPerHour = None,
    min_iterations_per_s: MinIterationsPerS = None,
    clouds: Clouds = None,
    regions: Regions = None,
    zones: Zones = None,
    gpu_types: GpuTypes = None,
    markets: Markets = None,
    max_gpus: MaxGpus = None,
    store: Store = None,
    out: Annotated[str | None, typer.Option("--out", help="write the plan here (sailor plan format)")] = None,
    as_json: Json = False,
    what_if: Annotated[list[str] | None, typer.Option("--what-if", help=(
        "re-plan with a change, e.g. '+16 V100-16 in us-west1-b' or 'A100-40 spot price +30%'"))] = None,
    model_config: ModelConfig = None,
    seq_len: SeqLen = None,
    frontier_png: Annotated[str | None, typer.Option(
        "--frontier-png", help="plot the throughput/cost frontier to this PNG")] = None,
    wide_frontier: Annotated[bool, typer.Option("--wide-frontier", help=(
        "frontier from cheapest to fastest (about 2x search time; on with --frontier-png)"))] = False,
    checkpoint_interval: CheckpointInterval = AUTO_CHECKPOINT_INTERVAL,
    reconfiguration_s: ReconfigurationS = None,
    large_batch: Annotated[bool, typer.Option("--large-batch", help=(
        f"plan a global batch above {MAX_PLAIN_GLOBAL_BATCH} sequences (refused without it)"))] = False,
    stages: Annotated[str | None, typer.Option("--stages", help=(
        "pipeline stages: N (exactly N) or a range A-B (default: as many as pay)"))] = None,
    recompute: Annotated[str, typer.Option("--recompute", help=(
        "activation recomputation: auto (when nothing fits without it, on the stages that need it), never, "
        "always (every stage)"))] = "auto",
    sync: Annotated[str, typer.Option("--sync", help=(
        "every-step (default: synchronous), semi[:H] (islands per region, an outer step every H steps; H "
        "chosen when left out), auto (islands only where they beat every-step by 10 % on the objective); "
        "docs/semisync.md"))] = "every-step",
    outer_compression: Annotated[str, typer.Option("--outer-compression", help=(
        "what islands send at an outer step: none (fp32), bf16, int8"))] = "none",
    max_search_s: Annotated[float, typer.Option("--max-search-s", help=(
        "time budget of the search in seconds: it stops there with the best plan it found and says how much "
        "better a plan of what it left unsearched could be"))] = DEFAULT_MAX_SEARCH_S,
) -> None:
    """Choose which GPUs to rent, where, and how to split MODEL over them.

    A --model-config model (and --seq-len) must be as `sailor profile model --model-config` stored it.
    """
    from sailor_core.models.hf_config import resolve_model

    if model_config or model is None or seq_len is not None:  # the name `sailor profile model --model-config` used
        model = resolve_model(model, model_config, seq_len).name
    _check_batch(global_batch_size, large_batch, outputs=(("--out", out), ("--frontier-png", frontier_png)))
    sync_mode = SyncMode.parse(sync, compression=outer_compression)  # before the search: a typo costs nothing
    min_stages, max_stages = stage_range(stages) if stages else (1, SearchOptions.max_stages)
    doc = _read_pool(pool_file)  # before the store is read: a wrong path costs nothing
    book = load_model_book(model, store)
    pool = parse_pool(doc, book, source=pool_file)
    request = PlanRequest(
        model=model,
        global_batch_size=global_batch_size,
        pool=pool,
        objective=Objective.parse(objective),
        constraints=Constraints(max_usd_per_iteration=max_usd_per_iteration, max_usd_per_hour=max_usd_per_hour,
                                min_iterations_per_s=min_iterations_per_s),
        restrictions=_restrictions(clouds, regions, zones, gpu_types, markets, max_gpus),
        options=SearchOptions(wide_frontier=wide_frontier or frontier_png is not None, min_stages=min_stages,
                              max_stages=max_stages, recompute=recompute, max_search_s=max_search_s),
        spot_risk=_spot_risk(doc, store, planning_checkpoint_interval(checkpoint_interval), reconfiguration_s),
    )
    if sync_mode.mode != "every-step":
        plan_sync.answer(request, book, sync_mode, out=out, as_json=as_json)
        return
    result = run_planner(request, book)
    variations = [(change, run_planner(replace(request, pool=apply_what_if(pool, change, book)), book))
                  for change in what_if or []]
    _answer(result, variations, request.spot_risk, out=out, frontier_png=frontier_png, as_json=as_json)


def _restrictions(clouds: list[str] | None, regions: list[str] | None, zones: list[str] | None,
                  gpu_types: list[str] | None, markets: list[str] | None, max_gpus: int | None) -> Restrictions:
    """The request's restrictions from the repeatable, comma-separated options."""
    return Restrictions(clouds=split_values(clouds), regions=split_values(regions), zones=split_values(zones),
                        gpu_types=split_values(gpu_types), max_gpus=max_gpus,
                        markets=tuple(Market.parse(m) for m in split_values(markets)))


def _answer(result: PlanResult, variations: list[tuple[str, PlanResult]], spot_risk: SpotRisk, *, out: str | None,
            frontier_png: str | None, as_json: bool) -> None:
    """Write, plot and print the planner's answer; exit 1 when there is no feasible plan, 2 when none of the
    pool's GPU types has a profile for the model (input to fix: the answer names the command for each)."""
    if out and result.plan is not None:
        save_plan_file(result.plan, out, flag="--out")
    if frontier_png:
        _plot(result, frontier_png)
    if as_json:
        typer.echo(json.dumps(_to_json(result, variations, spot_risk)))
    else:
        _print(result, variations, out, frontier_png)
    if result.plan is None:
        # SystemExit, not typer.Exit: click swallows Exit's code when the entry point runs it
        # with standalone_mode=False.
        raise SystemExit(2 if result.unprofiled else 1)


def _spot_risk(doc: Any, store: str | None, checkpoint_interval: int, reconfiguration_s: float | None) -> SpotRisk:
    """Spot preemption rates: the store's run history where it has watched a market long enough, else
    the pool file's rate; the reconfiguration time: the option, else the store's measured mean."""
    from profiles_store.spot_risk import spot_risk_from_store
    from profiles_store.store import open_store

    rates, default = parse_preemption_rates(doc)
    opened = None
    with contextlib.suppress(Exception):  # no readable store: the pool file's rates stand
        opened = open_store(store)
    return spot_risk_from_store(opened, rates=rates, default_rate=default, checkpoint_interval=checkpoint_interval,
                                reconfiguration_s=reconfiguration_s)


def _read_pool(pool_file: str) -> Any:
    if Path(pool_file).is_dir():
        raise SailorError(f"--pool {shown_path(pool_file)} is a folder, not a pool file; to fix: name the YAML or "
                          f"JSON pool file in it (format in docs/planner.md)")
    return read_pool_document(pool_file)  # bounded: a hostile file is refused with one line (docs/formats.md)


def _check_batch(global_batch_size: int, confirmed: bool, outputs: tuple[tuple[str, str | None], ...] = ()) -> None:
    """The request's batch, and its outputs (a device, folder or link there is refused, never replaced)."""
    check_output_files(*outputs)
    if global_batch_size < 1:
        raise SailorError(f"--global-batch-size must be at least 1 sequence, got {global_batch_size}; to fix: pass a "
                          f"positive number")
    if global_batch_size <= MAX_PLAIN_GLOBAL_BATCH:
        return
    if not confirmed:
        raise SailorError(f"--global-batch-size {global_batch_size:.3g} sequences is more than "
                          f"{MAX_PLAIN_GLOBAL_BATCH} (published large runs use 1-4 thousand); to fix: check the "
                          f"number, or pass --large-batch if you mean it")
    typer.echo(f"warning: a global batch of {global_batch_size:.3g} sequences is far above published runs "
               f"(1-4 thousand); planning it because of --large-batch", err=True)


def _brief(r: PlanResult) -> dict[str, Any]:
    if r.estimate is None:
        return {"feasible": False, "nearest_miss": r.nearest_miss}
    e = r.estimate
    return {
        "feasible": True,
        "summary": summarize(r.plan) if r.plan else "",
        "iterations_per_s": e.throughput_iterations_per_s,
        "usd_per_iteration": e.usd_per_iteration,
        "usd_per_hour": e.usd_per_hour,
        "num_gpus": e.num_gpus,
    }


def _diff(base: PlanResult, var: PlanResult) -> dict[str, Any]:
    d = _brief(var)
    if base.estimate is not None and var.estimate is not None:
        b, v = base.estimate, var.estimate
        d["delta_iterations_per_s"] = v.throughput_iterations_per_s - b.throughput_iterations_per_s
        d["delta_usd_per_iteration"] = v.usd_per_iteration - b.usd_per_iteration
        d["delta_usd_per_hour"] = v.usd_per_hour - b.usd_per_hour
        d["delta_num_gpus"] = v.num_gpus - b.num_gpus
        d["same_plan"] = base.plan == var.plan
    return d


def _to_json(result: PlanResult, variations: list[tuple[str, PlanResult]], spot_risk: SpotRisk) -> dict[str, Any]:
    return {
        "feasible": result.plan is not None,
        "plan": plan_to_dict(result.plan) if result.plan is not None else None,
        "estimate": result.estimate.to_json() if result.estimate is not None else None,
        "search_time_s": result.stats.search_time_s,
        "search": search_words(result),
        "stats": result.stats.to_json(),
        "summary": summarize(result.plan) if result.plan is not None else "",
        "explanation": result.explanation,
        "nearest_miss": result.nearest_miss,
        "frontier": [f.to_json() for f in result.frontier],
        # nominal and expected (spot preemptions priced in) throughput of the plan, and the risk inputs
        "goodput": result.goodput.to_json() if result.goodput is not None else None,
        "spot_risk": spot_risk.to_json(),
        "what_if": [{"change": c, **_diff(result, v)} for c, v in variations],
    }


def search_words(result: PlanResult) -> str:
    """"optimal" when the search covered its whole space (or ruled it out by bounds), else "within x %"."""
    gap, skipped = result.stats.gap, result.stats.skipped
    if result.stats.optimal:
        return "optimal"
    words = "gap unknown" if gap is None else f"within {gap:.1%}"
    return f"{words} of one-kind plans; not searched: {', '.join(skipped)}" if skipped else words


def _print(result: PlanResult, variations: list[tuple[str, PlanResult]], out: str | None, png: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 140)
    s = result.stats
    con.print(f"searched in {s.search_time_s:.2f} s ({search_words(result)}): {s.configurations} splits, "
              f"{s.assignments} assignments, {s.candidates} plans estimated, {s.simulated} simulated")
    if result.plan is None:
        con.print(f"[red]no feasible plan[/red]: {result.nearest_miss}")
    else:
        con.print(f"[bold]plan[/bold]: {summarize(result.plan)}")
        if result.goodput is not None and result.goodput.preemptions_per_hour > 0:
            g = result.goodput
            con.print(f"throughput: {g.nominal_iterations_per_s:.4f} it/s nominal, {g.expected_iterations_per_s:.4f} "
                      f"expected with spot preemptions ({g.useful_fraction:.1%} of the time trains)")
        con.print(result.explanation)
        if result.nearest_miss:
            con.print(f"[yellow]note[/yellow]: {result.nearest_miss}")
        if out:
            con.print(f"written to {out} (check it with: sailor simulate {out})")
    if result.frontier:
        t = Table(title="frontier: throughput vs cost (simulated)")
        for h in ("it/s", "USD/iteration", "USD/hour", "GPUs", "plan"):
            t.add_column(h)
        for f in result.frontier:
            t.add_row(sig(f.iterations_per_s), usd(f.usd_per_iteration), usd(f.usd_per_hour),
                      str(f.num_gpus), ("(chosen) " if f.chosen else "") + f.summary)
        con.print(t)
    if png:
        con.print(f"frontier plot: {png}")
    for change, var in variations:
        d = _diff(result, var)
        if not d["feasible"]:
            con.print(f"[bold]what if {change}[/bold]: no feasible plan ({var.nearest_miss})")
            continue
        line = (f"[bold]what if {change}[/bold]: {sig(d['iterations_per_s'])} it/s, "
                f"{usd(d['usd_per_iteration'])} USD/iteration")
        if "delta_iterations_per_s" in d:
            line += (f" ({d['delta_iterations_per_s']:+.4g} it/s, {d['delta_usd_per_iteration']:+.3g} USD/iteration, "
                     f"{d['delta_num_gpus']:+d} GPUs{', same plan' if d['same_plan'] else ''})")
        con.print(line)
        if not d.get("same_plan"):
            con.print(f"    {d['summary']}")


def _plot(result: PlanResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [f.usd_per_iteration for f in result.frontier]
    ys = [f.iterations_per_s for f in result.frontier]
    ax.plot(xs, ys, "o-", label="frontier")
    if result.estimate is not None:
        ax.plot([result.estimate.usd_per_iteration], [result.estimate.throughput_iterations_per_s], "r*",
                markersize=14, label="chosen")
    ax.set_xlabel("USD per iteration")
    ax.set_ylabel("iterations per second")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    write_atomic("--frontier-png", path, buf.getvalue())
