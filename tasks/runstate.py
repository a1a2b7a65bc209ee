"""Where a run's state lives, and the code its VMs run: nothing a worker writes lands on the flow's disk.

Contract (no Prefect here):
- `RunState` names one folder of object storage (or, for VMs that share this machine's disk, a
  local folder) three ways: `uri`, the public name shown in `sailor runs show` (never credentials);
  `flow_uri`, how the flow reaches it; `vm_uri`, how the VMs reach it (their network may see the
  server at another address). `vm_env` is what a VM needs besides (on the local testbed the object
  store's keys stand in for a cloud VM's instance role; on a cloud it is empty). Under it:
  `checkpoints/` (the runtime's layout, sailor_core/runtime/checkpoint.py), `logs/<vm>/worker-<i>.log`
  and `logs/<vm>/metrics-v<version>.jsonl` (rank 0's own step records, uploaded by its agent),
  `metrics/v<version>.jsonl` (one record per step, written by the flow from what the controller got
  and, at the end, the workers' own records) and `code/<wheel>`. `read_metrics` gives each trained
  step once (`steps_once`).
- `state_for(store_uri, run_id, run_dir)`: `<store>/runs/<run_id>` when the store is s3:// or gs://
  (a cloud VM reaches it with its own role), else a local folder under the run's folder.
- `TestbedObjectStore`: the local testbed's object store, `rclone serve s3` over a folder under the
  work dir (kept across runs, 0700), bound to 127.0.0.1 and the testbed's host address only, with a
  random key pair per server (given to rclone by environment; the VMs get it in theirs, `vm_env`). A run's state
  there is public under the folder that holds its objects (`<work dir>/objects/sailor-runs/runs/<run
  id>`), which stays readable after the server has stopped.
- `build_wheel(cache)`: a wheel of this project's source tree, built once per content hash;
  `publish_wheel(state, wheel)` copies it under `code/` and returns (URL for the VM, sha256).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast
from urllib.parse import quote

import sailor_core
from sailor_core.errors import SailorError
from sailor_core.files import private_dir
from tasks.records import MetricRow

STATE_BUCKET = "sailor-runs"
PACKAGES = ("sailor_cli", "sailor_core", "profiles_store", "infra", "tasks", "flows")  # what the wheel holds


def join(uri: str, *parts: str) -> str:
    """`uri` with path parts appended before its query string."""
    base, sep, query = uri.partition("?")
    path = "/".join([base.rstrip("/"), *(p.strip("/") for p in parts if p)])
    return path + (sep + query if sep else "")


@dataclass(frozen=True, kw_only=True)
class RunState:
    uri: str
    flow_uri: str
    vm_uri: str
    vm_env: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def is_object_storage(self) -> bool:
        return "://" in self.flow_uri and not self.flow_uri.startswith("file://")

    def checkpoints(self, side: str = "flow") -> str:
        return join(self._side(side), "checkpoints")

    def logs(self, side: str = "vm") -> str:
        return join(self._side(side), "logs")

    def _side(self, side: str) -> str:
        return {"flow": self.flow_uri, "vm": self.vm_uri, "public": self.uri}[side]

    def write(self, path: str, data: bytes) -> None:
        from sailor_core.runtime.checkpoint import open_storage

        open_storage(self.flow_uri).write(path, data)

    def read(self, path: str) -> bytes:
        from sailor_core.runtime.checkpoint import open_storage

        return open_storage(self.flow_uri).read(path)


def state_for(store_uri: str | None, run_id: str, run_dir: Path) -> RunState:
    if store_uri and store_uri.startswith(("s3://", "gs://")):
        uri = join(store_uri, "runs", run_id)
        return RunState(uri=uri.partition("?")[0], flow_uri=uri, vm_uri=uri)
    folder = str((run_dir / "state").resolve())
    return RunState(uri=folder, flow_uri=folder, vm_uri=folder)


class TestbedObjectStore:
    """The testbed's S3 server: the flow reaches it on 127.0.0.1, the VMs at the host address."""

    __test__ = False

    def __init__(self, root: Path, host_address: str) -> None:
        from profiles_store.local_servers import LocalS3Server

        # the run's checkpoints and logs as plain files: a folder of this user's only (files.private_dir)
        self.root = private_dir(root, what="testbed object store folder").resolve()
        self.host_address = host_address
        # Keys of this server only, random: with fixed ones any local user could read and write every run's
        # checkpoints and logs through it (it listens on 127.0.0.1 and on the testbed's bridge).
        self.server = LocalS3Server(root, access_key=f"sailor-{secrets.token_hex(6)}",
                                    secret_key=secrets.token_urlsafe(24),
                                    extra_addresses=() if host_address == "127.0.0.1" else (host_address,))
        self.server.start()
        self.server.create_bucket(STATE_BUCKET)

    def state(self, run_id: str) -> RunState:
        s = self.server
        vm_endpoint = f"{self.host_address}:{s.port}"
        vm_uri = f"s3://{STATE_BUCKET}/runs/{run_id}?endpoint_override={quote(vm_endpoint, safe='')}&scheme=http"
        env = {"AWS_ENDPOINT_URL": f"http://{vm_endpoint}", "AWS_ACCESS_KEY_ID": s.access_key,
               "AWS_SECRET_ACCESS_KEY": s.secret_key, "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required", "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
               "AWS_EC2_METADATA_DISABLED": "true"}
        # Its public name is the folder the server keeps the objects in, as plain files: readable by
        # `sailor runs show` after the run, when the server is gone. `s3://sailor-runs/...` named a
        # bucket on AWS that anyone could own, and reading it went there.
        folder = str(self.root / STATE_BUCKET / "runs" / run_id)
        return RunState(uri=folder, flow_uri=s.uri(STATE_BUCKET, f"runs/{run_id}"), vm_uri=vm_uri, vm_env=env)

    def close(self) -> None:
        self.server.stop()


def project_root() -> Path:

    root = Path(sailor_core.__file__).resolve().parent.parent
    if not (root / "pyproject.toml").exists():
        raise SailorError(f"no pyproject.toml beside {root / 'sailor_core'}: the VMs' wheel is built from a "
                          f"source checkout; to fix: run from a checkout of the project (pip install -e .)")
    return root


def _source_hash(root: Path) -> str:
    h = hashlib.sha256()
    files = [root / "pyproject.toml"]
    for pkg in PACKAGES:
        files += sorted(p for p in (root / pkg).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for p in files:
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def build_wheel(cache: Path) -> Path:
    """This checkout as a wheel, built once per content (pip, no dependencies, no build isolation)."""
    root = project_root()
    out = cache / _source_hash(root)
    found = sorted(out.glob("*.whl")) if out.is_dir() else []
    if found:
        return found[0]
    tmp = cache / f"build-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # Built from a copy: setuptools leaves build/ and *.egg-info where it builds, never in the checkout.
    src = tmp / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(root / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(root / pkg, src / pkg, ignore=skip)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp),
                        str(src)], capture_output=True, text=True, cwd=str(tmp))
    shutil.rmtree(src, ignore_errors=True)
    wheels = sorted(tmp.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        raise SailorError(f"building the project's wheel failed: {(r.stderr or r.stdout).strip()[-300:]}; "
                          f"to fix: check that `pip wheel --no-deps {root}` works")
    try:
        tmp.rename(out)
    except OSError:  # a concurrent build of the same content won
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(out.glob("*.whl"))[0]


def publish_wheel(state: RunState, wheel: Path) -> tuple[str, str]:
    """Copy the wheel under the run's state; return (where the VM downloads it, its sha256)."""
    data = wheel.read_bytes()
    state.write(f"code/{wheel.name}", data)
    url = join(state.vm_uri, "code", wheel.name).partition("?")[0] if state.is_object_storage \
        else str(Path(state.vm_uri) / "code" / wheel.name)
    return url, hashlib.sha256(data).hexdigest()


def flush_metrics(state: RunState, version: int, rows: Sequence[MetricRow]) -> None:
    """The per-step records of one plan version, as JSON lines under the run's state."""

    state.write(f"metrics/v{version}.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())


def _jsonl_rows(text: str) -> list[MetricRow]:
    """The step records of a JSON-lines text; a torn line is skipped."""

    rows: list[MetricRow] = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            rows.append(cast(MetricRow, rec))
    return rows


def read_metrics(state: RunState) -> list[MetricRow]:
    """Every trained step's record saved under the run's state (`flush_metrics`), once each (`steps_once`),
    with its `plan_version`; records of a version whose file is missing or torn are skipped, not fatal
    (a picture of the run, not its accounting)."""
    return steps_once(read_raw_metrics(state))


def steps_once(rows: Sequence[MetricRow]) -> list[MetricRow]:
    """Each trained step once, in step order. Within a plan version the newest record of a step wins (a
    retried report may arrive twice); across versions, a version that resumed at step s replaces every
    record after s of the versions before it: those steps were trained again from its checkpoint, and
    what the older version did past it was lost with it."""
    by_version: dict[int, dict[int, MetricRow]] = {}
    for r in rows:
        by_version.setdefault(int(r.get("plan_version", 0)), {})[int(r["step"])] = r
    kept: dict[int, MetricRow] = {}
    for v in sorted(by_version):
        mine = by_version[v]
        first = min(mine)
        for s in [s for s in kept if s >= first]:
            del kept[s]
        kept.update(mine)
    return [kept[s] for s in sorted(kept)]


def workers_metrics(state: RunState) -> dict[int, list[MetricRow]]:
    """The step records rank 0 kept in its own file on its VM (`logs/<vm>/metrics-v<version>.jsonl`,
    uploaded by the VM's agent), per plan version: the source the controller's copy is checked against."""
    from sailor_core.runtime.checkpoint import open_storage

    storage = open_storage(state.flow_uri)
    out: dict[int, list[MetricRow]] = {}
    try:
        vms = storage.listdir("logs")
    except (OSError, FileNotFoundError):
        return out
    for vm in vms:
        try:
            names = storage.listdir(f"logs/{vm}")
        except (OSError, FileNotFoundError, NotADirectoryError):
            continue
        for n in names:
            if n.startswith("metrics-v") and n.endswith(".jsonl") and n[9:-6].isdigit():
                try:
                    text = storage.read(f"logs/{vm}/{n}").decode()
                except (OSError, FileNotFoundError):
                    continue
                out.setdefault(int(n[9:-6]), []).extend(_jsonl_rows(text))
    return out


def saved_metrics(state: RunState) -> dict[int, list[MetricRow]]:
    """The step records saved under `metrics/`, per plan version, as written (not merged across versions)."""
    out: dict[int, list[MetricRow]] = {}
    for r in read_raw_metrics(state):
        out.setdefault(int(r.get("plan_version", 0)), []).append(r)
    return out


def read_raw_metrics(state: RunState) -> list[MetricRow]:
    """Every record saved under `metrics/v<version>.jsonl`, with its `plan_version`, steps as written."""
    from sailor_core.runtime.checkpoint import open_storage

    storage = open_storage(state.flow_uri)
    try:
        names = storage.listdir("metrics")
    except (OSError, FileNotFoundError):
        return []
    rows: list[MetricRow] = []
    for n in sorted(names):
        if n.startswith("v") and n.endswith(".jsonl") and n[1:-6].isdigit():
            try:
                text = storage.read(f"metrics/{n}").decode()
            except (OSError, FileNotFoundError):
                continue
            rows += [cast(MetricRow, {**r, "plan_version": int(n[1:-6])}) for r in _jsonl_rows(text)]
    return rows


def merge_workers_metrics(state: RunState, known: Mapping[int, Sequence[MetricRow]] | None = None) -> int:
    """Rewrite each plan version's records under `metrics/` as the union, by step, of `known` (default: what is
    saved there) and rank 0's own files (`workers_metrics`); returns the records added from those files."""
    known = saved_metrics(state) if known is None else known
    own = workers_metrics(state)
    added = 0
    for v in sorted(set(known) | set(own)):
        by_step = {int(r["step"]): r for r in own.get(v, []) if "step" in r}
        before = len(by_step)
        by_step.update({int(r["step"]): r for r in known.get(v, []) if "step" in r})
        added += len(by_step) - len({int(r["step"]) for r in known.get(v, []) if "step" in r})
        if by_step or before:
            flush_metrics(state, v, [by_step[k] for k in sorted(by_step)])
    return added
