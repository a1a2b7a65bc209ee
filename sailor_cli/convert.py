"""`sailor convert SRC DST`: Hugging Face weights into the runtime's checkpoint format and back, without training.

Contract: SRC is either Hugging Face weights (a .safetensors file, a model.safetensors.index.json, or a
folder holding them; local or s3:// / gs://) or a checkpoint folder the runtime wrote (`sailor train
--checkpoint-dir`). Weights are imported as step 0 of a checkpoint (sailor_core.runtime.weights
.import_weights, the path `sailor train --init-weights` takes) and exported from it again; a checkpoint
folder is exported directly (its newest valid step, or `--step`). DST receives the model's original
Hugging Face layout: model.safetensors (or shards with their index) + config.json, which transformers
loads to the same logits. The model is `--model-config` (a Hugging Face config.json), by default the
config.json beside SRC's weights. The checkpoint of an import lies in a temporary folder that is removed
at the end, or in `--keep-checkpoint` (an empty folder or URI), which then holds a checkpoint any plan
can resume from (`sailor train PLAN --checkpoint-dir DIR --resume`). Exit 0 done, 2 bad input.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from sailor_cli.options import Model, ModelConfig, SeqLen, check_folder
from sailor_core.errors import SailorError


def convert(
    src: Annotated[str, typer.Argument(help=(
        "Hugging Face weights (safetensors file, index.json or folder) or a checkpoint folder; path or URI"))],
    dst: Annotated[str, typer.Argument(help="folder to write model.safetensors + config.json to (path or URI)")],
    model_config: ModelConfig = None,
    model: Model = None,
    seq_len: SeqLen = None,
    checkpoint_dir: Annotated[str | None, typer.Option(
        "--keep-checkpoint",
        help="keep the imported checkpoint in this folder or URI (default: a temporary one, removed)")] = None,
    step: Annotated[int | None, typer.Option(
        "--step", min=0, help="the checkpoint step to export when SRC is a checkpoint (default: the newest valid)")
    ] = None,
) -> None:
    """Convert Hugging Face weights to the runtime's checkpoint and back (or export a checkpoint), without training.

    The model config defaults to the config.json beside SRC's weights.
    """
    from sailor_core.models.export_target import check_export_target
    from sailor_core.models.hf_config import load_model_config
    from sailor_core.runtime import checkpoint as ckpt
    from sailor_core.runtime.weights import export_weights, import_weights

    check_folder("DST", dst)
    check_export_target("DST", dst)  # an earlier export is replaced as a unit; anything else there is refused
    check_folder("--keep-checkpoint", checkpoint_dir)
    is_checkpoint = _is_checkpoint(src)
    config = model_config or _config_beside(src, is_checkpoint)
    cfg = load_model_config(config, name=model, sequence_length=seq_len)
    if is_checkpoint:
        if checkpoint_dir:
            raise SailorError(f"{src} is already a checkpoint folder; to fix: drop --keep-checkpoint")
        done = export_weights(cfg, src, dst, step=step)
        typer.echo(f"exported checkpoint step {done} of {cfg.name} from {src} to {dst} (model.safetensors, "
                   f"config.json)")
        return
    if step is not None:
        raise SailorError("--step picks a step of a checkpoint folder, but SRC is Hugging Face weights; to fix: drop "
                          "--step")
    folder = checkpoint_dir or tempfile.mkdtemp(prefix="sailor-convert-")
    try:
        if checkpoint_dir and ckpt.list_steps(ckpt.open_storage(checkpoint_dir)):
            raise SailorError(f"--keep-checkpoint {checkpoint_dir} already holds checkpoint steps; to fix: name an "
                              f"empty folder (or export that checkpoint: sailor convert {checkpoint_dir} {dst})")
        layers = import_weights(cfg, src, folder)
        export_weights(cfg, folder, dst, step=0)
    finally:
        if not checkpoint_dir:
            shutil.rmtree(folder, ignore_errors=True)
    kept = f"; checkpoint step 0 kept in {checkpoint_dir}" if checkpoint_dir else ""
    typer.echo(f"imported {layers} layers of {cfg.name} from {src} and exported them to {dst} (model.safetensors, "
               f"config.json){kept}")


def _is_checkpoint(src: str) -> bool:
    """Whether SRC is a folder the runtime checkpointed to (step_NNNNNNNN/ inside), not Hugging Face weights."""
    from sailor_core.runtime import checkpoint as ckpt

    if src.endswith((".safetensors", ".json")):
        return False
    local = src.removeprefix("file://") if src.startswith("file://") or "://" not in src else None
    if local is not None and not Path(local).exists():
        raise SailorError(f"SRC {src} does not exist; to fix: check the path")
    if local is not None and not Path(local).is_dir():
        return False
    try:
        return bool(ckpt.list_steps(ckpt.open_storage(src)))
    except SailorError:
        raise
    except OSError:  # not a checkpoint folder (e.g. a file, or a prefix that cannot be listed): read as weights
        return False


def _config_beside(src: str, is_checkpoint: bool) -> str:
    if is_checkpoint:
        raise SailorError(f"{src} is a checkpoint folder, which does not keep the model's config.json; to fix: pass "
                          f"--model-config with the config it was trained with")
    base = src if not src.endswith((".safetensors", ".json")) else src.rsplit("/", 1)[0] if "/" in src else "."
    return f"{base.rstrip('/')}/config.json"
