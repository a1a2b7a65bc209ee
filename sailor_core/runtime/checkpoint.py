"""Plan-independent checkpoints: full-layout per-layer state, written asynchronously and atomically.

Contract:
- Layout under a root URI: `step_NNNNNNNN/ (the step, 8 digits, e.g. step_00000010/)` holding, for every
  layer i and every TP rank t of the replica that wrote it, `layer_IIII.tp{t}of{T}.pt` (that rank's
  parameter shards and AdamW moments, with each tensor's shard dimension), one `part_s{stage}_t{t}.json`
  per writer listing its files and their SHA-256, and `meta.json` (step, samples seen, optimizer step, model, seed).
  Each file is written to a temporary name and renamed, so a reader never sees half a file.
  `layer_state` makes what one shard file holds, from a layer and its optimizer state.
- A checkpoint is *valid* only if meta.json exists and, for every layer 0..L+1, the shard files of
  one TP degree are all listed in parts and match their digests. `latest_valid_step` walks back
  from the newest step and skips incomplete or corrupt ones (with the reason).
- A checkpoint that is not valid is never deleted or overwritten: `resume_point` (called before a
  run resumes) moves every invalid checkpoint newer than the one it resumes from to
  `quarantine/step_NNNNNNNN[.k]/`, with `QUARANTINED.json` {step, reason, time} beside its files,
  so a run that goes on from an older step cannot write over it and a person can inspect it.
- Writing (checkpoint_writer.py) and storage (checkpoint_storage.py) are modules of their own.
- Retention (`AsyncCheckpointer.keep_last`) removes a checkpoint only when it is older than a newer
  *valid* one and more than `keep_last` steps are kept; an invalid old one is quarantined instead.
  It runs after a save that writes meta.json, on the save's thread once the files are written, one
  pass at a time (a save that finds one running skips its own), and not after a just-in-time save
  (`prune=False`); a later save prunes what was skipped.
- `load_layer_state(storage, step, layer)` returns full-layout tensors (shards concatenated along
  their shard dimension), so a checkpoint written under one plan (stages, DP, TP) loads under any.
- `AsyncCheckpointer.save` takes an in-memory snapshot (tensors already copied) and serialises and
  writes it on a background thread; `wait()` waits for it and for retention (`wait(retention=False)`:
  for the writes only; `close()` cancels a retention pass at its next read and waits: a rank leaving
  its generation is done in the time of its writes) and re-raises an error.
- Storage is pluggable (`CheckpointStorage`): a local directory, or `s3://` / `gs://` through
  pyarrow's filesystems (`open_storage(uri)`). Object storage is wrapped in `RetryingStorage`: only
  "not found" means absent; a transient error (5xx, timeout, reset connection) is retried with
  backoff for up to `retry_s` (default STORAGE_RETRY_S) and then raised as `StorageUnavailable`,
  which no reader takes for a missing or corrupt checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sailor_core.errors import SailorError
from sailor_core.models.tensor_parallel import SHARD_ATTR
from sailor_core.runtime.checkpoint_storage import (
    STORAGE_RETRY_S,
    CheckpointStorage,
    LocalStorage,
    PyArrowStorage,
    RetryingStorage,
)
from sailor_core.uris import redact


def open_storage(uri: str, *, retry_s: float = STORAGE_RETRY_S) -> CheckpointStorage:
    """The storage of a checkpoint folder or URI; object storage retries transient errors (RetryingStorage)."""
    if "://" in uri and not uri.startswith("file://"):

        try:
            inner = PyArrowStorage(uri)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad URI
            raise SailorError(f"cannot open checkpoint storage {redact(uri)!r}: {e}; to fix: check the URI and "
                              f"credentials") from None
        return RetryingStorage(inner, retry_s=retry_s, what=f"checkpoint storage {redact(uri)}")
    return LocalStorage(uri.removeprefix("file://"))


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def layer_file(layer: int, tp_rank: int, tp: int) -> str:
    return f"layer_{layer:04d}.tp{tp_rank}of{tp}.pt"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def layer_state(li: int, layer: torch.nn.Module, state_of: Callable[[torch.Tensor], Any], tp_rank: int,
                tp: int, extra_of: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """What a shard file holds: layer `li`'s parameters (TP rank `tp_rank` of `tp`) and their AdamW
    moments (`state_of(p)`: a parameter's optimizer state, None or empty where it has none: zeros),
    copied to the CPU, with each tensor's shard dimension; `extra_of(p)`: more tensors of the
    parameter's shape by kind (semi-synchronous training's `outer_global`, `outer_momentum`)."""
    params, m1, m2, dims = {}, {}, {}, {}
    extra: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in layer.named_parameters(remove_duplicate=False):
        for kind, t in (extra_of(p) if extra_of is not None else {}).items():
            extra.setdefault(kind, {})[name] = t.detach().to("cpu", copy=True)
        params[name] = p.detach().to("cpu", copy=True)
        st = state_of(p) or {}
        m1[name] = st["exp_avg"].detach().to("cpu", copy=True) if "exp_avg" in st else torch.zeros_like(params[name])
        m2[name] = (
            st["exp_avg_sq"].detach().to("cpu", copy=True) if "exp_avg_sq" in st else torch.zeros_like(params[name])
        )
        dims[name] = getattr(p, SHARD_ATTR, None)
    return {"layer": li, "tp": tp, "tp_rank": tp_rank, "shard_dims": dims,
            "params": params, "exp_avg": m1, "exp_avg_sq": m2, **extra}


def write_part(storage: CheckpointStorage, step: int, layer_states: Any, part_name: str) -> None:
    """One writer's share of checkpoint `step`: each (layer, state) of `layer_states` as its shard file,
    then `part_name` listing them with their digests (a reader trusts only files a part lists)."""
    d = step_dir(step)
    digests = {}
    for layer, state in sorted(layer_states, key=lambda x: x[0]):
        name = layer_file(layer, state["tp_rank"], state["tp"])
        data = _to_bytes(state)
        storage.write(f"{d}/{name}", data)
        digests[name] = _sha(data)
    storage.write(f"{d}/{part_name}", json.dumps({"files": digests}).encode())


def write_meta(storage: CheckpointStorage, step: int, meta: dict[str, Any]) -> None:
    """meta.json of checkpoint `step`: written last, by one writer, once every part is written."""
    storage.write(f"{step_dir(step)}/meta.json", json.dumps(meta).encode())


def list_steps(storage: CheckpointStorage) -> list[int]:
    out = []
    for name in storage.listdir(""):
        if name.startswith("step_"):
            try:
                out.append(int(name[5:]))
            except ValueError:
                continue
    return sorted(out)


def check_step(storage: CheckpointStorage, step: int, num_layers: int, *, verify_digests: bool = True) -> str | None:
    """None if the checkpoint at `step` is valid, else the reason it is not."""
    d = step_dir(step)
    try:
        meta = json.loads(storage.read(f"{d}/meta.json"))
    except FileNotFoundError:
        return "no meta.json (incomplete)"
    except (OSError, ValueError) as e:
        return f"unreadable meta.json: {e}"
    if meta.get("num_layers") != num_layers:
        return f"checkpoint has {meta.get('num_layers')} layers, the model has {num_layers}"
    listed: dict[str, str] = {}
    for name in storage.listdir(d):
        if name.startswith("part_"):
            try:
                listed.update(json.loads(storage.read(f"{d}/{name}"))["files"])
            except (OSError, ValueError, KeyError) as e:
                return f"unreadable {name}: {e}"
    for layer in range(num_layers):
        files = _layer_files(listed, layer)
        if files is None:
            return f"layer {layer} is missing shards"
        if verify_digests:
            for f in files:
                try:
                    data = storage.read(f"{d}/{f}")
                except OSError as e:
                    return f"{f}: {e}"
                if _sha(data) != listed[f]:
                    return f"{f} is corrupt (digest mismatch)"
    return None


def _layer_files(listed: dict[str, str], layer: int) -> list[str] | None:
    prefix = f"layer_{layer:04d}.tp"
    by_tp: dict[int, set[int]] = {}
    for name in listed:
        if name.startswith(prefix):
            rank_s, degree_s = name[len(prefix):-3].split("of")
            by_tp.setdefault(int(degree_s), set()).add(int(rank_s))
    for tp, have in sorted(by_tp.items()):
        if have == set(range(tp)):
            return [layer_file(layer, t, tp) for t in range(tp)]
    return None


def latest_valid_step(storage: CheckpointStorage, num_layers: int, log: Any = None) -> int | None:
    for step in reversed(list_steps(storage)):
        reason = check_step(storage, step, num_layers)
        if reason is None:
            return step
        if log:
            log(f"skipping checkpoint step {step}: {reason}")
    return None


QUARANTINE = "quarantine"


def quarantine(storage: CheckpointStorage, step: int, reason: str) -> str:
    """Move the checkpoint of `step` aside with its reason; returns where it went (relative path)."""
    names = set(storage.listdir(QUARANTINE))
    dst = step_dir(step)
    k = 1
    while dst in names:
        dst, k = f"{step_dir(step)}.{k}", k + 1
    storage.move_tree(step_dir(step), f"{QUARANTINE}/{dst}")
    storage.write(f"{QUARANTINE}/{dst}/QUARANTINED.json",
                  json.dumps({"step": step, "reason": reason, "time": time.time()}).encode())
    return f"{QUARANTINE}/{dst}"


@dataclass(frozen=True)
class Skipped:
    step: int
    reason: str
    moved_to: str

    def line(self) -> str:
        return f"checkpoint step {self.step} skipped: {self.reason}; moved aside to {self.moved_to}"


def resume_point(storage: CheckpointStorage, num_layers: int) -> tuple[int | None, list[Skipped]]:
    """The newest valid step (None: none), after quarantining every invalid checkpoint above it."""
    skipped: list[Skipped] = []
    for step in reversed(list_steps(storage)):
        reason = check_step(storage, step, num_layers)
        if reason is None:
            return step, skipped
        skipped.append(Skipped(step, reason, quarantine(storage, step, reason)))
    return None, skipped


def no_resume_error(uri: str, skipped: list[Skipped]) -> SailorError:
    """The error of a resume that found nothing to resume from (each skipped checkpoint and why)."""
    if not skipped:
        return SailorError(f"--resume found no checkpoint in {uri}; to fix: pass the folder the run checkpointed "
                           f"to, or --resume-or-start to start from step 0 when there is none")
    why = "; ".join(f"step {s.step}: {s.reason} (moved to {s.moved_to})" for s in skipped)
    return SailorError(f"--resume found no valid checkpoint in {uri}: {why}; to fix: restore a checkpoint, or pass "
                       f"--resume-or-start to start from step 0")


def read_meta(storage: CheckpointStorage, step: int) -> dict[str, Any]:
    meta = json.loads(storage.read(f"{step_dir(step)}/meta.json"))
    if not isinstance(meta, dict):
        raise SailorError(f"checkpoint step {step}: meta.json is not a JSON object; to fix: resume from another step")
    return meta


def _listed_files(storage: CheckpointStorage, step: int) -> dict[str, str]:
    """Every shard file the parts of checkpoint `step` list, with its digest."""
    d = step_dir(step)
    listed: dict[str, str] = {}
    for name in storage.listdir(d):
        if name.startswith("part_"):
            listed.update(json.loads(storage.read(f"{d}/{name}"))["files"])
    return listed


def load_layer_state(storage: CheckpointStorage, step: int, layer: int,
                     listed: dict[str, str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Full-layout {'params': ..., 'exp_avg': ..., 'exp_avg_sq': ...} of one layer, and its `outer_*`
    kinds where it has them (`listed`: the step's `_listed_files`, when the caller read them already)."""
    d = step_dir(step)
    files = _layer_files(_listed_files(storage, step) if listed is None else listed, layer)
    if files is None:
        raise SailorError(f"checkpoint step {step} has no complete shards of layer {layer}")
    pieces = [torch.load(io.BytesIO(storage.read(f"{d}/{f}")), map_location="cpu", weights_only=True) for f in files]
    dims = pieces[0]["shard_dims"]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for kind in ("params", "exp_avg", "exp_avg_sq", *(k for k in pieces[0] if k.startswith("outer_"))):
        out[kind] = {}
        for name in pieces[0][kind]:
            dim = dims[name]
            parts = [p[kind][name] for p in pieces]
            out[kind][name] = parts[0] if dim is None else torch.cat(parts, dim=dim)
    return out


def load_layer_states(storage: CheckpointStorage, step: int,
                      layers: list[int]) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """`load_layer_state` of several layers, reading the step's parts once."""
    if not layers:
        return {}
    listed = _listed_files(storage, step)
    return {li: load_layer_state(storage, step, li, listed) for li in layers}
