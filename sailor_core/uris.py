"""Files and folders by URI: a local path, `file://`, or object storage (`s3://`, `gs://`).

Contract: `filesystem_for(uri) -> (pyarrow filesystem, path)` resolves a URI once; the path is
absolute for local files and `bucket/prefix` for object storage. S3 URIs take the query parameters
`endpoint_override` (host:port or http(s)://host:port), `access_key`, `secret_key`, `region` and
`scheme`, GCS URIs `endpoint_override`, `anonymous`, `project_id` and `retry_seconds` (the store's
URI forms, so one URI reaches an S3-compatible server or a GCS emulator without environment
set-up); anything else goes to pyarrow's own URI parser. pyarrow is imported lazily: the planner
and simulator never reach this module.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

from sailor_core.errors import SailorError


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def _split_endpoint(endpoint: str) -> tuple[str, str | None]:
    """'http://host:port' -> ('host:port', 'http'); 'host:port' -> ('host:port', None)."""
    m = re.match(r"^(https?)://(.+?)/?$", endpoint)
    return (m.group(2), m.group(1)) if m else (endpoint.rstrip("/"), None)


def filesystem_for(uri: str) -> tuple[Any, str]:
    from pyarrow import fs as pafs

    if is_local(uri):
        return pafs.LocalFileSystem(), os.path.abspath(uri.removeprefix("file://")).rstrip("/") or "/"
    parts = urlsplit(uri)
    q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    try:
        if parts.scheme == "s3" and q.get("access_key"):
            kwargs: dict[str, Any] = dict(access_key=q["access_key"], secret_key=q.get("secret_key", ""),
                                          region=q.get("region", "us-east-1"))
            if endpoint := q.get("endpoint_override"):
                host, scheme = _split_endpoint(endpoint)
                kwargs.update(endpoint_override=host, scheme=q.get("scheme") or scheme or "https")
                # S3-compatible servers reject the AWS SDK's default trailing checksums
                os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
                os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
            return pafs.S3FileSystem(**kwargs), (parts.netloc + "/" + parts.path.strip("/")).rstrip("/")
        if parts.scheme in ("gs", "gcs") and parts.query:
            gkw: dict[str, Any] = dict(anonymous=q.get("anonymous", "").lower() in ("1", "true", "yes"))
            if q.get("project_id"):
                gkw["project_id"] = q["project_id"]
            if q.get("retry_seconds"):
                from datetime import timedelta

                gkw["retry_time_limit"] = timedelta(seconds=float(q["retry_seconds"]))
            if endpoint := q.get("endpoint_override"):
                host, scheme = _split_endpoint(endpoint)
                gkw.update(endpoint_override=host, scheme=q.get("scheme") or scheme or "https")
            return pafs.GcsFileSystem(**gkw), (parts.netloc + "/" + parts.path.strip("/")).rstrip("/")
        filesystem, path = pafs.FileSystem.from_uri(uri)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad URI
        raise SailorError(f"cannot open {redact(uri)!r}: {e}; to fix: check the URI and credentials") from None
    return filesystem, path.rstrip("/")


def redact(uri: str) -> str:
    """The URI with a secret_key query value hidden, for messages."""
    return re.sub(r"(secret_key=)[^&]*", r"\1***", uri)


def read_uri(uri: str) -> bytes:
    """A whole file's bytes."""
    filesystem, path = filesystem_for(uri)
    try:
        with filesystem.open_input_stream(path) as f:
            return bytes(f.read())
    except FileNotFoundError:
        raise SailorError(f"{redact(uri)!r} does not exist; to fix: check the path or URI") from None
    except OSError as e:
        raise SailorError(f"cannot read {redact(uri)!r}: {e}; to fix: check the path or URI and credentials") from None
