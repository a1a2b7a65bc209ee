"""Store locations: a URI -> (pyarrow filesystem, root path), and the few object operations the store uses.

Contract: `resolve(uri)` is the only place that knows about schemes. Everything above it works on a
`Location` (a pyarrow `FileSystem` plus a root path) through one code path, whatever the backend:

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

import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar
from urllib.parse import parse_qs, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from sailor_core.errors import StoreError

T = TypeVar("T")

TMP_PREFIX = ".tmp-"
_TRUE = {"1", "true", "yes", "on"}


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


def _aws_credentials_configured() -> bool:
    """Whether the AWS credential chain has something to find (env, config files, container/web identity)."""
    env = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
           "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_ROLE_ARN")
    if any(os.environ.get(v) for v in env):
        return True
    files = (
        os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials",
        os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config",
    )
    if any(os.path.exists(os.path.expanduser(f)) for f in files):
        return True
    return os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true"  # an instance role may answer


def redact(uri: str) -> str:
    """The URI with any secret_key query value hidden, for messages and listings."""
    return re.sub(r"(secret_key=)[^&]*", r"\1***", uri)


def default_store_uri() -> str:
    return os.environ.get("SAILOR_STORE") or os.path.join(os.getcwd(), ".sailor", "store")


def _opt(q: dict[str, list[str]], name: str) -> str | None:
    v = q.get(name)
    return v[-1] if v else None


def _split_endpoint(endpoint: str) -> tuple[str, str | None]:
    """'http://host:port' -> ('host:port', 'http'); 'host:port' -> ('host:port', None)."""
    m = re.match(r"^(https?)://(.+?)/?$", endpoint)
    return (m.group(2), m.group(1)) if m else (endpoint.rstrip("/"), None)


def resolve(uri: str | None) -> Location:
    """Parse a store URI (None: the embedded default) into a Location. Does no I/O."""
    raw = uri if uri else default_store_uri()
    parts = urlsplit(raw)
    scheme = parts.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        path = parts.path if scheme == "file" else raw
        root = os.path.abspath(os.path.expanduser(path)).replace(os.sep, "/").rstrip("/")
        return Location(uri=raw, fs=pafs.LocalFileSystem(), root=root, scheme="file")
    q = parse_qs(parts.query)
    bucket = parts.netloc
    if not bucket:
        raise StoreError(f"store URI {raw!r} names no bucket; to fix: use {scheme}://BUCKET/PREFIX")
    root = (bucket + "/" + parts.path.strip("/")).rstrip("/")
    anonymous = (_opt(q, "anonymous") or "").lower() in _TRUE
    if scheme == "s3":
        endpoint = (
            _opt(q, "endpoint_override")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or ""
        )
        kwargs: dict = dict(
            anonymous=anonymous,
            region=_opt(q, "region")
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1",
            connect_timeout=float(_opt(q, "connect_timeout") or 5),
            request_timeout=float(_opt(q, "request_timeout") or 60),
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=int(_opt(q, "max_attempts") or 3)),
            allow_bucket_creation=False,
            allow_bucket_deletion=False,
        )
        if _opt(q, "access_key"):
            kwargs.update(access_key=_opt(q, "access_key"), secret_key=_opt(q, "secret_key") or "")
        signed = not anonymous and bool(_opt(q, "access_key") or _aws_credentials_configured())
        if endpoint:
            host, sch = _split_endpoint(endpoint)
            kwargs.update(endpoint_override=host, scheme=_opt(q, "scheme") or sch or "https")
            # S3-compatible servers (rclone, older MinIO) reject the AWS SDK's default trailing
            # checksums with 411/400; ask for checksums only where the operation requires them.
            os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
            os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
        try:
            fs: pafs.FileSystem = pafs.S3FileSystem(**kwargs)
            kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=1)
            delete_fs = pafs.S3FileSystem(**kwargs)
        except (OSError, pa.ArrowException, ValueError) as e:
            raise StoreError(
                f"cannot set up S3 for {redact(raw)!r}: {e}; to fix: check the URI's query parameters"
            ) from None
        return Location(
            uri=raw, fs=fs, root=root, scheme="s3", bucket=bucket, endpoint=endpoint, delete_fs=delete_fs, signed=signed
        )
    if scheme in ("gs", "gcs"):
        endpoint = (
            _opt(q, "endpoint_override")
            or os.environ.get("SAILOR_GCS_ENDPOINT")
            or os.environ.get("STORAGE_EMULATOR_HOST")
            or ""
        )
        gkw: dict = dict(anonymous=anonymous, retry_time_limit=timedelta(seconds=float(_opt(q, "retry_seconds") or 15)))
        if _opt(q, "project_id"):
            gkw["project_id"] = _opt(q, "project_id")
        if endpoint:
            host, sch = _split_endpoint(endpoint)
            gkw.update(endpoint_override=host, scheme=_opt(q, "scheme") or sch or "https")
        try:
            fs = pafs.GcsFileSystem(**gkw)
        except (OSError, pa.ArrowException, ValueError) as e:
            raise StoreError(
                f"cannot set up GCS for {redact(raw)!r}: {e}; to fix: check the URI's query parameters"
            ) from None
        return Location(uri=raw, fs=fs, root=root, scheme="gs", bucket=bucket, endpoint=endpoint, signed=not anonymous)
    raise StoreError(
        f"unsupported store URI scheme {scheme!r} in {raw!r}; to fix: use a local path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX"
    )
