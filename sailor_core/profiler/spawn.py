"""Run a function on N local processes joined by torch.distributed, and collect rank 0's answer.

Contract: `run_workers(target, world_size, args, device=...)` starts `world_size` processes (spawn,
so no torch state is inherited through fork), each calling
`target(rank, world_size, init_method, emit, *args)` where `init_method` is a `file://`
rendezvous private to this call (no TCP port to race for) and `emit(obj)` sends a progress message
to the parent, handed to `on_message`. It returns rank 0's return value. A worker that raises, dies
or outlives `timeout_s` turns into a `ProfilingWorkerError` carrying the worker's own error line
and, in fields, the worker's rank and whether it ran out of memory (`is_out_of_memory`), and every
worker is stopped before `run_workers` returns or raises (KeyboardInterrupt included), so no
process outlives the call. Workers run with OMP_NUM_THREADS=1 (the machines this runs on share
few cores between ranks; see ../shared/ENVIRONMENT.md) and, on CPU, gloo over the loopback device.
Rank r binds itself to device r first (sailor_core/runtime/devices.py): GPU r on CUDA; on the testbed
the VM's CPU share r, as the runtime's worker of device r does.
"""

from __future__ import annotations

import os
import queue as queue_mod
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any

from sailor_core.errors import ProfilingWorkerError, SailorError

_POLL_S = 0.1
_GRACE_S = 5.0


def is_out_of_memory(e: BaseException) -> bool:
    """Python's MemoryError, torch's OutOfMemoryError (CUDA), or a CPU allocator's failure, which torch
    reports as a RuntimeError with the allocator's words."""
    if isinstance(e, MemoryError):
        return True
    text = str(e).lower()
    return type(e).__name__ == "OutOfMemoryError" or "out of memory" in text or "can't allocate memory" in text


def _entry(
    target: Callable[..., Any], rank: int, world_size: int, init_method: str, q: Queue[tuple[str, int, Any]],
    args: tuple[Any, ...], device: str = "cpu",
) -> None:
    try:
        import torch

        from sailor_core.runtime.devices import bind_device

        torch.set_num_threads(1)
        bind_device(rank, device)  # rank r on device r: GPU r, or the testbed VM's CPU share r

        def emit(obj: Any) -> None:
            q.put(("msg", rank, obj))

        out = target(rank, world_size, init_method, emit, *args)
        q.put(("done", rank, out if rank == 0 else None))
    except BaseException as e:  # report every failure, then exit non-zero
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        q.put(("error", rank, (last, traceback.format_exc(), is_out_of_memory(e))))
        raise SystemExit(1) from None


def run_workers(
    target: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    device: str = "cpu",
    on_message: Callable[[Any], None] | None = None,
    timeout_s: float = 900.0,
) -> Any:
    import torch.multiprocessing as mp

    if world_size < 1:
        raise SailorError(f"need at least 1 worker, got {world_size}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    env_overrides = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if device == "cpu":
        env_overrides.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    saved = {k: os.environ.get(k) for k in env_overrides}
    procs = []
    with tempfile.TemporaryDirectory(prefix="sailor-rdzv-") as tmp:
        init_method = f"file://{tmp}/rendezvous"
        try:
            os.environ.update(env_overrides)  # children inherit the environment at start
            for rank in range(world_size):
                p = ctx.Process(target=_entry, args=(target, rank, world_size, init_method, q, args, device),
                                daemon=True)
                p.start()
                procs.append(p)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        ok = False
        try:
            out = _collect(procs, q, world_size, on_message, timeout_s)
            ok = True
            return out
        finally:
            # After a failure the others may sit in a collective that will never complete: stop them now.
            _stop(procs, grace_s=_GRACE_S if ok else 0.0)
            q.close()


def _collect(
    procs: Sequence[BaseProcess], q: Queue[tuple[str, int, Any]], world_size: int,
    on_message: Callable[[Any], None] | None, timeout_s: float,
) -> Any:
    deadline = time.monotonic() + timeout_s
    done: dict[int, Any] = {}
    while len(done) < world_size:
        try:
            kind, rank, payload = q.get(timeout=_POLL_S)
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in done]
            if dead:
                # The queue feeder may lag the exit: give the worker's own error a moment to arrive.
                try:
                    kind, rank, payload = q.get(timeout=2.0)
                except queue_mod.Empty:
                    code = procs[dead[0]].exitcode
                    raise ProfilingWorkerError(
                        f"profiling worker {dead[0]} died (exit code {code}) without an error "
                        f"message; to fix: check memory (an out-of-memory kill looks like this) and retry",
                        rank=dead[0], returncode=code, out_of_memory=code == -signal.SIGKILL,
                    ) from None
            elif time.monotonic() > deadline:
                raise ProfilingWorkerError(
                    f"profiling workers did not finish within {timeout_s:.0f} s; to fix: lower the sizes "
                    f"measured or raise the timeout"
                ) from None
            else:
                continue
        if kind == "msg":
            if on_message is not None:
                on_message(payload)
        elif kind == "done":
            done[rank] = payload
        elif kind == "error":
            last, _full, oom = payload
            raise ProfilingWorkerError(f"profiling worker {rank} failed: {last}", rank=rank, out_of_memory=oom)
    return done[0]


def _stop(procs: Sequence[BaseProcess], grace_s: float) -> None:
    for p in procs:
        if p.is_alive() and grace_s > 0:
            p.join(timeout=grace_s)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
