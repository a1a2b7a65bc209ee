"""Nothing a `sailor` command started outlives it, also when the command is killed with SIGKILL.

Contract: `hold(pid)` starts a small guardian process (`python -m sailor_cli.lifeline PID`) that
the kernel signals when its parent dies (PR_SET_PDEATHSIG), however the parent died. While the
parent lives, the guardian snapshots the parent's descendants (the ephemeral Prefect server,
local workers in their own sessions, torch helpers) every `SNAPSHOT_S`; when the parent is gone
it sends SIGTERM to every process of the last snapshot that is still the same process (same start
time), waits `GRACE_S` for them to checkpoint and exit, then SIGKILLs what is left. After a clean
exit the command's own cleanup has already ended its children, so the guardian finds nothing.
Linux only (prctl, /proc); elsewhere `hold` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

SNAPSHOT_S = 0.5
GRACE_S = 5.0
PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def hold(pid: int | None = None) -> subprocess.Popen[bytes] | None:
    """Start the guardian of `pid` (default: this process). Returns it, or None where unsupported."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc/self"):
        return None
    pid = pid or os.getpid()
    return subprocess.Popen([sys.executable, "-m", "sailor_cli.lifeline", str(pid)], preexec_fn=_die_with_parent,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of `root`."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                children.setdefault(st[0], []).append(int(name))
                starts[int(name)] = st[1]
    out: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        p = todo.pop()
        if p not in out and p != os.getpid():
            out[p] = starts[p]
            todo.extend(children.get(p, []))
    return out


def _same(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start


def reap(snapshot: dict[int, int], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM, then after `grace_s` SIGKILL, every process of the snapshot still alive; returns them."""
    alive = [p for p, s in snapshot.items() if _same(p, s)]
    for p in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(_same(p, snapshot[p]) for p in alive):
        time.sleep(0.1)
    for p in alive:
        if _same(p, snapshot[p]):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
    return alive


def guard(parent: int) -> int:
    gone = False

    def on_parent_death(*_: object) -> None:
        nonlocal gone
        gone = True

    signal.signal(signal.SIGTERM, on_parent_death)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    parent_start = _stat(parent)
    snapshot: dict[int, int] = {}
    while not gone and parent_start is not None and _same(parent, parent_start[1]):
        snapshot = descendants(parent)
        time.sleep(SNAPSHOT_S)
    reap(snapshot)
    return 0


if __name__ == "__main__":
    sys.exit(guard(int(sys.argv[1])))
