"""Store locations: a URI -> (pyarrow filesystem, root path), and the few object operations the store uses.

Contract: `resolve(uri, env)` turns a store URI into a `Location` (a pyarrow `FileSystem` plus a
root path); the URI's schemes, query parameters and the environment variables that complete them
are sailor_core.uris's (`store_target`), handed `env` by the caller. Everything above works on a
`Location` through one code path, whatever the backend:

- a local path or `file://` URI (the embedded default),
- `s3://bucket/prefix` with optional query parameters `endpoint_override` (or $AWS_ENDPOINT_URL_S3 /
  $AWS_ENDPOINT_URL), `region`, `anonymous`, `access_key`/`secret_key` (else the AWS credential chain),
  `connect_timeout`, `request_timeout`,
- `gs://bucket/prefix` with optional `endpoint_override` (or $SAILOR_GCS_ENDPOINT /
  $STORAGE_EMULATOR_HOST), `anonymous`, `project_id`.

`Location.put` commits an object atomically: on a local disk it writes a hidden temporary file
and renames it; on an object store a single PUT (or a completed multipart upload) is already
all-or-nothing. Errors from the filesystem become one-line `SailorError`s that say what failed
and how to fix it (`explain`).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

from sailor_core.errors import StoreError
from sailor_core.uris import redact as redact  # re-exported: the store shows its URI through it
from sailor_core.uris import store_target

T = TypeVar("T")

TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Location:
    uri: str  # as the user gave it, for messages
    fs: pafs.FileSystem
    root: str  # path inside `fs`, no trailing slash
    scheme: str  # "file" | "s3" | "gs"
    bucket: str = ""
    endpoint: str = ""
    # S3 only: a client that does not retry, for deletes (see `delete`).
    delete_fs: pafs.FileSystem | None = None
    # False when requests go unsigned (anonymous=true, or no credentials anywhere we can see).
    signed: bool = True

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *[p for p in parts if p]]) if self.root else "/".join(parts)

    def display(self, path: str) -> str:
        """A path as the user would type it (s3://bucket/key, a local path)."""
        return path if self.is_local else f"{self.scheme}://{path}"

    # -- object operations ------------------------------------------------------------------
    def list_files(self, prefix: str) -> list[pafs.FileInfo]:
        """Every file under `prefix` (recursively); an absent prefix is empty."""
        sel = pafs.FileSelector(prefix, recursive=True, allow_not_found=True)
        infos = self.call(f"list {self.display(prefix)}", lambda: self.fs.get_file_info(sel))
        return [i for i in infos if i.type == pafs.FileType.File]

    def get(self, path: str) -> bytes:
        def read() -> bytes:
            try:
                with self.fs.open_input_stream(path) as f:
                    return bytes(f.read())
            except OSError as e:
                # Deleted between the existence check and the GET: as absent as never having been.
                if not isinstance(e, FileNotFoundError) and re.search(
                    r"no_such_key|nosuchkey|not_found", str(e).lower()
                ):
                    raise FileNotFoundError(str(e)) from None
                raise

        return self.call(f"read {self.display(path)}", read)

    def exists(self, path: str) -> bool:
        info = self.call(f"look up {self.display(path)}", lambda: self.fs.get_file_info(path))
        return info.type == pafs.FileType.File

    def put(self, path: str, data: bytes | pa.Buffer) -> None:
        """Write `data` at `path` so that readers see either nothing or all of it."""
        if self.is_local:
            parent, name = path.rsplit("/", 1)
            tmp = f"{parent}/{TMP_PREFIX}{secrets.token_hex(6)}-{name}"

            def write_local() -> None:
                self.fs.create_dir(parent, recursive=True)
                try:
                    with self.fs.open_output_stream(tmp) as f:
                        f.write(data)
                    self.fs.move(tmp, path)  # rename(2): atomic on one filesystem
                except BaseException:
                    try:
                        self.fs.delete_file(tmp)
                    except OSError:
                        pass
                    raise

            self.call(f"write {path}", write_local)
            return

        def write_object() -> None:
            # One write of the whole buffer, then close: the object appears only when the upload
            # completes. (Never stream row groups into an open object: pyarrow's S3 stream commits
            # whatever it has when it is closed or garbage-collected, even after an exception.)
            f = self.fs.open_output_stream(path)
            f.write(data)
            f.close()

        self.call(f"write {self.display(path)}", write_object)

    def delete(self, path: str) -> None:
        if self.delete_fs is None:
            self.call(f"delete {self.display(path)}", lambda: self.fs.delete_file(path))
            return
        # pyarrow's S3 delete_file removes the object, then PUTs a "parent/" directory marker. Some
        # S3-compatible servers (rclone) refuse that marker while the folder still holds objects; the
        # delete itself has happened, so check that instead of failing (and do not retry the marker).
        try:
            self.delete_fs.delete_file(path)
        except OSError as e:
            if "When creating key" not in str(e) or self.exists(path):
                raise StoreError(explain(self, f"delete {self.display(path)}", e)) from None

    def call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except FileNotFoundError:
            raise
        except (OSError, pa.ArrowException) as e:
            raise StoreError(explain(self, what, e)) from None

    def check_reachable(self) -> None:
        """Fail early, in one line, when the bucket is missing, the endpoint down or access denied."""
        if self.is_local:
            info = self.call(f"look up {self.root}", lambda: self.fs.get_file_info(self.root))
            if info.type == pafs.FileType.File:
                raise StoreError(
                    f"store path {self.root} is a file, not a folder; "
                    f"to fix: pass a folder (it is created on first write)"
                )
            return
        info = self.call(f"open bucket {self.bucket}", lambda: self.fs.get_file_info(self.bucket))
        if info.type == pafs.FileType.NotFound:
            raise StoreError(
                f"bucket {self.bucket!r} does not exist at {self.endpoint or 'the default endpoint'}; "
                f"to fix: create it (e.g. `aws s3 mb {self.scheme}://{self.bucket}` or `gcloud storage buckets "
                f"create gs://{self.bucket}`) or point --store at an existing bucket"
            )


def explain(loc: Location, what: str, e: BaseException) -> str:
    """One line: what failed, why (classified), how to fix it."""
    msg = " ".join(str(e).split())
    low = msg.lower()
    where = loc.endpoint or ("the default endpoint" if not loc.is_local else "")
    if loc.is_local:
        if isinstance(e, PermissionError) or "permission denied" in low:
            return (
                f"cannot {what}: permission denied; "
                f"to fix: choose a store folder you can write (--store or $SAILOR_STORE)"
            )
        return f"cannot {what}: {msg}; to fix: check the store path (--store or $SAILOR_STORE)"
    if any(s in low for s in ("network_connection", "could not connect", "couldn't connect", "curlcode",
                              "could not resolve", "unavailable", "connection refused", "timed out", "timeout")):
        return (
            f"cannot {what}: endpoint {where} is unreachable ({_short(msg)}); to fix: check the endpoint "
            f"(?endpoint_override= in the store URI, $AWS_ENDPOINT_URL for s3) and that the server is running"
        )
    if any(s in low for s in ("nosuchbucket", "no_such_bucket", "bucket does not exist", "bucket not found")):
        return (
            f"cannot {what}: bucket {loc.bucket!r} does not exist at {where}; to fix: create it or point "
            f"--store at an existing bucket"
        )
    unsigned_refused = not loc.signed and re.search(r"http status (400|401|403)", low)
    if unsigned_refused or any(
        s in low
        for s in (
            "access_denied",
            "accessdenied",
            "signature_does_not_match",
            "invalidaccesskeyid",
            "invalid_access_key",
            "unsupportedalgorithm",
            "forbidden",
            "403",
            "401",
            "permission_denied",
            "unauthenticated",
            "credentials",
            "missing_authentication",
        )
    ):
        cred = (
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or access_key=/secret_key= in the URI) to a key "
            "allowed on this bucket"
            if loc.scheme == "s3"
            else "run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS "
            "(anonymous=true for a public or emulated bucket)"
        )
        why = "no credentials were found, the request went unsigned" if not loc.signed else _short(msg)
        return f"cannot {what}: access denied at {where} ({why}); to fix: {cred}"
    return f"cannot {what}: {_short(msg)}; to fix: check the store URI, its endpoint and credentials"


def _short(msg: str, n: int = 220) -> str:
    return msg if len(msg) <= n else msg[: n - 3] + "..."


def resolve(uri: str | None, env: Mapping[str, str]) -> Location:
    """Parse a store URI (None: $SAILOR_STORE in `env`, else the embedded default) into a Location.

    Does no I/O. The URI's rules, and the environment variables that complete it, are
    sailor_core.uris's (`store_target`)."""
    t = store_target(uri, env)
    return Location(uri=t.uri, fs=t.fs, root=t.root, scheme=t.scheme, bucket=t.bucket, endpoint=t.endpoint,
                    delete_fs=t.delete_fs, signed=t.signed)
