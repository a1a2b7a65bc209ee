"""Safetensors in and out of the runtime's plan-independent checkpoints.

Contract:
- `import_weights(cfg, weights_uri, checkpoint_uri, seed=0)` reads Hugging Face safetensors
  (sailor_core.models.safetensors_io), maps them to full-layout layers and writes them, one layer
  at a time, as a valid checkpoint at step 0 (optimizer step 0: no AdamW moments are stored; a
  resumed run starts them at zero, as before a first step). Any plan
  then starts from them by resuming (`TrainSettings.resume`): the checkpoint loader already shards
  full-layout layers for every stage split and TP degree. It refuses a checkpoint folder that
  already holds steps, so a run's progress is never overwritten.
- `export_weights(cfg, checkpoint_uri, out, step=None, max_shard_bytes=5e9)` writes the newest valid
  (or the given) step's weights in the model's original Hugging Face layout: `model.safetensors`, or
  transformers' sharded files with `model.safetensors.index.json` when larger than one shard,
  plus `config.json`; one file's layers are in memory at a time.
"""

from __future__ import annotations

import torch

from sailor_core.errors import SailorError
from sailor_core.models.config import TransformerConfig
from sailor_core.models.safetensors_io import (
    DEFAULT_SHARD_BYTES,
    export_groups,
    hf_to_layers,
    layers_to_hf,
    meta_tensors,
    read_safetensors,
    write_safetensors_sharded,
)
from sailor_core.models.tensor_parallel import TPContext
from sailor_core.models.torch_model import _new_layer, param_shard_dims
from sailor_core.runtime import checkpoint as ckpt
from sailor_core.runtime.checkpoint_storage import CheckpointStorage
from sailor_core.runtime.checkpoint_writer import AsyncCheckpointer
from sailor_core.uris import redact


def import_weights(cfg: TransformerConfig, weights_uri: str, checkpoint_uri: str, seed: int = 0) -> int:
    """Write `weights_uri` as step 0 of the checkpoint at `checkpoint_uri`; returns the layers written."""


    tensors = read_safetensors(weights_uri)
    hf_to_layers(cfg, meta_tensors(tensors))  # every name and shape, before anything is read or written
    storage = ckpt.open_storage(checkpoint_uri)
    if ckpt.list_steps(storage):
        raise SailorError(f"checkpoint folder {checkpoint_uri!r} already holds steps; to fix: import the weights into "
                          f"an empty --checkpoint-dir (or resume from the steps there without --init-weights)")
    writer = AsyncCheckpointer(storage)
    for i in range(cfg.num_layers):  # one layer in memory at a time, as the checkpoint's own writers do
        with torch.device("meta"):
            dims = param_shard_dims(_new_layer(cfg, i, TPContext.single()))
        state = {"layer": i, "tp": 1, "tp_rank": 0, "shard_dims": dims,
                 "params": hf_to_layers(cfg, tensors, [i])[i], "exp_avg": {}, "exp_avg_sq": {}}
        last = i == cfg.num_layers - 1
        meta = {"step": 0, "samples_seen": 0, "opt_steps": 0, "model": cfg.name, "seed": seed,
                "num_layers": cfg.num_layers, "plan_version": 0, "imported_from": redact(weights_uri)}
        writer.save(0, {i: state}, f"part_import_{i:04d}.json", meta if last else None, blocking=True)
    return cfg.num_layers


def checkpoint_layers(cfg: TransformerConfig, checkpoint_uri: str, step: int | None = None):  # type: ignore[no-untyped-def]
    """Full-layout parameters of every layer at `step` (default: the newest valid one), and the step."""
    storage = ckpt.open_storage(checkpoint_uri)
    step = _checked_step(cfg, storage, checkpoint_uri, step)
    return {i: ckpt.load_layer_state(storage, step, i)["params"] for i in range(cfg.num_layers)}, step


def export_weights(cfg: TransformerConfig, checkpoint_uri: str, out: str, step: int | None = None,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """Export a checkpoint's weights to `out` in the Hugging Face layout; returns the step exported."""
    storage = ckpt.open_storage(checkpoint_uri)
    step = _checked_step(cfg, storage, checkpoint_uri, step)
    groups = export_groups(cfg, max_shard_bytes)
    parts = (layers_to_hf(cfg, {i: ckpt.load_layer_state(storage, step, i)["params"] for i in g}) for g in groups)
    write_safetensors_sharded(parts, len(groups), cfg, out)
    return step


def _checked_step(cfg: TransformerConfig, storage: CheckpointStorage, uri: str, step: int | None) -> int:
    if step is None:
        step = ckpt.latest_valid_step(storage, cfg.num_layers)
        if step is None:
            raise SailorError(f"no valid checkpoint in {redact(uri)!r}; to fix: train with --checkpoint-dir first")
    meta = ckpt.read_meta(storage, step)
    if meta.get("model") != cfg.name:
        raise SailorError(f"checkpoint step {step} is of model {meta.get('model')!r}, not {cfg.name!r}; "
                          f"to fix: pass the model config it was trained with")
    return int(step)
