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

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sailor_core.errors import SailorError, StorageUnavailable
from sailor_core.models.tensor_parallel import SHARD_ATTR


class CheckpointStorage(Protocol):
    def write(self, path: str, data: bytes) -> None: ...  # atomic: all or nothing visible
    def read(self, path: str) -> bytes: ...
    def exists(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]: ...
    def delete_tree(self, path: str) -> None: ...
    def move_tree(self, src: str, dst: str) -> None: ...  # dst must not exist


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
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, full)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)  # a full disk must not also keep half a file
            raise

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

    def move_tree(self, src: str, dst: str) -> None:
        os.makedirs(os.path.dirname(self._p(dst)), exist_ok=True)
        os.rename(self._p(src), self._p(dst))


class PyArrowStorage:
    """Object storage through pyarrow.fs (S3, GCS); object PUTs are atomic, so write is too."""

    def __init__(self, uri: str):
        from pyarrow import fs as pafs

        from sailor_core.uris import filesystem_for

        self._fs, self._root = filesystem_for(uri)
        self._pafs = pafs

    def _p(self, path: str) -> str:
        return f"{self._root.rstrip('/')}/{path}" if path else self._root

    def write(self, path: str, data: bytes) -> None:
        with self._fs.open_output_stream(self._p(path)) as f:
            f.write(data)

    def read(self, path: str) -> bytes:
        with self._fs.open_input_stream(self._p(path)) as f:
            return bytes(f.read())

    def exists(self, path: str) -> bool:
        return bool(self._fs.get_file_info(self._p(path)).type != self._pafs.FileType.NotFound)

    def listdir(self, path: str) -> list[str]:
        sel = self._pafs.FileSelector(self._p(path), allow_not_found=True)
        return sorted(i.base_name for i in self._fs.get_file_info(sel))

    def delete_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):  # gone already; any other error is the caller's
            self._fs.delete_dir(self._p(path))

    def move_tree(self, src: str, dst: str) -> None:
        # object stores have no directory rename: copy every object, then delete the source
        sel = self._pafs.FileSelector(self._p(src), recursive=True, allow_not_found=True)
        base = self._p(src).rstrip("/") + "/"
        for info in self._fs.get_file_info(sel):
            if info.type == self._pafs.FileType.File:
                self._fs.copy_file(info.path, self._p(dst).rstrip("/") + "/" + info.path[len(base):])
        self.delete_tree(src)


STORAGE_RETRY_S = 120.0  # how long an object store may fail transiently before the caller is told
_RETRY_FIRST_S, _RETRY_MAX_S = 0.5, 8.0  # exponential backoff between tries, capped
# Errors of an object store that no retry mends (pyarrow raises a plain OSError for all of them).
_PERMANENT_MARKERS = ("ACCESS_DENIED", "AccessDenied", "HTTP status 403", "Forbidden", "NoSuchBucket",
                      "NO_SUCH_BUCKET", "INVALID_", "InvalidAccessKeyId", "SignatureDoesNotMatch")
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR,
                     errno.ENOTDIR, errno.ENAMETOOLONG, errno.EEXIST, errno.ENOTEMPTY}


def is_transient(e: BaseException) -> bool:
    """Whether a storage error may go away if the call is tried again: an OSError that is not "not found",
    not a local filesystem's permanent condition (full, read-only, permissions) and not an object
    store's refusal (credentials, no such bucket)."""
    if not isinstance(e, OSError) or isinstance(e, FileNotFoundError | PermissionError | IsADirectoryError):
        return False
    if e.errno in _PERMANENT_ERRNOS:
        return False
    return not any(m in str(e) for m in _PERMANENT_MARKERS)


class RetryingStorage:
    """A storage whose calls are retried on transient errors (`is_transient`) with exponential backoff
    for up to `retry_s`; then `StorageUnavailable`. "Not found" and permanent errors pass at once.
    Writes are safe to repeat (each is atomic: a temporary name renamed, or one object PUT); so is
    `move_tree` (it copies what is left, then deletes). `sleep` and `clock` are passed in for tests."""

    def __init__(self, storage: CheckpointStorage, *, retry_s: float = STORAGE_RETRY_S, what: str = "storage",
                 sleep: Any = time.sleep, clock: Any = time.monotonic, log: Any = None) -> None:
        self._s, self.retry_s, self.what = storage, retry_s, what
        self._sleep, self._clock, self._log = sleep, clock, log

    def _call(self, op: str, fn: Any, *args: Any) -> Any:
        deadline = self._clock() + self.retry_s
        pause, tries = _RETRY_FIRST_S, 0
        while True:
            try:
                return fn(*args)
            except OSError as e:
                tries += 1
                if not is_transient(e):
                    raise
                left = deadline - self._clock()
                if left <= 0:
                    raise StorageUnavailable(
                        f"{self.what} kept failing for {self.retry_s:.0f}s ({tries} tries of {op} "
                        f"{args[0] if args else ''!s}): {str(e).splitlines()[0][:200]}; nothing was taken for "
                        f"missing; to fix: check the object store's health and the network, then retry "
                        f"(checkpoints already written are intact)") from e
                if self._log is not None:
                    self._log(f"{self.what}: {op} failed ({str(e).splitlines()[0][:120]}); retrying in {pause:.1f}s")
                self._sleep(min(pause, left))
                pause = min(pause * 2, _RETRY_MAX_S)

    def write(self, path: str, data: bytes) -> None:
        self._call("write", self._s.write, path, data)

    def read(self, path: str) -> bytes:
        return bytes(self._call("read", self._s.read, path))

    def exists(self, path: str) -> bool:
        return bool(self._call("exists", self._s.exists, path))

    def listdir(self, path: str) -> list[str]:
        return list(self._call("listdir", self._s.listdir, path))

    def delete_tree(self, path: str) -> None:
        self._call("delete", self._s.delete_tree, path)

    def move_tree(self, src: str, dst: str) -> None:
        self._call("move", self._s.move_tree, src, dst)


def open_storage(uri: str, *, retry_s: float = STORAGE_RETRY_S) -> CheckpointStorage:
    """The storage of a checkpoint folder or URI; object storage retries transient errors (RetryingStorage)."""
    if "://" in uri and not uri.startswith("file://"):
        from sailor_core.uris import redact

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


class RetentionCancelled(BaseException):  # noqa: N818 - a signal between threads, not an error
    """A retention pass was cancelled between two reads (by `AsyncCheckpointer.close`). A BaseException,
    like KeyboardInterrupt: no handler of a read's errors (which would take the checkpoint for corrupt and
    quarantine it) may catch it."""


class _CancellableReads:
    """A storage whose reads (read, exists, listdir) raise RetentionCancelled once `cancel` is set;
    writes, moves and deletes run to the end, so a cancelled pass leaves no half-moved checkpoint."""

    def __init__(self, storage: CheckpointStorage, cancel: threading.Event) -> None:
        self._s, self._cancel = storage, cancel

    def _check(self) -> None:
        if self._cancel.is_set():
            raise RetentionCancelled()

    def write(self, path: str, data: bytes) -> None:
        self._s.write(path, data)

    def read(self, path: str) -> bytes:
        self._check()
        return self._s.read(path)

    def exists(self, path: str) -> bool:
        self._check()
        return self._s.exists(path)

    def listdir(self, path: str) -> list[str]:
        self._check()
        return self._s.listdir(path)

    def delete_tree(self, path: str) -> None:
        self._s.delete_tree(path)

    def move_tree(self, src: str, dst: str) -> None:
        self._s.move_tree(src, dst)


class AsyncCheckpointer:
    """One background writer per rank; a new save first waits for the previous one's files.

    A save's thread writes the files, then (the writer of meta.json, unless `prune` is False) runs
    the retention pass, which reads older checkpoints to check them: slow on object storage from a
    fraction of a core, so training does not wait for it (one pass at a time: a save whose pass
    would wait for another's skips it). `close()`
    cancels a pass between two reads and waits for every thread: a rank leaving its generation (a
    plan change, a lost peer) is done in the time of its writes, and no pass of it deletes anything
    while the next generation reads the checkpoints."""

    def __init__(self, storage: CheckpointStorage, keep_last: int = 3):
        self.storage = storage
        self.keep_last = keep_last
        self._threads: list[threading.Thread] = []
        self._written: threading.Event | None = None
        self._prune_lock = threading.Lock()
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        self.last_write_s = 0.0  # how long the last completed save took to write its files

    def save(self, step: int, layer_states: dict[int, dict[str, Any]], part_name: str,
             meta: dict[str, Any] | None = None, *, blocking: bool = False, prune: bool = True) -> None:
        """Write one rank's part of checkpoint `step` on a background thread (waited for, retention
        included, when `blocking`); the writer of `meta` then applies retention, unless `prune` is
        False (a just-in-time checkpoint must be done fast: the next save prunes)."""
        self.wait(retention=False)
        written = self._written = threading.Event()
        snapshot = [layer_states]  # released once written, not held through a retention pass

        def work() -> None:
            t0 = time.perf_counter()
            try:
                self._write(step, snapshot.pop(), part_name, meta)
                self.last_write_s = time.perf_counter() - t0
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                self._error = e
                return
            finally:
                written.set()
            # One pass at a time; while one runs, a newer save skips its own (the next one prunes).
            if meta is not None and prune and self._prune_lock.acquire(blocking=False):
                try:
                    self._prune(step)
                except RetentionCancelled:
                    pass
                except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                    self._error = e
                finally:
                    self._prune_lock.release()

        t = threading.Thread(target=work, name=f"ckpt-{step}", daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()
        if blocking:
            self.wait(retention=prune)

    def busy(self) -> bool:
        """Whether the last save's files are still being written (object storage retrying, a slow disk)."""
        return self._written is not None and not self._written.is_set()

    def raise_if_failed(self) -> None:
        """Without waiting: re-raise the error of a write or retention pass that has ended in one."""
        if self._error is not None:
            e, self._error = self._error, None
            raise SailorError(f"writing a checkpoint failed: {e}") from e

    def close(self) -> None:
        """Cancel a retention pass in progress (at its next read), then `wait()` for every thread."""
        self._cancel.set()
        try:
            self.wait()
        finally:
            self._cancel.clear()

    def _write(self, step: int, layer_states: dict[int, dict[str, Any]], part_name: str,
               meta: dict[str, Any] | None) -> None:
        write_part(self.storage, step, layer_states.items(), part_name)
        if meta is not None:
            write_meta(self.storage, step, meta)

    def wait(self, *, retention: bool = True) -> None:
        """Until the last save's files are written (and, with `retention`, every retention pass has
        run); re-raises a write's or a retention pass's error."""
        if retention:
            for t in self._threads:
                t.join()
            self._threads = []
        elif self._written is not None:
            self._written.wait()
        self.raise_if_failed()

    def _prune(self, newest: int) -> None:
        """Keep the newest `keep_last` steps; drop an older one only below a newer valid checkpoint.

        The step just written may not be valid yet (other stages still writing), so the anchor is
        the newest step that checks out now; nothing at or above it is touched."""
        storage = _CancellableReads(self.storage, self._cancel)
        meta = json.loads(storage.read(f"{step_dir(newest)}/meta.json"))
        num_layers = int(meta.get("num_layers", 0))
        steps = sorted(list_steps(storage))
        old = steps[: max(0, len(steps) - self.keep_last)]
        if not old or not num_layers:
            return
        anchor = next((s for s in reversed(steps) if s > old[-1] and check_step(storage, s, num_layers) is None), None)
        if anchor is None:
            return  # no newer valid checkpoint: keep everything
        for s in old:
            reason = check_step(storage, s, num_layers)
            if reason is None or reason.startswith("no meta.json"):
                storage.delete_tree(step_dir(s))  # valid, or a write that never finished
            else:
                quarantine(storage, s, reason)


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
