"""`sailor simulate PLAN_FILE`: iteration time, memory and cost of a plan, from stored profiles.

Contract: reads the plan (our format or a published `plan_config_*.json` with --format eth-easl and
--model; a Hugging Face config.json model with --model-config, named as `sailor profile model
--model-config` stored it), loads the model's ProfileBook (`sailor_cli.options.load_book`: from --store, else the
default store, else the data published with the Sailor artifact), runs `sailor_core.simulator.simulate`
and prints a readable breakdown (per stage: time, activation memory, peak memory; `--recompute all|0,1`
simulates activation recomputation in those stages), or one JSON object with --json. User errors (bad
plan, missing profile) are `SailorError`s: the entry point prints them as one line with the fix.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Annotated

import typer

from sailor_cli.options import Json, Model, ModelConfig, PlanFormat, SeqLen, Store, load_book
from sailor_core.domain import ParallelPlan
from sailor_core.errors import SailorError
from sailor_core.plan_format import load_plan_file
from sailor_core.simulator import ReplicaResult, SimOptions, SimulationResult
from sailor_core.simulator import simulate as run_simulation
from sailor_core.units import usd


def _gb(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def _print_rich(res: SimulationResult, plan_path: str, recompute: tuple[bool, ...] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 140)  # piped output: do not wrap at 80
    b = res.breakdown
    con.print(f"[bold]{plan_path}[/bold]: {res.num_gpus} GPUs, {res.schedule}, {res.precision}"
              f"{', ZeRO-1' if res.zero1 else ''}")
    t = Table(title="iteration", show_header=False)
    t.add_row("iteration time", f"{res.iteration_time_s:.4f} s")
    t.add_row("  pipeline compute (incl. bubbles)", f"{b.pipeline_compute_s:.4f} s (bubble {b.bubble_s:.4f} s)")
    t.add_row("  pipeline send/receive", f"{b.pipeline_p2p_s:.4f} s")
    t.add_row("  data-parallel sync (exposed)", f"{b.dp_sync_exposed_s:.4f} s "
              f"(per stage {', '.join(f'{x:.4f}' for x in b.dp_sync_per_stage_s)} s)")
    t.add_row("  optimizer step", f"{b.optimizer_s:.4f} s")
    t.add_row("throughput", f"{res.throughput_iterations_per_s:.3f} it/s, {res.samples_per_s:.1f} samples/s, "
              f"{res.tokens_per_s:,.0f} tokens/s")
    t.add_row("peak memory", f"{_gb(res.peak_memory_bytes)}  fits: {'yes' if res.fits_memory else '[red]NO[/red]'}")
    t.add_row("cost", f"${usd(res.usd_per_iteration)}/iteration (egress ${usd(res.egress_usd_per_iteration)}), "
              f"${usd(res.usd_per_hour)}/h, ${usd(res.usd_per_million_tokens)}/M tokens")
    if res.unpriced:
        t.add_row("[yellow]unpriced[/yellow]", ", ".join("/".join(u) for u in res.unpriced) + " (counted as $0)")
    con.print(t)
    st = Table(title="per stage (identical replicas grouped)")
    for h in ("stage", "replicas", "GPU @ zone", "tp", "mbs x m", "s/microbatch", "dp sync s", "in flight",
              "activations", "peak mem", "fits"):
        st.add_column(h)
    groups: list[list[ReplicaResult]] = []
    for r in res.per_stage:
        g = groups[-1] if groups else None
        if g and _same(g[-1], r):
            g.append(r)
        else:
            groups.append([r])
    for g in groups:
        r = g[0]
        reps = str(r.replica) if len(g) == 1 else f"{r.replica}-{g[-1].replica}"
        label = f"{r.stage} (recompute)" if r.stage < len(recompute) and recompute[r.stage] else str(r.stage)
        st.add_row(label, reps, f"{r.gpu_type} @ {r.zone}", str(r.tp),
                   f"{r.microbatch_size} x {r.num_microbatches}", f"{r.forward_s + r.backward_s:.4f}",
                   f"{r.dp_sync_s:.4f}", str(r.in_flight_microbatches), _mib(r.memory.activations_bytes),
                   _gb(r.peak_memory_bytes),
                   "yes" if r.fits else f"[red]no: {_gb(max(x.bytes_over for x in g))} over[/red]")
    con.print(st)


def _same(a: ReplicaResult, b: ReplicaResult) -> bool:
    return (a.stage, a.gpu_type, a.zone, a.tp, a.microbatch_size, a.num_microbatches, a.peak_memory_bytes, a.fits) == (
        b.stage, b.gpu_type, b.zone, b.tp, b.microbatch_size, b.num_microbatches, b.peak_memory_bytes, b.fits)


def _is_published(plan_file: str, fmt: str) -> bool:
    """A plan in the artifact's format (--format eth-easl, or detected) was run by its framework."""
    if fmt != "auto":
        return fmt == "eth-easl"
    try:
        with open(plan_file) as f:
            return "pipeline_list" in json.load(f)
    except (OSError, ValueError, TypeError):
        return False


def simulate(
    plan_file: Annotated[str, typer.Argument(help="plan JSON: ours (sailor) or a published plan_config_*.json")],
    format: PlanFormat = "auto",
    model: Model = None,
    store: Store = None,
    as_json: Json = False,
    schedule: Annotated[str | None, typer.Option("--schedule", help="override: 1f1b | gpipe")] = None,
    recompute: Annotated[str | None, typer.Option(
        "--recompute", help="override: recompute activations in these stages (all, none, or e.g. 0,1)")] = None,
    runtime: Annotated[str | None, typer.Option(
        "--runtime", help="whose communication runs the plan: sailor (this project's runtime) | deepspeed (the "
                          "Sailor artifact's framework); default: deepspeed for a published eth-easl plan, sailor "
                          "otherwise")] = None,
    model_config: ModelConfig = None,
    seq_len: SeqLen = None,
) -> None:
    """Estimate iteration time, peak memory per GPU and cost of PLAN_FILE.

    The model is the plan's; a published plan names none: give --model (or --model-config).
    A --model-config model (and --seq-len) must be as `sailor profile model --model-config` stored it.
    Profiles come from --store (or a folder of the Sailor artifact's data), else the default store, else that data.
    """
    if model_config or seq_len is not None:  # registered under the name `sailor plan --model-config` wrote
        from sailor_core.models.hf_config import resolve_model

        model = resolve_model(model, model_config, seq_len).name
    plan = load_plan_file(plan_file, fmt=format, model=model)
    if recompute is not None:
        plan = _with_recompute(plan, recompute)
    if runtime is None:
        runtime = "deepspeed" if _is_published(plan_file, format) else "sailor"
    book = load_book(plan.model, store)
    res = run_simulation(plan, book, options=SimOptions(schedule=schedule, runtime=runtime))
    flags = tuple(st.recompute for st in plan.stages)
    if as_json:
        typer.echo(json.dumps({**res.to_json(), "recompute_stages": [i for i, f in enumerate(flags) if f]}))
    else:
        _print_rich(res, plan_file, flags)


def _with_recompute(plan: ParallelPlan, spec: str) -> ParallelPlan:
    """`plan` with activation recomputation in the stages `spec` names (all | none | 0,2,...)."""
    n = len(plan.stages)
    if spec.strip() in ("all", "none"):
        chosen = set(range(n)) if spec.strip() == "all" else set()
    else:
        try:
            chosen = {int(x) for x in spec.split(",") if x.strip()}
        except ValueError:
            raise SailorError(f"--recompute must be all, none or stage indices like 0,1, got {spec!r}") from None
        if any(not 0 <= i < n for i in chosen):
            raise SailorError(f"--recompute names stages {sorted(chosen)} but the plan has stages 0..{n - 1}; "
                              f"to fix: use indices below {n}")
    return replace(plan, stages=tuple(replace(st, recompute=i in chosen) for i, st in enumerate(plan.stages)))
