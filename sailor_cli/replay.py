"""`sailor replay`: a whole training job replayed over a trace of availability and prices, per policy.

Contract: reads the trace (ours: JSON or a changes CSV, incl. a price history exported from the
store; the Sailor artifact's `gpu_trace_*.csv` and `trace_based/*.json`; or `synthetic`, generated
from --synthetic-* options), the model's ProfileBook (the same loader as `sailor plan`), builds a
`ReplayJob` and runs `sailor_core.replay` for one policy or all of them (`--policy all`, the
default, on one shared memoised planner). Prints a side-by-side table and, when both ran, how
Sailor's policy compares with relaunch-same (time and cost ratios), or one JSON object with
--json; `--timeline-png` plots progress, spend and GPUs rented over time. Exit 0 when the replay
ran (a policy that never reached the budget is an answer, marked unfinished); user errors are one
line (exit 2).
"""

from __future__ import annotations

import io
import json
import math
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from sailor_cli.options import (
    CheckpointInterval,
    GlobalBatchSizeOrNone,
    Json,
    Markets,
    MaxGpus,
    MaxStages,
    MaxUsdPerHour,
    MaxUsdPerIteration,
    MinIterationsPerS,
    Model,
    ObjectiveName,
    ReconfigurationS,
    RunOrNone,
    StepsOrNone,
    Store,
    load_model_book,
    open_store,
    split_values,
)
from sailor_core.domain import Market
from sailor_core.errors import SailorError, TraceError, ValidationError
from sailor_core.files import check_output_files, read_text, write_atomic
from sailor_core.planner import Constraints, Objective, Restrictions, SearchOptions
from sailor_core.planner.risk import AUTO_CHECKPOINT_INTERVAL, planning_checkpoint_interval
from sailor_core.profiles import ProfileBook
from sailor_core.replay import (
    DEFAULT_GRACE_S,
    DEFAULT_PERIOD_S,
    POLICIES,
    Planner,
    ReplayJob,
    ReplayResult,
    SyntheticSpec,
    Trace,
    check_profiled,
    compare,
    policy_named,
    ratios,
    read_trace,
    synthetic_trace,
    trace_reading,
    trace_to_json,
)
from sailor_core.replay import FAST_SEARCH as FAST_SEARCH  # the bench's search too
from sailor_core.replay import (
    replay as run_replay,
)
from sailor_core.replay.trace import MAX_TRACE_BYTES

# A replacement after a loss on GPUs the job does not hold waits for its new VMs (sailor_core.decisions.startup_s).
VmStartS = Annotated[float, typer.Option("--vm-start-s", help=(
    "seconds new VMs take from the request to training: a replacement after a loss on GPUs the job does "
    "not hold waits for them (0: not charged)"))]


def replay(
    trace: Annotated[str | None, typer.Option("--trace", help="trace file (docs/replay.md), or 'synthetic'")] = None,
    model: Model = None,
    global_batch_size: GlobalBatchSizeOrNone = None,
    run: RunOrNone = None,
    steps: StepsOrNone = None,
    token_budget: Annotated[int | None, typer.Option(
        "--token-budget", help="tokens to train (instead of --steps)")] = None,
    policy: Annotated[str, typer.Option("--policy", help=f"{' | '.join(POLICIES)} | all")] = "all",
    objective: ObjectiveName = "max-throughput",
    max_usd_per_iteration: MaxUsdPerIteration = None,
    max_usd_per_hour: MaxUsdPerHour = None,
    min_iterations_per_s: MinIterationsPerS = None,
    markets: Markets = None,
    max_gpus: MaxGpus = None,
    max_stages: MaxStages = None,
    search: Annotated[str, typer.Option(
        "--search", help="fast (default) | full: the flow's own planner search")] = "fast",
    checkpoint_interval: CheckpointInterval = AUTO_CHECKPOINT_INTERVAL,
    reconfiguration_s: ReconfigurationS = None,
    vm_start_s: VmStartS = 0.0,
    grace_s: Annotated[float, typer.Option(
        "--grace-s", help="seconds between a preemption notice and the VM's stop")] = DEFAULT_GRACE_S,
    no_checkpoint_on_notice: Annotated[bool, typer.Option("--no-checkpoint-on-notice", help=(
        "the runtime writes no checkpoint on a notice: steps since the last one are redone"))] = False,
    min_gain: Annotated[float, typer.Option("--min-gain", help="a switch must save more than this (s or USD)")] = 0.0,
    period_s: Annotated[float, typer.Option("--period-s", help="the periodic policy's interval")] = DEFAULT_PERIOD_S,
    trace_zone: Annotated[str, typer.Option("--trace-zone", help="artifact JSON traces: their zone")] = "us-central1-a",
    trace_gpu_type: Annotated[str, typer.Option(
        "--trace-gpu-type", help="artifact JSON traces: their GPU type")] = "A100-40",
    trace_market: Annotated[str, typer.Option("--trace-market", help="artifact traces: their market")] = "on-demand",
    trace_gpus: Annotated[int | None, typer.Option(
        "--trace-gpus", help="price-only traces: GPUs each place offers")] = None,
    price: Annotated[float | None, typer.Option(
        "--price", help="artifact traces: USD per GPU-hour (default: the store's)")] = None,
    synthetic_gpus: Annotated[int, typer.Option(
        "--synthetic-gpus", help="synthetic trace: GPUs at full availability")] = 2048,
    synthetic_days: Annotated[float, typer.Option("--synthetic-days", help="synthetic trace: days")] = 14.0,
    synthetic_seed: Annotated[int, typer.Option("--synthetic-seed", help="synthetic trace: random seed")] = 0,
    save_trace: Annotated[str | None, typer.Option(
        "--save-trace", help="write the trace replayed (our JSON format)")] = None,
    store: Store = None,
    as_json: Json = False,
    timeline_png: Annotated[str | None, typer.Option(
        "--timeline-png", help="plot the replay's timeline to this PNG")] = None,
) -> None:
    """Replay a training job over a trace of GPU availability and prices, and compare reaction policies.

    With --run RUN_ID: replay a local run the flow made, from its history, and compare the decisions.
    """
    if run is not None:
        _replay_run(run, store, as_json)
        return
    if trace is None or model is None or global_batch_size is None:
        raise SailorError("give --trace, --model and --global-batch-size (or --run RUN_ID); to fix: add those missing")
    names = _policies(policy, steps, token_budget, search)
    _check_trace_path(trace, outputs=(("--save-trace", save_trace), ("--timeline-png", timeline_png)))
    book = load_model_book(model, store)
    tr = _load_trace(trace, book, zone=trace_zone, gpu_type=trace_gpu_type, market=trace_market, gpus=trace_gpus,
                     price=price, spec=SyntheticSpec(total_gpus=synthetic_gpus, days=synthetic_days,
                                                     seed=synthetic_seed))
    check_profiled(tr, book)
    if save_trace:
        write_atomic("--save-trace", save_trace, json.dumps(trace_to_json(tr)).encode())
    seq = book.model.sequence_length
    reconf, reconf_src = _reconfiguration(reconfiguration_s, store)
    job = _job(
        model=model, global_batch_size=global_batch_size, tokens_per_step=global_batch_size * seq,
        total_steps=steps if steps is not None else max(1, math.ceil((token_budget or 0) / (global_batch_size * seq))),
        objective=Objective.parse(objective).value,
        constraints=Constraints(max_usd_per_iteration=max_usd_per_iteration, max_usd_per_hour=max_usd_per_hour,
                                min_iterations_per_s=min_iterations_per_s),
        restrictions=Restrictions(markets=tuple(Market.parse(m) for m in split_values(markets)), max_gpus=max_gpus),
        search=_search_options(search, max_stages),
        checkpoint_interval=planning_checkpoint_interval(checkpoint_interval), reconfiguration_s=reconf,
        vm_start_s=vm_start_s, grace_s=grace_s, checkpoint_on_notice=not no_checkpoint_on_notice, min_gain=min_gain,
        period_s=period_s,
    )
    results = _run_policies(tr, book, job, names)
    _answer(tr, results, _to_json(tr, job, results, reconf_src, search), timeline_png, as_json)


def _answer(tr: Trace, results: list[ReplayResult], doc: dict[str, Any], png: str | None, as_json: bool) -> None:
    if png:
        _plot(results, tr, png)
    if as_json:
        typer.echo(json.dumps(doc))
    else:
        _print(doc, png)


def _policies(policy: str, steps: int | None, token_budget: int | None, search: str) -> list[str]:
    """The policies to replay; refuses a job the options do not pin down before anything is loaded."""
    if (steps is None) == (token_budget is None):
        raise SailorError("give exactly one of --steps and --token-budget; to fix: add one of them")
    if search not in ("fast", "full"):
        raise SailorError(f"unknown --search {search!r}; to fix: use fast or full")
    names = list(POLICIES) if policy == "all" else [policy]
    policy_named(names[0])  # an unknown name fails here
    return names


def _search_options(search: str, max_stages: int | None) -> SearchOptions:
    opts: dict[str, Any] = dict(FAST_SEARCH) if search == "fast" else {}
    if max_stages:
        opts["max_stages"] = max_stages
    return SearchOptions(**opts)


def _job(**fields: Any) -> ReplayJob:
    try:
        return ReplayJob(**fields)
    except ValidationError as e:
        raise SailorError(f"{e}; to fix: correct that option") from None


def _run_policies(tr: Trace, book: ProfileBook, job: ReplayJob, names: list[str]) -> list[ReplayResult]:
    """All policies on one shared memoised planner, or the one asked for."""
    if len(names) > 1:
        return compare(tr, book, job, names)
    name = names[0]
    return [run_replay(tr, book, job, policy_named(name), name=name, planner=Planner(book, job),
                       period_s=job.period_s if name == "periodic" else None)]


def run_inputs(store_uri: str | None, run_id: str,
               workdir: Path) -> tuple[dict[str, Any], Trace, ProfileBook, ReplayJob]:
    """A finished run as the replay sees it: its history, trace, calibrated book and job.

    The starting pool is what the run's provider offered at its start; a local run's provider is
    rebuilt from the run's scenario (its offerings are a function of the file) in `workdir`.
    The book is the store's, priced as the run's offerings; the trace's points calibrate it as the
    flow did (the factors it started with, then those it measured) and assume the reconfiguration the
    flow assumed at each replan (from the store's measurements recorded before it).
    """
    from infra.local import LocalProvider
    from infra.scenario import load_scenario
    from sailor_core.decisions import Measured
    from sailor_core.replay.history import run_job, run_trace
    from tasks.history import RunHistory
    from tasks.planning import pool_from, priced_book

    st = open_store(store_uri)
    r = RunHistory(st).show(run_id)
    p = r.get("params") or {}
    if p.get("provider") != "local":
        raise SailorError(f"run {run_id} ran on {p.get('provider')!r}: only local runs can be replayed from their "
                          f"history (their offerings at the start follow from their scenario); to fix: pick a "
                          f"local run")
    if p.get("scenario") and not Path(p["scenario"]).is_file():
        raise SailorError(f"run {run_id}'s scenario {p['scenario']} is gone; to fix: replay where the file is")
    provider = LocalProvider(workdir, scenario=load_scenario(p["scenario"]) if p.get("scenario") else None)
    offers = provider.offerings(regions=p.get("regions"), gpu_types=p.get("gpu_types"),
                                markets=[Market.parse(m) for m in p["markets"]] if p.get("markets") else None)
    gpu_set = sorted({o.gpu_type for o in offers if o.gpus > 0})
    started = datetime.fromisoformat(r["started_at"])
    factors: dict[str, float] = {}  # the flow's starting calibration: the newest factor per type before the run
    for m in sorted(st.read_history("measurements", kind="calibration"), key=lambda m: m.time):
        if m.time < started and m.run_id != run_id and m.payload.get("gpu_type") in gpu_set:
            factors[str(m.payload["gpu_type"])] = float(m.payload["factor"])
    book = priced_book(st.profile_book(str(p["model"]), gpu_set), offers)  # calibrated point by point
    # what the flow's store held: each replan assumes the reconfiguration that those recorded before it give
    measured = [(m.time, x) for kind in ("reconfiguration", "vm_start")
                for m in st.read_history("measurements", kind=kind) if (x := Measured.of(m.run_id, m.kind, m.payload))]
    return (r, run_trace(r, pool_from(offers), factors, measured), book,
            run_job(r, sequence_length=book.model.sequence_length))


def _replay_run(run_id: str, store: str | None, as_json: bool) -> None:
    import tempfile

    from sailor_core.replay.history import decisions_of

    with tempfile.TemporaryDirectory(prefix="sailor-replay-") as tmp:
        r, tr, book, job = run_inputs(store, run_id, Path(tmp))
    res = run_replay(tr, book, job, policy_named("sailor"), name="sailor")
    flow = decisions_of(r)
    ours = [(d.kind, d.step) for d in res.decisions if d.trigger != "start"]
    doc = {"run_id": run_id, "flow_decisions": flow, "replay_decisions": ours, "same": flow == ours,
           "result": res.to_json(detail=True)}
    if as_json:
        typer.echo(json.dumps(doc))
        return
    typer.echo(f"run {run_id}: {len(flow)} decisions by the flow, {len(ours)} by the replay "
               f"({'the same' if flow == ours else 'they differ'})")
    for k in range(max(len(flow), len(ours))):
        a = f"{flow[k][0]} at step {flow[k][1]}" if k < len(flow) else "-"
        b = f"{ours[k][0]} at step {ours[k][1]}" if k < len(ours) else "-"
        typer.echo(f"  flow: {a:<24} replay: {b}")


def _load_trace(path: str, book: ProfileBook, *, zone: str, gpu_type: str, market: str, gpus: int | None,
                price: float | None, spec: SyntheticSpec) -> Trace:
    how = trace_reading(book, zone=zone, gpu_type=gpu_type, market=Market.parse(market), default_count=gpus,
                        price=price)
    if path == "synthetic":
        return synthetic_trace(spec, how.prices, how.gpus_per_node)
    _check_trace_path(path)
    text = read_text(path, max_bytes=MAX_TRACE_BYTES, what="trace", error=TraceError)  # bounded: docs/formats.md
    return read_trace(Path(path).name, text, how)


def _check_trace_path(path: str, outputs: tuple[tuple[str, str | None], ...] = ()) -> None:
    """Before the store is read (a typo costs nothing and starts no reader threads): the trace exists, and the
    outputs are regular files or new paths (a device, folder or link there is refused, never replaced)."""
    check_output_files(*outputs)
    if path == "synthetic":
        return
    p = Path(path)
    if p.is_dir():
        raise SailorError(f"trace {path} is a folder, not a trace file; to fix: name the file in it "
                          f"(docs/replay.md), or use --trace synthetic")
    if not p.is_file():
        raise SailorError(f"trace {path} does not exist; to fix: check the path, or use --trace synthetic")


def _reconfiguration(given: float | None, store: str | None) -> tuple[float, str]:
    from sailor_core.planner.risk import DEFAULT_RECONFIGURATION_S, reconfiguration_from_history

    if given is not None:
        return given, "--reconfiguration-s"
    try:
        rows = open_store(store).read_history("measurements", kind="reconfiguration")
        measured = reconfiguration_from_history(float(r.payload["reconfiguration_s"]) for r in rows
                                                if "reconfiguration_s" in r.payload)
    except Exception:  # noqa: BLE001 - no store or no history: the documented default
        measured = None
    if measured is None:
        return DEFAULT_RECONFIGURATION_S, "default (the flow's estimate; the store has no measurement)"
    return measured, f"the store's measured mean over {len(rows)} reconfiguration(s)"


def _to_json(tr: Trace, job: ReplayJob, results: list[ReplayResult], reconf_src: str, search: str) -> dict[str, Any]:
    return {
        "trace": {"name": tr.name, "places": len(tr.places), "points": len(tr.points),
                  "duration_h": round(tr.duration_s / 3600, 3), "max_gpus": tr.max_gpus},
        "job": {"model": job.model, "global_batch_size": job.global_batch_size, "total_steps": job.total_steps,
                "tokens": job.total_steps * job.tokens_per_step, "objective": job.objective,
                "checkpoint_interval": job.checkpoint_interval, "reconfiguration_s": job.reconfiguration_s,
                "vm_start_s": job.vm_start_s,
                "reconfiguration_source": reconf_src, "grace_s": job.grace_s,
                "checkpoint_on_notice": job.checkpoint_on_notice, "period_s": job.period_s, "search": search},
        "results": [r.to_json(detail=True) for r in results],
        "sailor_vs_relaunch_same": ratios(results),
    }


def _print(doc: dict[str, Any], png: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 160)
    t, j = doc["trace"], doc["job"]
    con.print(f"trace: {t['name']}: {t['places']} places, {t['points']} changes over {t['duration_h']:.1f} h, "
              f"up to {t['max_gpus']} GPUs")
    con.print(f"job: {j['model']}, batch {j['global_batch_size']}, {j['total_steps']} steps "
              f"({j['tokens']:.3g} tokens), "
              f"{j['objective']}; checkpoint every {j['checkpoint_interval']} steps, reconfiguration "
              f"{j['reconfiguration_s']:.1f} s ({j['reconfiguration_source']}), new VMs start in "
              f"{j['vm_start_s']:g} s, grace {j['grace_s']:g} s")
    tab = Table(title="replay per policy (simulated): hours and USD to train, goodput in useful steps/s, GPU-hours "
                      "wasted on redone steps and reconfiguration")
    for h in ("policy", "done", "hours", "USD", "steps/s", "wasted GPU-h", "redone", "reconf s", "wait h",
              "switches", "planner", "replay s (cpu)"):
        tab.add_column(h, no_wrap=h == "policy")
    for r in doc["results"]:
        tab.add_row(r["policy"], "yes" if r["finished"] else f"no: {r['steps_done']:.0f}",
                    f"{r['time_to_train_h']:.2f}", f"{r['usd']:.2f}", f"{r['goodput_steps_per_s']:.4g}",
                    f"{r['gpu_hours_wasted']:.2f}", f"{r['redone_steps']:.0f}", f"{r['reconfiguration_s']:.0f}",
                    f"{r['waiting_s'] / 3600:.2f}", str(r["switches"]),
                    f"{r['planner_calls']}+{r['planner_hits']}", f"{r['wall_s']:.2f} ({r['cpu_s']:.2f})")
    con.print(tab)
    rt = doc["sailor_vs_relaunch_same"]
    if rt:
        unfinished = "" if rt["baseline_finished"] else " (relaunch-same did not finish: its figures are lower bounds)"
        con.print(f"sailor vs relaunch-same: time x{rt['time_ratio']:.3f}, cost x{rt['cost_ratio']:.3f}{unfinished}")
    if png:
        con.print(f"timeline plot: {png}")


def _plot(results: list[ReplayResult], tr: Trace, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for r in results:
        hs = [p[0] / 3600 for p in r.progress]
        axes[0].plot(hs, [p[1] for p in r.progress], label=r.policy)
        axes[1].plot(hs, [p[2] for p in r.progress], label=r.policy)
        xs, ys = [], []
        for sg in r.segments:
            xs += [sg.start_s / 3600, sg.end_s / 3600]
            ys += [sg.gpus if sg.state == "train" else 0] * 2
        axes[2].plot(xs, ys, label=r.policy, linewidth=1)
    done = [r.time_to_train_s for r in results if r.finished]
    if done and len(done) < len(results):  # unfinished policies run to the horizon: show the finished ones
        axes[0].set_xlim(0, 1.15 * max(done) / 3600)
    axes[0].set_ylabel("steps done")
    axes[1].set_ylabel("USD spent")
    axes[2].set_ylabel("GPUs training")
    axes[2].set_xlabel("hours since start")
    avail = [(pt.at_s / 3600, sum(pt.counts)) for pt in tr.points]
    ax2 = axes[2].twinx()
    ax2.step([a for a, _ in avail], [b for _, b in avail], where="post", color="grey", alpha=0.4)
    ax2.set_ylabel("GPUs available", color="grey")
    axes[0].legend(loc="lower right")
    axes[0].set_title(f"replay: {tr.name}"[:100], fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic("--timeline-png", path, buf.getvalue())
