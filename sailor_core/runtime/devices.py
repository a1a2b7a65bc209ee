"""Binding a process to one device of its machine: what a worker, or a profiler's rank, does first.

Contract: `bind_device(index, gpu_type)` makes device `index` of this machine the calling process's own:
- a GPU type (`cuda` for the profilers): the runtime's `engine.select_device` makes GPU `index`
  current (torch.cuda.set_device), so its kernels and NCCL use that GPU;
- a CPU type on the local testbed, where a device is a CPU share (infra/testbed.py): when
  $SAILOR_DEVICE_CGROUP_ROOT names the VM's cpu cgroup, the process joins its child `dev<index>`
  (its pid into `cgroup.procs`: its threads and later children go with it), whose quota is one
  device's share. Unbound, a process could use the whole VM's quota, i.e. every device's share;
- otherwise (a CPU machine outside the testbed, the testbed's `process` isolation): nothing.
Binding again moves the process to that device. A device the VM lacks, or a cgroup the process cannot
join, is a TestbedError. `device_share()`: the cores of the CPU share this process is bound to (None
when unbound or the share has no quota). `device_cpu_clock()`: this thread's CPU seconds read at the
bound device's speed, CPU seconds / min(1, share) (a one-thread process on a share of q cores runs at
q cores when q < 1); the layer profiler times work without collectives with it, so its times describe
one device, not one core of the host (profiler/layers.py). Unbound: the thread's CPU seconds.
`device_count()`: how many devices this machine has when they are CPU shares (the `dev<i>` under
$SAILOR_DEVICE_CGROUP_ROOT), None elsewhere; a profiler's TP group fits in them.
Importing this module imports no torch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from sailor_core.catalog import is_cpu_type
from sailor_core.errors import TestbedError

CGROUP_ROOT_ENV = "SAILOR_DEVICE_CGROUP_ROOT"
_BOUND: dict[str, float | None] = {"share": None}


def bind_device(index: int, gpu_type: str = "cpu") -> None:
    """Bind this process to device `index` of its machine (see the module's contract)."""
    if index < 0:
        raise ValueError(f"a device index is >= 0, got {index}")
    if not is_cpu_type(gpu_type):
        from sailor_core.runtime.engine import select_device

        select_device(gpu_type, index)
        return
    root = os.environ.get(CGROUP_ROOT_ENV)
    if not root:
        return
    cg = Path(root) / f"dev{index}"
    if not cg.is_dir():
        have = sorted(p.name for p in Path(root).glob("dev*") if p.is_dir())
        raise TestbedError(f"this VM has no device {index} (it has {', '.join(have) or 'none'} under {root}); "
                           f"to fix: run one process per device, ranks 0..{max(0, len(have) - 1)} of the VM")
    try:
        (cg / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        raise TestbedError(f"cannot bind this process to device {index} ({cg}): {e}; to fix: run the testbed "
                           f"as root, or unset {CGROUP_ROOT_ENV}") from None
    _BOUND["share"] = _quota_cores(cg)


def device_count() -> int | None:
    """The devices of this machine when they are CPU shares (the testbed's VM); None elsewhere."""
    root = os.environ.get(CGROUP_ROOT_ENV)
    return len([p for p in Path(root).glob("dev*") if p.is_dir()]) if root else None


def device_share() -> float | None:
    """The cores of the CPU share this process is bound to; None when unbound or without a quota."""
    return _BOUND["share"]


def device_cpu_clock() -> Callable[[], float]:
    """A clock of this thread's CPU time in seconds of the bound device (see the module's contract)."""
    speed = min(1.0, device_share() or 1.0)
    return lambda: time.thread_time() / speed


def _quota_cores(cg: Path) -> float | None:
    try:
        quota = int((cg / "cpu.cfs_quota_us").read_text())
        period = int((cg / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
