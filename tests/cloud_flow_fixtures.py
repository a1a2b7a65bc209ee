"""Helpers for the flow runs on aws (moto) and gcp (the Compute fake): a store, an interrupter, a leak check.

- `cloud_store(profiled_store, dest, zones)` copies the session's profiled store and adds the
  measured local cpu link between the given cloud zones: the runs use CPU VMs (GPU type `cpu`)
  whose workers run on this machine (tests/fakes/agents_here.py), so that link is what they use.
- `when_step(board, step, action)` runs `action` in a thread once the flow saw any worker at `step`.
- `INTERRUPTED_RUN_STEPS`: how long the interrupted runs train (see its comment).
- `leaks(secrets, ...)` greps every Prefect log line and artifact, every store row and every file
  under the run's folder for the given secrets and returns where they were found.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from profiles_store.tables import NETWORK_LINKS
from sailor_core.domain import NetworkLink, Provenance

# Steps of the interrupted cloud runs: the workers must still have steps left once the flow has seen the
# notice. A loaded machine saw a notice given at step 4 only at step 48 (a calibration replan held the
# monitor), and a 60-step run ended before the switch trained a step (no `reconfigured`). Still a race
# with the run's speed, with about 3x the lag seen as margin.
INTERRUPTED_RUN_STEPS = 150


def cloud_store(profiled_store: str, dest: Path, zones: Iterable[str]) -> str:
    """A copy of the session's profiled store with the cpu link between the given cloud zones.

    The workers of these tests' cloud VMs (GPU type `cpu`, CPU instances) run on this machine, so
    the link measured between two local workers is the link they use; the provenance says so.
    """
    from profiles_store.store import open_store

    shutil.copytree(profiled_store, dest)
    store = open_store(str(dest))
    prov = Provenance(source="test: the local cpu link, for cloud VMs whose workers run on this machine")
    cpu_link = next(lk for lk in store.read(NETWORK_LINKS) if lk.sender_gpu == "cpu")
    zs = list(zones)
    store.write(NETWORK_LINKS, [
        NetworkLink(sender_zone=a, sender_gpu="cpu", sender_count=1, receiver_zone=b, receiver_gpu="cpu",
                    receiver_count=1, fit=cpu_link.fit) for a in zs for b in zs], provenance=prov)
    return str(dest)


def zones_per_plan(run: dict[str, Any]) -> list[set[str]]:
    """The zones each of a stored run's plans placed replicas in, in plan order."""
    return [{rep["zone"] for st in p["plan"]["stages"] for rep in st["replicas"]} for p in run["plans"]]


def assert_two_ranks_on_one_vm(plan: dict[str, Any], zone: str) -> None:
    """The plan runs two ranks (two replicas or stages, or one tp=2 replica) on the 2-device VM of `zone`."""
    reps = [rep for st in plan["stages"] for rep in st["replicas"] if rep["zone"] == zone]
    assert sum(rep["tp"] for rep in reps) == 2 and {rep["gpus_per_node"] for rep in reps} == {2}, reps


def when_step(board: Any, step: int, action: Callable[[], None], *, timeout_s: float = 300) -> threading.Thread:
    """Run `action` once the flow has seen any worker at `step` (the heartbeat board its monitor keeps:
    what the workers report to the run's controller)."""
    def run() -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if board.max_step() >= step:
                action()
                return
            time.sleep(0.2)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def notice_runs_out(provider: Any, vm_id: str, notice_s: float) -> None:
    """A spot notice of `notice_s`: returns once the flow has stopped the VM's agent (its workers checkpoint
    on the way) or the notice has run out, whichever comes first; then the cloud takes the VM back."""
    deadline = time.monotonic() + notice_s
    while vm_id in provider.alive() and time.monotonic() < deadline:
        time.sleep(0.2)


def leaks(secrets: Iterable[str], *, store_uri: str, folders: Iterable[Path], extra: Iterable[str] = ()) -> list[str]:
    """Where any secret appears: Prefect logs and artifacts, store rows, files, extra texts."""
    from prefect.client.orchestration import get_client

    from profiles_store import TABLES
    from profiles_store.store import open_store

    secrets = [s for s in secrets if s]
    found: list[str] = []

    def check(where: str, text: str) -> None:
        for s in secrets:
            if s in text:
                found.append(f"{where}: contains a credential")

    with get_client(sync_client=True) as client:
        offset = 0
        while True:
            logs = client.read_logs(limit=200, offset=offset)
            if not logs:
                break
            for lg in logs:
                check(f"log {lg.flow_run_id}", lg.message)
            offset += len(logs)
        for a in client.read_artifacts():
            check(f"artifact {a.key}", json.dumps(a.data, default=str) + str(a.description or ""))
    store = open_store(store_uri)
    for name in TABLES:
        try:
            rows = store.read_table(name).to_pylist()
        except Exception:
            continue
        check(f"store table {name}", json.dumps(rows, default=str))
    for folder in folders:
        for f in Path(folder).rglob("*"):
            if f.is_file():
                check(f"file {f}", f.read_bytes().decode("latin-1"))
    for i, text in enumerate(extra):
        check(f"extra {i}", text)
    return found
