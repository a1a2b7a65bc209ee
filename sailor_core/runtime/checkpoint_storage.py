"""Where checkpoints are kept: a local folder, or an object store through pyarrow's filesystems.

Contract: `CheckpointStorage` is what the checkpoint layout (checkpoint.py) needs of a place: atomic
writes (all or nothing visible), reads, existence, listings, deleting and moving a folder. `LocalStorage`
keeps files under a root folder (a temporary name renamed into place); `PyArrowStorage` an `s3://` or
`gs://` URI (one object PUT per file). `RetryingStorage` wraps object storage: only "not found" means
absent; a transient error (`is_transient`: 5xx, timeout, reset connection) is retried with exponential
backoff for up to `retry_s` (default STORAGE_RETRY_S) and then raised as `StorageUnavailable`, which no
reader takes for a missing or corrupt checkpoint; a permanent one (credentials, a full disk) at once.
`checkpoint.open_storage(uri)` picks and wraps them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import uuid
from typing import Any, Protocol

from sailor_core.errors import StorageUnavailable
from sailor_core.uris import filesystem_for


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
