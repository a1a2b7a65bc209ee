"""Checkpoints written in the background, and old ones pruned by retention.

Contract (the layout and validity: checkpoint.py): `AsyncCheckpointer.save` takes an in-memory
snapshot (tensors already copied) and serialises and writes it on a background thread; `wait()` waits
for it and for retention (`wait(retention=False)`: for the writes only; `close()` cancels a retention
pass at its next read and waits: a rank leaving its generation is done in the time of its writes) and
re-raises an error. Retention (`keep_last`) removes a checkpoint only when it is older than a newer
valid one and more than `keep_last` steps are kept; an invalid old one is quarantined instead. It runs
after a save that writes meta.json, on the save's thread once the files are written, one pass at a time
(a save that finds one running skips its own), and not after a just-in-time save (`prune=False`).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from sailor_core.errors import SailorError
from sailor_core.runtime.checkpoint import check_step, list_steps, quarantine, step_dir, write_meta, write_part
from sailor_core.runtime.checkpoint_storage import CheckpointStorage


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
