"""`sailor train`: run a plan with the heterogeneous runtime on this machine.

Contract: loads PLAN_FILE (sailor or eth-easl format), checks that the runtime can run it before
any process starts, starts one worker per rank locally (GPU type `cpu`, zone `local`), and prints
one line per step. `--metrics-out FILE` gets one JSON line per step (step, loss, samples,
iteration_time_s, ...). With `--checkpoint-dir` the run checkpoints every `--checkpoint-every`
steps and at the end, and survives the loss of a worker by continuing under a smaller plan;
`--resume` continues from the newest valid checkpoint there and fails (exit 2, naming each skipped
checkpoint and why) when there is none, unless `--resume-or-start`; invalid checkpoints are moved
to `quarantine/` beside them, never written over. The plan file's model is the model (a different
`--model` is an error). Exit status: 0 done, 1 training failed, 2 bad input, 143/130 when stopped
by SIGTERM/SIGINT (the workers checkpoint first). Worker logs live in a temporary folder that is
removed at the end (`--log-dir` keeps them).
Models: `--model NAME` (built in) or `--model-config config.json` (Hugging Face style Llama,
GPT-NeoX, OPT). `--init-weights` (safetensors file or folder, local or s3:// / gs://) starts from
those weights under any plan: they become step 0 of the checkpoint folder (sailor_core.runtime.
weights), which the run resumes from. `--export DIR` writes the trained weights in the model's
original Hugging Face layout (model.safetensors + config.json). Training settings: `--lr-schedule
constant|cosine|linear` with `--warmup-steps` and `--min-lr-ratio`, `--max-grad-norm` (global norm;
0 turns clipping off), `--recompute` (activation recomputation in every block).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer

from sailor_core.domain import SailorError


def train(
    plan_file: Path = typer.Argument(..., help="Plan file (sailor JSON or a published plan_config_*.json)"),
    model: str | None = typer.Option(None, "--model", help="Model name, e.g. gpt-tiny (default: the plan's; "
                                     "needed for published plans, which do not name it)"),
    steps: int = typer.Option(..., "--steps", min=1, help="Optimizer steps to run (in total, counting resumed ones)"),
    fmt: str = typer.Option("auto", "--format", help="Plan format: sailor | eth-easl | auto"),
    seed: int = typer.Option(0, "--seed", help="Seed of the initial weights and the sample order"),
    data: str | None = typer.Option(None, "--data", help="Dataset path or URI (default: Python's stdlib sources)"),
    checkpoint_dir: str | None = typer.Option(None, "--checkpoint-dir", help="Checkpoint directory or s3:// / gs:// URI"),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", min=0, help="Checkpoint every N steps (0: at the end)"),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest valid checkpoint (fail if none)"),
    resume_or_start: bool = typer.Option(False, "--resume-or-start",
                                         help="Continue from the newest valid checkpoint, or start at step 0 if none"),
    metrics_out: Path | None = typer.Option(None, "--metrics-out", help="Write one JSON line per step here"),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate"),
    timeout_s: float = typer.Option(60.0, "--timeout", help="Seconds before a silent peer counts as lost"),
    log_dir: Path | None = typer.Option(None, "--log-dir", help="Keep the worker logs here (default: removed at the end)"),
    model_config: str | None = typer.Option(None, "--model-config", help="Hugging Face style config.json (Llama, GPT-NeoX, OPT)"),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Training sequence length of a --model-config model"),
    init_weights: str | None = typer.Option(None, "--init-weights", help="Start from these safetensors (file or folder, local or s3://)"),
    export: str | None = typer.Option(None, "--export", help="Write the trained weights here as safetensors + config.json"),
    lr_schedule: str = typer.Option("constant", "--lr-schedule", help="constant | cosine | linear (after warmup)"),
    warmup_steps: int = typer.Option(0, "--warmup-steps", min=0, help="Linear learning-rate warmup steps"),
    min_lr_ratio: float = typer.Option(0.0, "--min-lr-ratio", help="Decay ends at lr * this"),
    max_grad_norm: float = typer.Option(1.0, "--max-grad-norm", help="Clip the global gradient norm to this (0: off)"),
    recompute: bool = typer.Option(False, "--recompute", help="Recompute block activations in backward (less memory)"),
) -> None:
    """Train the plan's model under PLAN_FILE with local workers (one process per GPU slot of the plan)."""
    from sailor_core.models.config import get_config
    from sailor_core.plan_format import load_plan_file
    from sailor_core.runtime.engine import TrainSettings
    from sailor_core.runtime.launcher import check_settings, run_local
    from sailor_core.runtime.schedule import check_schedule

    check_schedule(lr_schedule, warmup_steps, min_lr_ratio)
    if model_config:  # a config.json model, registered under its name: the plan's model resolves to it
        from sailor_core.models.hf_config import load_model_config

        model = load_model_config(model_config, name=model, sequence_length=seq_len).name
    plan = load_plan_file(plan_file, fmt=fmt, model=model)
    cfg = get_config(plan.model)
    if (init_weights or export) and not checkpoint_dir:
        raise SailorError("--init-weights and --export go through the run's checkpoints; to fix: pass --checkpoint-dir "
                          "(an empty folder or URI for a new run)")
    if (resume or resume_or_start) and not checkpoint_dir:
        raise SailorError("--resume needs --checkpoint-dir; to fix: pass the directory the run checkpointed to")
    settings = TrainSettings(model=cfg.name, steps=steps, seed=seed, data=data, checkpoint_dir=checkpoint_dir,
                             checkpoint_every=checkpoint_every, resume=resume or resume_or_start, lr=lr,
                             timeout_s=timeout_s, model_config=cfg.to_dict() if model_config else None,
                             lr_schedule=lr_schedule, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
                             max_grad_norm=max_grad_norm, recompute=recompute)
    check_settings(settings)  # before any checkpoint is touched or a worker starts
    if init_weights:  # the weights become step 0 of the checkpoint folder, which the run resumes from
        from sailor_core.runtime.weights import import_weights

        import_weights(cfg, init_weights, str(checkpoint_dir), seed=seed)
        settings = replace(settings, resume=True)
    if settings.resume:
        settings = replace(settings, resume=_resume_point(str(checkpoint_dir), cfg.num_layers, resume_or_start))
    keep_logs = log_dir is not None
    run_dir = str(log_dir) if log_dir is not None else tempfile.mkdtemp(prefix="sailor-train-")
    try:
        _run(plan, cfg, settings, run_dir, metrics_out, run_local)
        if export:
            from sailor_core.runtime.weights import export_weights

            step = export_weights(cfg, str(checkpoint_dir), export)
            typer.echo(f"exported step {step} to {export} (model.safetensors, config.json)")
    finally:
        if not keep_logs:
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


def _run(plan: Any, cfg: Any, settings: Any, run_dir: str, metrics_out: Path | None, run_local: Any) -> None:
    metrics = str(metrics_out) if metrics_out else os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics) and not settings.resume:
        os.remove(metrics)
    settings = replace(settings, metrics_out=metrics)

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

    result = run_local(plan, cfg, settings, on_event=on_event, run_dir=run_dir)
    rows = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            rows = [json.loads(line) for line in f if line.strip()]
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
        where = f"; continue with --resume --checkpoint-dir {settings.checkpoint_dir}" if settings.checkpoint_dir else ""
        typer.echo(f"stopped by {name} at step {rows[-1]['step'] if rows else 0}{where}", err=True)
        raise typer.Exit(128 + result.interrupted_by)
