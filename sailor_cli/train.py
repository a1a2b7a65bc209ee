"""`sailor train`: run a plan with the heterogeneous runtime on this machine.

Contract: loads PLAN_FILE (sailor or eth-easl format), checks that the runtime can run it before
any process starts, starts one worker per rank locally (GPU type `cpu`, zone `local`), and prints
one line per step. `--metrics-out FILE` gets one JSON line per step (step, loss, samples,
iteration_time_s, ...). With `--checkpoint-dir` the run checkpoints every `--checkpoint-every`
steps and at the end, and survives the loss of a worker by continuing under a smaller plan;
`--resume` continues from the newest valid checkpoint there.
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
import tempfile
from pathlib import Path

import typer

from sailor_core.domain import SailorError


def train(
    plan_file: Path = typer.Argument(..., help="Plan file (sailor JSON or a published plan_config_*.json)"),
    model: str | None = typer.Option(None, "--model", help="Model name, e.g. gpt-tiny (with --model-config: its name)"),
    steps: int = typer.Option(..., "--steps", min=1, help="Optimizer steps to run (in total, counting resumed ones)"),
    fmt: str = typer.Option("auto", "--format", help="Plan format: sailor | eth-easl | auto"),
    seed: int = typer.Option(0, "--seed", help="Seed of the initial weights and the sample order"),
    data: str | None = typer.Option(None, "--data", help="Dataset path or URI (default: Python's stdlib sources)"),
    checkpoint_dir: str | None = typer.Option(None, "--checkpoint-dir", help="Checkpoint directory or s3:// / gs:// URI"),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", min=0, help="Checkpoint every N steps (0: at the end)"),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest valid checkpoint"),
    metrics_out: Path | None = typer.Option(None, "--metrics-out", help="Write one JSON line per step here"),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate"),
    timeout_s: float = typer.Option(60.0, "--timeout", help="Seconds before a silent peer counts as lost"),
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
    """Train MODEL under PLAN_FILE with local workers (one process per GPU slot of the plan)."""
    from sailor_core.models.hf_config import resolve_model
    from sailor_core.plan_format import load_plan_file
    from sailor_core.runtime.engine import TrainSettings
    from sailor_core.runtime.launcher import run_local
    from sailor_core.runtime.schedule import check_schedule

    cfg = resolve_model(model, model_config, seq_len)
    check_schedule(lr_schedule, warmup_steps, min_lr_ratio)
    plan = load_plan_file(plan_file, fmt=fmt, model=cfg.name)
    if resume and not checkpoint_dir:
        raise SailorError("--resume needs --checkpoint-dir; to fix: pass the directory the run checkpointed to")
    run_dir = tempfile.mkdtemp(prefix="sailor-train-")
    if (init_weights or export) and not checkpoint_dir:
        checkpoint_dir = os.path.join(run_dir, "checkpoints")  # weights travel through a checkpoint
    if init_weights:
        from sailor_core.runtime.weights import import_weights

        assert checkpoint_dir is not None
        import_weights(cfg, init_weights, checkpoint_dir, seed=seed)
        resume = True
    metrics = str(metrics_out) if metrics_out else os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics) and not resume:
        os.remove(metrics)
    settings = TrainSettings(model=cfg.name, steps=steps, seed=seed, data=data, checkpoint_dir=checkpoint_dir,
                             checkpoint_every=checkpoint_every, resume=resume, metrics_out=metrics, lr=lr,
                             timeout_s=timeout_s, model_config=cfg.to_dict() if model_config else None,
                             lr_schedule=lr_schedule, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
                             max_grad_norm=max_grad_norm, recompute=recompute)

    def on_event(ev: dict) -> None:
        if ev["event"] == "started":
            typer.echo(f"started {ev['world_size']} workers for {cfg.name} ({plan.num_stages} stages, "
                       f"dp {plan.data_parallel}); logs in {run_dir}")
        elif ev["event"] == "reconfigured":
            typer.echo(f"lost workers {ev['lost_workers']}: continuing under plan version {ev['plan_version']} "
                       f"with {ev['world_size']} workers from the latest checkpoint")

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
    if export and result.status == "done":
        from sailor_core.runtime.weights import export_weights

        assert checkpoint_dir is not None
        step = export_weights(cfg, checkpoint_dir, export)
        typer.echo(f"exported step {step} to {export} (model.safetensors, config.json)")
