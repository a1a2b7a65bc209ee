"""What a run leaves in the work folder and its state, pruned by one stated rule (docs/orchestration.md).

Contract (no Prefect here): `.sailor` grew by about 11 MB per demo run (every checkpoint kept, and a
copy of the project's wheel under each run's state). The rule:

- At the end of a run (`prune_run`): its copy of the wheel under `code/` goes (the VMs that installed it
  are gone; its sha256 stays in the run's record), and of its checkpoints only the newest valid one
  stays (what a resume or an export reads; older steps are removed only below a valid newer one, never
  the only valid one).
- When a run starts (`prune_older_runs`): of the earlier runs of its name, the newest `KEEP_RUNS` keep
  their checkpoint; older ones lose their checkpoints (their history, logs and step records stay).
- The wheel cache (`prune_wheel_cache`, `build/sailor-wheels/<content hash>/`) keeps the newest
  `KEEP_WHEELS` builds.

Every removal is best effort and returns what it removed: pruning must never fail a run.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from tasks.runstate import RunState

KEEP_RUNS = 3  # earlier runs of a name that keep their checkpoint (the newest ones)
KEEP_WHEELS = 3  # builds kept in the wheel cache (the newest ones)


def prune_run(state: RunState, newest_valid: int | None) -> list[str]:
    """The run's wheel copy, and every checkpoint older than `newest_valid` (its newest valid step: none go
    when it has none), removed; returns what went."""
    from sailor_core.runtime import checkpoint as ckpt

    removed: list[str] = []
    root = ckpt.open_storage(state.flow_uri, retry_s=10)
    wheels = root.listdir("code")
    if wheels:
        root.delete_tree("code")
        removed += [f"code/{name}" for name in wheels]
    if newest_valid is None:
        return removed
    storage = ckpt.open_storage(state.checkpoints("flow"), retry_s=10)
    for step in ckpt.list_steps(storage):
        if step < newest_valid:
            storage.delete_tree(ckpt.step_dir(step))
            removed.append(f"checkpoints/{ckpt.step_dir(step)}")
    return removed


def prune_older_runs(run_ids: list[str], state_of: Callable[[str], RunState]) -> list[str]:
    """`run_ids` (one name's earlier runs, oldest first) beyond the newest KEEP_RUNS lose their checkpoints."""
    from sailor_core.runtime import checkpoint as ckpt

    removed: list[str] = []
    for run_id in run_ids[: max(0, len(run_ids) - KEEP_RUNS)]:
        storage = ckpt.open_storage(state_of(run_id).checkpoints("flow"), retry_s=10)
        try:
            steps = ckpt.list_steps(storage)
        except (OSError, FileNotFoundError):
            continue
        for step in steps:
            storage.delete_tree(ckpt.step_dir(step))
            removed.append(f"{run_id}/checkpoints/{ckpt.step_dir(step)}")
    return removed


def prune_wheel_cache(cache: Path, keep: Path | None = None) -> list[str]:
    """The wheel cache's builds beyond the newest KEEP_WHEELS (never `keep`, the build in use), removed."""
    if not cache.is_dir():
        return []
    builds = sorted((p for p in cache.iterdir() if p.is_dir() and not p.name.startswith("build-")),
                    key=lambda p: p.stat().st_mtime)
    removed = []
    for old in builds[: max(0, len(builds) - KEEP_WHEELS)]:
        if keep is not None and old.resolve() == keep.resolve():
            continue
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old.name)
    return removed
