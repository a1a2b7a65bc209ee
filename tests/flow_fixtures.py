"""Fixtures for flow tests: one Prefect test server per session, and a store with gpt-tiny's cpu profile.

Load them in a test module with `pytest_plugins = ["tests.flow_fixtures"]` (one instance per session).
The store is profiled once per test run by the real `profile` subflow (sailor_core.profiler on this
machine's CPU, about 30 s; the pytest-xdist workers share it), so every flow test plans from
measured numbers.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield


@pytest.fixture(scope="session")
def profiled_once(prefect_harness, tmp_path_factory, worker_id) -> Path:
    """A store with gpt-tiny's cpu profile and the local link, measured by the real `profile` subflow
    once per test run (under pytest-xdist the first worker to get here profiles into the run's shared
    folder, the others wait for it). Never written to: tests copy it (`profiled_store`)."""
    root = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    shared = root / "profiled-gpt-tiny"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "complete").exists():
            _profile(shared / "store")
            (shared / "complete").touch()
    return shared / "store"


@pytest.fixture(scope="session")
def profiled_store(profiled_once, tmp_path_factory) -> str:
    """This session's copy of `profiled_once`: the flow tests write their run histories into it."""
    own = tmp_path_factory.mktemp("flow-store") / "store"
    shutil.copytree(profiled_once, own)
    return str(own)


def _profile(dest: Path) -> None:
    from flows.profiling import profile
    from profiles_store.store import open_store

    book = profile(open_store(str(dest)), "gpt-tiny", ["cpu"], mbs=[1, 2])
    assert book.profiled_points("cpu"), "the profile subflow wrote no cpu profile"


def assert_steps_once_and_events_at_their_step(r: dict, *, total: int, scripted: dict[str, int]) -> None:
    """The run's history lists every step from 1 to the last once (a deployment run's curves had no
    record of steps 21-50), and each scripted event happened at its step (the demo's preemption scripted
    at step 20 came at step 59; its price change at step 80 never came)."""
    from tasks.runstate import RunState, read_metrics

    state = r["cluster"]["state_uri"]
    steps = [row["step"] for row in read_metrics(RunState(uri=state, flow_uri=state, vm_uri=state))]
    assert steps == list(range(1, total + 1)), (steps[:5], len(steps), sorted(set(range(1, total + 1)) - set(steps)))
    for kind, at in scripted.items():
        happened = [e for e in r["events"] if e["kind"] == kind and e.get("scripted")]
        assert happened and happened[0]["at_step"] == at and happened[0]["run_step"] == at, (kind, happened)


def steps_trained(work: Path, run_id: str = "*") -> int:
    """The last step trained by run `run_id` (by default any run) under the work folder `work`, read live:
    rank 0's own step records in each VM's folder (the agent's --run-dir), and the run's copies under `work`
    (after the VMs are gone).
    The copies alone lag: the agents upload every 30 s and the flow flushes every 10 s, and a short run has
    trained hundreds of steps before they show one."""
    files = list(work.glob(f"runs/{run_id}/state/**/metrics*.jsonl"))
    for rec in work.glob(f"runs/{run_id}/local/vms/*.json"):
        try:
            slot = json.loads(rec.read_text()).get("slot")
        except (OSError, ValueError):  # being rewritten, or gone with its VM
            continue
        files += Path(slot).glob("sailor/vm/metrics*.jsonl") if slot else []
    top = 0
    for f in files:
        try:
            lines = f.read_text(errors="replace").splitlines()
        except OSError:  # its VM's folder went with the teardown
            continue
        for line in lines:
            try:
                top = max(top, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    return top
