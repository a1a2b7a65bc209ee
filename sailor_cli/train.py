"""`sailor train`: run a plan with the heterogeneous runtime on this machine.

Contract: loads PLAN_FILE (sailor or eth-easl format), checks that the runtime can run it before
any process starts, starts one worker per rank locally (GPU type `cpu`, zone `local`), and prints
one line per step. `--metrics-out FILE` gets one JSON line per step (step, loss, samples,
iteration_time_s, ...). With `--checkpoint-dir` the run checkpoints every `--checkpoint-interval`
steps (`--checkpoint-every`, its older name, still works) and at the end (0, the default, is the
automatic interval: here only at the end, and just in time on a preemption notice, for one machine
has no preemption rate and no timed step before it starts for Young/Daly to weigh), and survives
the loss of a worker by continuing under a smaller plan;
`--resume` continues from the newest valid checkpoint there and fails (exit 2, naming each skipped
checkpoint and why) when there is none, unless `--resume-or-start`; invalid checkpoints are moved
to `quarantine/` beside them, never written over. The plan file's model is the model (a different
`--model` is an error). Exit status: 0 done, 1 training failed, 2 bad input, 143/130 when stopped
by SIGTERM/SIGINT (the workers checkpoint first). The run goes into the run history of `--store`
(default: the `sailor runs` store) as `sailor-train:<plan file stem>`, with its step records, so
`sailor runs list` and `runs show --plot` show it (sailor_cli/train_record.py). Worker logs live in a
temporary folder that is removed at the end (`--log-dir` keeps them).
Models: `--model NAME` (built in) or `--model-config config.json` (Hugging Face style Llama,
GPT-NeoX, OPT). `--init-weights` (safetensors file, model.safetensors.index.json, or a folder, local
or s3:// / gs://; checked against the config before anything starts) starts from those weights
under any plan: they become step 0 of the checkpoint folder (sailor_core.runtime.weights), which
the run resumes from. `--export DIR` writes the trained weights in the model's
original Hugging Face layout (model.safetensors + config.json). Training settings: `--lr-schedule
constant|cosine|linear` with `--warmup-steps` and `--min-lr-ratio`, `--max-grad-norm` (global norm;
0 turns clipping off), `--recompute` (activation recomputation in every block).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from sailor_cli.options import (
    CheckpointInterval,
    Model,
    ModelConfig,
    PlanFormat,
    SeqLen,
    Steps,
    Store,
    TimeoutS,
    check_folder,
    check_input_path,
    check_output_file,
)
from sailor_core.errors import SailorError
from sailor_core.planner.risk import AUTO_CHECKPOINT_INTERVAL


def train(
    plan_file: Annotated[Path, typer.Argument(help="plan file (sailor JSON or a published plan_config_*.json)")],
    steps: Steps,
    model: Model = None,
    fmt: PlanFormat = "auto",
    seed: Annotated[int, typer.Option("--seed", help="seed of the initial weights and the sample order")] = 0,
    data: Annotated[str | None, typer.Option(
        "--data", help="dataset path or URI (default: Python's stdlib sources)")] = None,
    checkpoint_uri: Annotated[str | None, typer.Option(
        "--checkpoint-dir", help="checkpoint directory or s3:// / gs:// URI")] = None,
    checkpoint_interval: CheckpointInterval = AUTO_CHECKPOINT_INTERVAL,
    checkpoint_every: Annotated[int | None, typer.Option("--checkpoint-every", min=0, hidden=True)] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="continue from the newest valid checkpoint (fail if none)")] = False,
    resume_or_start: Annotated[bool, typer.Option(
        "--resume-or-start", help="continue from the newest valid checkpoint, or start at step 0 if none")] = False,
    metrics_out: Annotated[Path | None, typer.Option("--metrics-out", help="write one JSON line per step here")] = None,
    lr: Annotated[float, typer.Option("--lr", help="AdamW learning rate")] = 1e-3,
    timeout_s: TimeoutS = 60.0,
    log_dir: Annotated[Path | None, typer.Option(
        "--log-dir", help="keep the worker logs here (default: removed at the end)")] = None,
    model_config: ModelConfig = None,
    seq_len: SeqLen = None,
    init_weights: Annotated[str | None, typer.Option(
        "--init-weights", help="start from these safetensors (file, index.json or folder, local or s3://)")] = None,
    export: Annotated[str | None, typer.Option(
        "--export", help="write the trained weights here as safetensors + config.json")] = None,
    lr_schedule: Annotated[str, typer.Option(
        "--lr-schedule", help="constant | cosine | linear (after warmup)")] = "constant",
    warmup_steps: Annotated[int, typer.Option(
        "--warmup-steps", min=0, help="linear learning-rate warmup steps")] = 0,
    min_lr_ratio: Annotated[float, typer.Option("--min-lr-ratio", help="decay ends at lr * this")] = 0.0,
    max_grad_norm: Annotated[float, typer.Option(
        "--max-grad-norm", help="clip the global gradient norm to this (0: off)")] = 1.0,
    recompute: Annotated[bool, typer.Option(
        "--recompute", help="recompute block activations in backward (less memory)")] = False,
    tensorboard: Annotated[Path | None, typer.Option("--tensorboard", help=(
        "write TensorBoard event files to this folder as the run trains (loss, learning rate, tokens/s, step time, "
        "per stage step time)"))] = None,
    store: Store = None,
) -> None:
    """Train the plan's model under PLAN_FILE with local workers (one process per GPU slot of the plan).

    The model is the plan's; a published plan names none: give --model (or --model-config).
    --timeout: how long a silent peer is waited for before it counts as lost.
    """
    checkpoint_interval = _interval(checkpoint_interval, checkpoint_every)
    _refuse_bad_inputs(resume and resume_or_start, data, (("--checkpoint-dir", checkpoint_uri), ("--log-dir", log_dir),
                                                          ("--export", export)),
                       metrics_out, (lr_schedule, warmup_steps, min_lr_ratio), tensorboard)
    from sailor_core.models.config import get_config
    from sailor_core.plan_format import load_plan_file
    from sailor_core.runtime.engine import TrainSettings

    if model_config:  # a config.json model, registered under its name: the plan's model resolves to it
        from sailor_core.models.hf_config import load_model_config

        model = load_model_config(model_config, name=model, sequence_length=seq_len).name
    islands = _island_plan(plan_file)  # a `sailor plan --sync semi` answer: one job per island
    plan = islands.islands[0] if islands is not None else load_plan_file(plan_file, fmt=fmt, model=model)
    cfg = get_config(plan.model)
    _need_checkpoint_dir(checkpoint_uri, through=bool(init_weights or export), resume=resume or resume_or_start,
                         export=(cfg, export))
    settings = TrainSettings(model=cfg.name, steps=steps, seed=seed, data=data, checkpoint_uri=checkpoint_uri,
                             checkpoint_interval=checkpoint_interval, resume=resume or resume_or_start, lr=lr,
                             timeout_s=timeout_s, model_config=cfg.to_dict() if model_config else None,
                             lr_schedule=lr_schedule, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
                             max_grad_norm=max_grad_norm, recompute=recompute)
    if islands is not None:
        _run_islands(islands, cfg, settings, log_dir, metrics_out)
        return
    settings = _start_from(settings, cfg, init_weights, resume_or_start)
    _run_and_export(plan, cfg, settings, log_dir, metrics_out, export, tensorboard, (store, plan_file.stem))


def _refuse_bad_inputs(both_resumes: bool, data: str | None, folders: tuple[tuple[str, Any], ...],
                       metrics_out: Path | None, schedule: tuple[str, int, float], tensorboard: Path | None) -> None:
    """Inputs a worker would trip over 15-20 s after the start: refused before anything starts."""
    from sailor_core.runtime.lr_schedule import check_schedule

    if both_resumes:
        raise SailorError("--resume and --resume-or-start exclude each other (without a checkpoint the first fails, "
                          "the second starts at step 0); to fix: pass one of them")
    check_input_path("--data", data)  # local paths only: s3:// and gs:// are the workers' to read
    for flag, folder in folders:
        check_folder(flag, folder)
    check_output_file("--metrics-out", metrics_out)
    check_schedule(*schedule)
    if tensorboard is not None and tensorboard.exists() and not tensorboard.is_dir():
        raise SailorError(f"--tensorboard {tensorboard} is a file; to fix: name a folder (created if missing)")


def _island_plan(path: Path) -> Any:
    """The island plan in `path` (format sailor-islands), or None for any other plan file."""
    from sailor_core.semisync import FORMAT_NAME, islands_from_dict

    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not JSON, or unreadable: the plan loader says what is wrong with it
    return islands_from_dict(d) if isinstance(d, dict) and d.get("format") == FORMAT_NAME else None


def _run_islands(ip: Any, cfg: Any, settings: Any, log_dir: Path | None, metrics_out: Path | None) -> None:
    """Every island of an island plan on this machine at once (runtime/island_launcher.py), then each
    island's steps and loss."""
    from sailor_core.runtime.island_launcher import run_islands

    run_dir = str(log_dir) if log_dir is not None else tempfile.mkdtemp(prefix="sailor-train-")
    metrics = str(metrics_out) if metrics_out else os.path.join(run_dir, "metrics.jsonl")

    def on_event(ev: dict) -> None:
        if ev["event"] == "started":
            typer.echo(f"island {ev['island']}: started {ev['world_size']} workers")
        elif ev["event"] == "reconfigured":
            typer.echo(f"island {ev['island']}: lost workers {ev['lost_workers']}, continuing alone under plan "
                       f"version {ev['plan_version']}")

    try:
        results = run_islands(ip, cfg, replace(settings, metrics_out=metrics), run_dir=run_dir, on_event=on_event)
        for i, result in enumerate(results):
            rows = _rows(f"{metrics}.island{i}")
            if rows:
                typer.echo(f"island {i}: {result.status}, {len(rows)} steps, loss {rows[0]['loss']:.4f} -> "
                           f"{rows[-1]['loss']:.4f}")
        typer.echo(f"{len(results)} islands, an outer step every {ip.sync.inner_steps} steps ({ip.sync.compression})")
    finally:
        if log_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)


def _interval(given: int, older: int | None) -> int:
    """--checkpoint-interval, or --checkpoint-every (its older name) where only that one is given."""
    if older is None or older == given:
        return given
    if given != 0:
        raise SailorError(f"--checkpoint-interval {given} and --checkpoint-every {older} disagree (the second is "
                          f"the first's older name); to fix: pass only --checkpoint-interval")
    return older


def _need_checkpoint_dir(checkpoint_uri: str | None, *, through: bool, resume: bool,
                         export: tuple[Any, str | None] = (None, None)) -> None:
    """What --init-weights, --export and --resume need, checked before training: the checkpoints they go through;
    for --export, a model with a Hugging Face layout and a folder the export may replace as a unit."""
    cfg, out = export
    if out:
        from sailor_core.models.export_target import check_export_target
        from sailor_core.models.hf_config import hf_config_of

        hf_config_of(cfg)  # a model without a Hugging Face layout (gpt-tiny) was refused only after training
        check_export_target("--export", out)
    if through and not checkpoint_uri:
        raise SailorError("--init-weights and --export go through the run's checkpoints; to fix: pass "
                          "--checkpoint-dir (an empty folder or URI for a new run)")
    if resume and not checkpoint_uri:
        raise SailorError("--resume needs --checkpoint-dir; to fix: pass the directory the run checkpointed to")


def _start_from(settings: Any, cfg: Any, init_weights: str | None, or_start: bool) -> Any:
    """`settings` resuming where the run starts: imported weights (step 0 of the checkpoint folder), else
    the newest valid checkpoint when --resume asked for one, else step 0. The settings and the dataset are
    checked first: before any checkpoint is touched or a worker starts."""
    from sailor_core.runtime.launcher import check_settings
    from sailor_core.runtime.token_shards import check_dataset

    check_settings(settings)
    check_dataset(settings.data, cfg.sequence_length, cfg.vocab_size)  # e.g. a tokenizer larger than the model
    if init_weights:
        from sailor_core.runtime.weights import import_weights

        import_weights(cfg, init_weights, str(settings.checkpoint_uri), seed=settings.seed)
        settings = replace(settings, resume=True)
    if settings.resume:
        settings = replace(settings, resume=_resume_point(str(settings.checkpoint_uri), cfg.num_layers, or_start))
    return settings


def _run_and_export(plan: Any, cfg: Any, settings: Any, log_dir: Path | None, metrics_out: Path | None,
                    export: str | None, tensorboard: Path | None = None,
                    history: tuple[str | None, str] | None = None) -> None:
    """Train in a log folder (a temporary one unless --log-dir), then export the weights if asked."""
    from sailor_core.runtime.launcher import run_local

    record = None
    if history is not None:  # (--store, the plan file's stem): the run goes into the run history
        from sailor_cli.train_record import TrainRecord

        record = TrainRecord.open(history[0], history[1], cfg.name, settings.to_dict(),
                                  tokens_per_step=plan.global_batch_size * cfg.sequence_length)
    run_dir = str(log_dir) if log_dir is not None else tempfile.mkdtemp(prefix="sailor-train-")
    try:
        _run(plan, cfg, settings, run_dir, metrics_out, run_local, tensorboard, record)
        if export:
            from sailor_core.runtime.weights import export_weights

            step = export_weights(cfg, str(settings.checkpoint_uri), export)
            typer.echo(f"exported step {step} to {export} (model.safetensors, config.json)")
    finally:
        if log_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)


def _resume_point(uri: str, num_layers: int, or_start: bool) -> bool:
    """Whether the workers resume: quarantines invalid checkpoints and says why each was skipped."""
    from sailor_core.runtime import checkpoint as ckpt

    step, skipped = ckpt.resume_point(ckpt.open_storage(uri), num_layers)
    for s in skipped:
        typer.echo(s.line(), err=True)
    if step is not None:
        typer.echo(f"resuming from checkpoint step {step} in {uri}")
        return True
    if not or_start:
        raise ckpt.no_resume_error(uri, skipped)
    typer.echo(f"no valid checkpoint in {uri}: starting at step 0 (--resume-or-start)")
    return False


def _follow(settings: Any, run_dir: str, tensorboard: Path | None) -> tuple[Any, Any]:
    """(settings, a thread writing TensorBoard events from the step records as they arrive, or None)."""
    if tensorboard is None:
        return settings, None
    from sailor_core.runtime.tensorboard import Follower

    ranks = os.path.join(run_dir, "rank-metrics")  # each rank's own records: per stage step time
    shutil.rmtree(ranks, ignore_errors=True)
    os.makedirs(ranks)
    follower = Follower(settings.metrics_out, str(tensorboard), rank_dir=ranks)
    if os.path.exists(settings.metrics_out):  # resumed: the steps before are in the events of the earlier run
        follower.tail.offset = os.path.getsize(settings.metrics_out)
    follower.start()
    return replace(settings, rank_metrics_dir=ranks), follower


def _rows(metrics: str) -> list[dict[str, Any]]:
    """The step records rank 0 wrote to `metrics` (JSON lines; none when it is missing)."""
    if not os.path.exists(metrics):
        return []
    with open(metrics) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run(plan: Any, cfg: Any, settings: Any, run_dir: str, metrics_out: Path | None, run_local: Any,
         tensorboard: Path | None = None, record: Any = None) -> None:
    metrics = str(metrics_out) if metrics_out else os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics) and not settings.resume:
        os.remove(metrics)
    settings, follower = _follow(replace(settings, metrics_out=metrics), run_dir, tensorboard)

    def on_event(ev: dict) -> None:
        if ev["event"] == "started":
            typer.echo(f"started {ev['world_size']} workers for {cfg.name} ({plan.num_stages} stages, "
                       f"dp {plan.data_parallel})")
        elif ev["event"] == "reconfigured":
            typer.echo(f"lost workers {ev['lost_workers']}: continuing under plan version {ev['plan_version']} "
                       f"with {ev['world_size']} workers from the latest checkpoint")
        elif ev["event"] == "checkpoint_skipped":
            typer.echo(f"checkpoint step {ev['step']} skipped: {ev['reason']}; moved aside to {ev['moved_to']}",
                       err=True)

    t0 = time.time()
    try:
        result = run_local(plan, cfg, settings, on_event=on_event, run_dir=run_dir)
    except BaseException as e:
        if record is not None:  # the run history says how it ended, with the steps it did train
            record.finish("failed", _rows(metrics), time.time() - t0, reason=f"{type(e).__name__}: {e}"[:500])
        raise
    finally:
        if follower is not None:
            typer.echo(f"TensorBoard: {follower.stop()} steps written to {tensorboard} "
                       f"(tensorboard --logdir {tensorboard})")
    rows = _rows(metrics)
    if record is not None:
        record.finish(result.status, rows, time.time() - t0)
    for r in rows:
        typer.echo(f"step {r['step']:>5}  loss {r['loss']:.4f}  {r['iteration_time_s'] * 1000:8.1f} ms  "
                   f"plan v{r.get('plan_version', 0)}")
    if rows:
        t = sorted(r["iteration_time_s"] for r in rows)
        typer.echo(f"{result.status}: {len(rows)} steps, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, "
                   f"median iteration {t[len(t) // 2] * 1000:.1f} ms, {result.generations} plan version(s)")
    if result.interrupted_by is not None:
        import signal

        name = signal.Signals(result.interrupted_by).name
        where = (f"; continue with --resume --checkpoint-dir {settings.checkpoint_uri}"
                 if settings.checkpoint_uri else "")
        typer.echo(f"stopped by {name} at step {rows[-1]['step'] if rows else 0}{where}", err=True)
        raise typer.Exit(128 + result.interrupted_by)
