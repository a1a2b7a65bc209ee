"""Files, folders and stores by URI: a local path, `file://`, or object storage (`s3://`, `gs://`).

Contract: the project's one reader of URIs and of the environment variables that complete them.
A function that consults the environment takes it as a parameter (`env`, a Mapping: the edges, the
CLI, the flow and the worker's entry, pass `os.environ`; tests pass a dict), and nothing here
writes to `os.environ`.

- `filesystem_for(uri) -> (pyarrow filesystem, path)`: the runtime's files (checkpoints, data,
  weights, logs), from the URI alone. S3 URIs take the query parameters `endpoint_override`
  (host:port or http(s)://host:port), `access_key`, `secret_key`, `region` and `scheme`, GCS URIs
  `endpoint_override`, `anonymous`, `project_id` and `retry_seconds`; anything else goes to
  pyarrow's own URI parser (and the AWS SDK's credential chain). The path is absolute for local
  files and `bucket/prefix` for object storage.
- `store_target(uri, env) -> StoreTarget`: the profile store's client (short timeouts, a delete
  client that does not retry). What the URI leaves out comes from `env`: for s3 the endpoint
  ($AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL), region ($AWS_REGION, $AWS_DEFAULT_REGION) and whether
  any credentials exist (the AWS chain's variables and files); for gs the endpoint
  ($SAILOR_GCS_ENDPOINT, $STORAGE_EMULATOR_HOST). `default_store_uri(env, cwd)`: $SAILOR_STORE,
  else `.sailor/store` under `cwd`.
- `s3_compat_settings(uris, env)`: the AWS SDK settings that S3-compatible servers (rclone, older
  MinIO) need when one of `uris` (or `env`) names an endpoint, less those `env` already has. The
  SDK reads them from the process environment only, so the process's entry point adds them there
  before it opens storage (and passes them on to the processes it starts).

Credentials given in a URI (`access_key`, `secret_key`, `session_token` in the query, or a user and
password before the bucket) stay in memory: every URI that is stored (flow parameters, the run
history), logged or printed goes through `redact` (which also hides the value of every query key it
does not know, and the key itself: a mistyped key may hold a secret) or, inside a text, `redact_text`;
`redact_values` does it to every string of a JSON document. `split_credentials(uri)` takes them out
of a URI into the AWS SDK's environment variables, for a process that must hand the URI on (a flow's
parameters are kept by Prefect). A store URI with a query key `store_target` does not know is refused
(naming no key or value). Nothing here writes a file. pyarrow is imported lazily: the planner and
simulator never reach it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

from sailor_core.errors import SailorError, StoreError

_TRUE = {"1", "true", "yes", "on"}
# S3-compatible servers reject the AWS SDK's default trailing checksums (411/400): ask for checksums
# only where the operation requires them.
S3_COMPAT_ENV = {"AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
                 "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required"}
# What the AWS credential chain looks at before the instance role.
_AWS_CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_ROLE_ARN")


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


# Query keys whose values are not secret, shown as they are; the values of every other key are hidden.
PUBLIC_QUERY_KEYS = ("endpoint_override", "region", "scheme", "anonymous", "project_id", "retry_seconds",
                     "connect_timeout", "request_timeout", "max_attempts")
CREDENTIAL_QUERY_KEYS = {"access_key": "AWS_ACCESS_KEY_ID", "secret_key": "AWS_SECRET_ACCESS_KEY",
                         "session_token": "AWS_SESSION_TOKEN"}
HIDDEN = "***"
_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact(uri: str) -> str:
    """The URI for messages, listings and records: credentials (query values, a user and password) hidden, and
    every query key that is neither public nor a known credential shown as `***=***` (never echoed)."""
    parts = urlsplit(uri)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{HIDDEN}@{netloc.rsplit('@', 1)[1]}"
    if not parts.query and netloc == parts.netloc:
        return uri
    pairs = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in PUBLIC_QUERY_KEYS:
            pairs.append(f"{key}={quote(value, safe=':/')}")
        elif key in CREDENTIAL_QUERY_KEYS:
            pairs.append(f"{key}={HIDDEN}")
        else:
            pairs.append(f"{HIDDEN}={HIDDEN}")
    return urlunsplit((parts.scheme, netloc, parts.path, "&".join(pairs), ""))


def redact_text(text: str) -> str:
    """`text` (a message, an exception's words) with every URI in it redacted."""
    return _URI_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


def redact_values(value: Any) -> Any:
    """A JSON-like value with every string redacted (`redact_text`): for the run history and its listings."""
    if isinstance(value, str):
        return redact_text(value) if "://" in value else value
    if isinstance(value, Mapping):
        return {k: redact_values(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_values(v) for v in value]
    return value


def split_credentials(uri: str) -> tuple[str, dict[str, str]]:
    """(the URI without credentials, the AWS SDK environment variables that carry them instead)."""
    parts = urlsplit(uri)
    if not parts.query:
        return uri, {}
    kept, env = [], {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in CREDENTIAL_QUERY_KEYS:
            env[CREDENTIAL_QUERY_KEYS[key]] = value
        else:
            kept.append(f"{key}={quote(value, safe=':/')}")
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "&".join(kept), "")), env


def check_query_keys(uri: str) -> None:
    """Refuse a query key that is neither public nor a known credential, naming neither it nor its value."""
    unknown = [k for k, _ in parse_qsl(urlsplit(uri).query, keep_blank_values=True)
               if k not in PUBLIC_QUERY_KEYS and k not in CREDENTIAL_QUERY_KEYS]
    if unknown:
        raise StoreError(f"store URI {redact(uri)!r} has {len(unknown)} query parameter(s) sailor does not know "
                         f"(not shown: one may be a secret); to fix: use only {', '.join(PUBLIC_QUERY_KEYS)}, "
                         f"{', '.join(CREDENTIAL_QUERY_KEYS)}")


def split_endpoint(endpoint: str) -> tuple[str, str | None]:
    """'http://host:port' -> ('host:port', 'http'); 'host:port' -> ('host:port', None)."""
    m = re.match(r"^(https?)://(.+?)/?$", endpoint)
    return (m.group(2), m.group(1)) if m else (endpoint.rstrip("/"), None)


def query(uri: str) -> dict[str, str]:
    """The URI's query parameters, the last value of each."""
    return dict(parse_qsl(urlsplit(uri).query))


def s3_endpoint(q: Mapping[str, str], env: Mapping[str, str]) -> str:
    return q.get("endpoint_override") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or ""


def gcs_endpoint(q: Mapping[str, str], env: Mapping[str, str]) -> str:
    return q.get("endpoint_override") or env.get("SAILOR_GCS_ENDPOINT") or env.get("STORAGE_EMULATOR_HOST") or ""


def aws_credentials_configured(env: Mapping[str, str]) -> bool:
    """Whether the AWS credential chain has something to find (env, config files, container/web identity)."""
    if any(env.get(v) for v in _AWS_CREDENTIAL_VARS):
        return True
    files = (env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials",
             env.get("AWS_CONFIG_FILE") or "~/.aws/config")
    if any(os.path.exists(os.path.expanduser(f)) for f in files):
        return True
    return env.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true"  # an instance role may answer


def default_store_uri(env: Mapping[str, str], cwd: str) -> str:
    return env.get("SAILOR_STORE") or os.path.join(cwd, ".sailor", "store")


def s3_compat_settings(uris: Iterable[str], env: Mapping[str, str]) -> dict[str, str]:
    """The SDK settings to add to a process environment `env` before it opens these URIs (see contract)."""
    if not any(u.startswith("s3://") and s3_endpoint(query(u), env) for u in uris):
        return {}
    return {k: v for k, v in S3_COMPAT_ENV.items() if k not in env}


# ---------------------------------------------------------------------------------------------
# The runtime's files


def filesystem_for(uri: str) -> tuple[Any, str]:
    from pyarrow import fs as pafs

    if is_local(uri):
        return pafs.LocalFileSystem(), os.path.abspath(uri.removeprefix("file://")).rstrip("/") or "/"
    parts = urlsplit(uri)
    q = query(uri)
    try:
        if parts.scheme == "s3" and q.get("access_key"):
            kwargs: dict[str, Any] = dict(access_key=q["access_key"], secret_key=q.get("secret_key", ""),
                                          session_token=q.get("session_token"), region=q.get("region", "us-east-1"))
            if endpoint := q.get("endpoint_override"):
                host, scheme = split_endpoint(endpoint)
                kwargs.update(endpoint_override=host, scheme=q.get("scheme") or scheme or "https")
            return pafs.S3FileSystem(**kwargs), (parts.netloc + "/" + parts.path.strip("/")).rstrip("/")
        if parts.scheme in ("gs", "gcs") and parts.query:
            gkw: dict[str, Any] = dict(anonymous=q.get("anonymous", "").lower() in ("1", "true", "yes"))
            if q.get("project_id"):
                gkw["project_id"] = q["project_id"]
            if q.get("retry_seconds"):
                gkw["retry_time_limit"] = timedelta(seconds=float(q["retry_seconds"]))
            if endpoint := q.get("endpoint_override"):
                host, scheme = split_endpoint(endpoint)
                gkw.update(endpoint_override=host, scheme=q.get("scheme") or scheme or "https")
            return pafs.GcsFileSystem(**gkw), (parts.netloc + "/" + parts.path.strip("/")).rstrip("/")
        filesystem, path = pafs.FileSystem.from_uri(uri)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad URI
        raise SailorError(f"cannot open {redact(uri)!r}: {redact_text(str(e))}; to fix: check the URI and "
                          f"credentials") from None
    return filesystem, path.rstrip("/")


def read_uri(uri: str) -> bytes:
    """A whole file's bytes."""
    filesystem, path = filesystem_for(uri)
    try:
        with filesystem.open_input_stream(path) as f:
            return bytes(f.read())
    except FileNotFoundError:
        raise SailorError(f"{redact(uri)!r} does not exist; to fix: check the path or URI") from None
    except OSError as e:
        raise SailorError(f"cannot read {redact(uri)!r}: {redact_text(str(e))}; to fix: check the path or URI and "
                          f"credentials") from None


# ---------------------------------------------------------------------------------------------
# The profile store's


@dataclass(frozen=True)
class StoreTarget:
    """A store URI resolved: its filesystem and root, and what messages say about where it is."""

    uri: str  # as the user gave it, for messages
    fs: Any  # pyarrow.fs.FileSystem
    root: str  # path inside `fs`, no trailing slash
    scheme: str  # "file" | "s3" | "gs"
    bucket: str = ""
    endpoint: str = ""
    delete_fs: Any = None  # S3 only: a client that does not retry, for deletes
    signed: bool = True  # False when requests go unsigned (anonymous=true, or no credentials anywhere)


def store_target(uri: str | None, env: Mapping[str, str]) -> StoreTarget:
    """Parse a store URI (None: `default_store_uri`) into a StoreTarget. Does no I/O."""
    from pyarrow import fs as pafs

    raw = uri if uri else default_store_uri(env, os.getcwd())
    parts = urlsplit(raw)
    scheme = parts.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        path = parts.path if scheme == "file" else raw
        root = os.path.abspath(os.path.expanduser(path)).replace(os.sep, "/").rstrip("/")
        return StoreTarget(uri=raw, fs=pafs.LocalFileSystem(), root=root, scheme="file")
    check_query_keys(raw)
    q = query(raw)
    bucket = parts.netloc
    if not bucket:
        raise StoreError(f"store URI {raw!r} names no bucket; to fix: use {scheme}://BUCKET/PREFIX")
    root = (bucket + "/" + parts.path.strip("/")).rstrip("/")
    if scheme == "s3":
        return _s3_store(raw, q, env, bucket, root)
    if scheme in ("gs", "gcs"):
        return _gcs_store(raw, q, env, bucket, root)
    raise StoreError(f"unsupported store URI scheme {scheme!r} in {raw!r}; to fix: use a local path, "
                     f"s3://BUCKET/PREFIX or gs://BUCKET/PREFIX")


def _s3_store(raw: str, q: Mapping[str, str], env: Mapping[str, str], bucket: str, root: str) -> StoreTarget:
    import pyarrow as pa
    from pyarrow import fs as pafs

    anonymous = q.get("anonymous", "").lower() in _TRUE
    endpoint = s3_endpoint(q, env)
    kwargs: dict[str, Any] = dict(
        anonymous=anonymous,
        region=q.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
        connect_timeout=float(q.get("connect_timeout") or 5),
        request_timeout=float(q.get("request_timeout") or 60),
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=int(q.get("max_attempts") or 3)),
        allow_bucket_creation=False,
        allow_bucket_deletion=False,
    )
    if q.get("access_key"):
        kwargs.update(access_key=q["access_key"], secret_key=q.get("secret_key") or "",
                      session_token=q.get("session_token"))
    signed = not anonymous and bool(q.get("access_key") or aws_credentials_configured(env))
    if endpoint:
        host, sch = split_endpoint(endpoint)
        kwargs.update(endpoint_override=host, scheme=q.get("scheme") or sch or "https")
    try:
        fs = pafs.S3FileSystem(**kwargs)
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=1)
        delete_fs = pafs.S3FileSystem(**kwargs)
    except (OSError, pa.ArrowException, ValueError) as e:
        raise StoreError(f"cannot set up S3 for {redact(raw)!r}: {redact_text(str(e))}; to fix: check the URI's query "
                         f"parameters") from None
    return StoreTarget(uri=raw, fs=fs, root=root, scheme="s3", bucket=bucket, endpoint=endpoint, delete_fs=delete_fs,
                       signed=signed)


def _gcs_store(raw: str, q: Mapping[str, str], env: Mapping[str, str], bucket: str, root: str) -> StoreTarget:
    import pyarrow as pa
    from pyarrow import fs as pafs

    anonymous = q.get("anonymous", "").lower() in _TRUE
    endpoint = gcs_endpoint(q, env)
    retry = timedelta(seconds=float(q.get("retry_seconds") or 15))
    gkw: dict[str, Any] = dict(anonymous=anonymous, retry_time_limit=retry)
    if q.get("project_id"):
        gkw["project_id"] = q["project_id"]
    if endpoint:
        host, sch = split_endpoint(endpoint)
        gkw.update(endpoint_override=host, scheme=q.get("scheme") or sch or "https")
    try:
        fs = pafs.GcsFileSystem(**gkw)
    except (OSError, pa.ArrowException, ValueError) as e:
        raise StoreError(f"cannot set up GCS for {redact(raw)!r}: {redact_text(str(e))}; to fix: check the URI's "
                         f"query parameters") from None
    return StoreTarget(uri=raw, fs=fs, root=root, scheme="gs", bucket=bucket, endpoint=endpoint, signed=not anonymous)
