"""Plan-independent checkpoints: full-layout per-layer state, written asynchronously and atomically.

Contract:
- Layout under a root URI: `step_NNNNNNNN/ (the step, 8 digits, e.g. step_00000010/)` holding, for every layer i and every TP rank t of the
  replica that wrote it, `layer_IIII.tp{t}of{T}.pt` (that rank's parameter shards and AdamW
  moments, with each tensor's shard dimension), one `part_s{stage}_t{t}.json` per writer listing
  its files and their SHA-256, and `meta.json` (step, samples seen, optimizer step, model, seed).
  Each file is written to a temporary name and renamed, so a reader never sees half a file.
- A checkpoint is *valid* only if meta.json exists and, for every layer 0..L+1, the shard files of
  one TP degree are all listed in parts and match their digests. `latest_valid_step` walks back
  from the newest step and skips incomplete or corrupt ones (with the reason).
- `load_layer_state(storage, step, layer)` returns full-layout tensors (shards concatenated along
  their shard dimension), so a checkpoint written under one plan (stages, DP, TP) loads under any.
- `AsyncCheckpointer.save` takes an in-memory snapshot (tensors already copied) and serialises and
  writes it on a background thread; `wait()` joins it and re-raises its error.
- Storage is pluggable (`CheckpointStorage`): a local directory, or `s3://` / `gs://` through
  pyarrow's filesystems (`open_storage(uri)`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import threading
import uuid
from typing import Any, Protocol

import torch

from sailor_core.domain import SailorError


class CheckpointStorage(Protocol):
    def write(self, path: str, data: bytes) -> None: ...  # atomic: all or nothing visible
    def read(self, path: str) -> bytes: ...
    def exists(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]: ...
    def delete_tree(self, path: str) -> None: ...


class LocalStorage:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path)

    def write(self, path: str, data: bytes) -> None:
        full = self._p(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, full)

    def read(self, path: str) -> bytes:
        with open(self._p(path), "rb") as f:
            return f.read()

    def exists(self, path: str) -> bool:
        return os.path.exists(self._p(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self._p(path)) if ".tmp-" not in n)
        except FileNotFoundError:
            return []

    def delete_tree(self, path: str) -> None:
        shutil.rmtree(self._p(path), ignore_errors=True)


class PyArrowStorage:
    """Object storage through pyarrow.fs (S3, GCS); object PUTs are atomic, so write is too."""

    def __init__(self, uri: str):
        from pyarrow import fs as pafs

        self._fs, self._root = pafs.FileSystem.from_uri(uri)
        self._pafs = pafs

    def _p(self, path: str) -> str:
        return f"{self._root.rstrip('/')}/{path}" if path else self._root

    def write(self, path: str, data: bytes) -> None:
        with self._fs.open_output_stream(self._p(path)) as f:
            f.write(data)

    def read(self, path: str) -> bytes:
        with self._fs.open_input_stream(self._p(path)) as f:
            return f.read()

    def exists(self, path: str) -> bool:
        return self._fs.get_file_info(self._p(path)).type != self._pafs.FileType.NotFound

    def listdir(self, path: str) -> list[str]:
        sel = self._pafs.FileSelector(self._p(path), allow_not_found=True)
        return sorted(i.base_name for i in self._fs.get_file_info(sel))

    def delete_tree(self, path: str) -> None:
        try:
            self._fs.delete_dir(self._p(path))
        except OSError:
            pass


def open_storage(uri: str) -> CheckpointStorage:
    if "://" in uri and not uri.startswith("file://"):
        try:
            return PyArrowStorage(uri)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad URI
            raise SailorError(f"cannot open checkpoint storage {uri!r}: {e}; to fix: check the URI and credentials") from None
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


class AsyncCheckpointer:
    """One background writer per rank; a new save first waits for the previous one."""

    def __init__(self, storage: CheckpointStorage, keep_last: int = 3):
        self.storage = storage
        self.keep_last = keep_last
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, layer_states: dict[int, dict[str, Any]], part_name: str,
             meta: dict[str, Any] | None = None, *, blocking: bool = False) -> None:
        self.wait()

        def work() -> None:
            try:
                d = step_dir(step)
                digests = {}
                for layer, state in sorted(layer_states.items()):
                    name = layer_file(layer, state["tp_rank"], state["tp"])
                    data = _to_bytes(state)
                    self.storage.write(f"{d}/{name}", data)
                    digests[name] = _sha(data)
                self.storage.write(f"{d}/{part_name}", json.dumps({"files": digests}).encode())
                if meta is not None:
                    self.storage.write(f"{d}/meta.json", json.dumps(meta).encode())
                    self._prune(step)
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                self._error = e

        self._thread = threading.Thread(target=work, name=f"ckpt-{step}", daemon=True)
        self._thread.start()
        if blocking:
            self.wait()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise SailorError(f"writing a checkpoint failed: {e}") from e

    def _prune(self, newest: int) -> None:
        steps = sorted(list_steps(self.storage))
        for s in steps[: max(0, len(steps) - self.keep_last)]:
            if s < newest:
                self.storage.delete_tree(step_dir(s))


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
            t, tp = name[len(prefix):-3].split("of")
            by_tp.setdefault(int(tp), set()).add(int(t))
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


def read_meta(storage: CheckpointStorage, step: int) -> dict[str, Any]:
    return json.loads(storage.read(f"{step_dir(step)}/meta.json"))


def load_layer_state(storage: CheckpointStorage, step: int, layer: int) -> dict[str, dict[str, torch.Tensor]]:
    """Full-layout {'params': ..., 'exp_avg': ..., 'exp_avg_sq': ...} of one layer."""
    d = step_dir(step)
    listed: dict[str, str] = {}
    for name in storage.listdir(d):
        if name.startswith("part_"):
            listed.update(json.loads(storage.read(f"{d}/{name}"))["files"])
    files = _layer_files(listed, layer)
    if files is None:
        raise SailorError(f"checkpoint step {step} has no complete shards of layer {layer}")
    pieces = [torch.load(io.BytesIO(storage.read(f"{d}/{f}")), map_location="cpu", weights_only=True) for f in files]
    dims = pieces[0]["shard_dims"]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for kind in ("params", "exp_avg", "exp_avg_sq"):
        out[kind] = {}
        for name in pieces[0][kind]:
            dim = dims[name]
            parts = [p[kind][name] for p in pieces]
            out[kind][name] = parts[0] if dim is None else torch.cat(parts, dim=dim)
    return out
