"""A job's last checkpoint must not fail it for housekeeping: the retention pass that prunes older
checkpoints runs after the ranks agreed the checkpoint is written, so a slow pass holds only its own rank.

Found with tests/test_chaos.py's S3 outage: after the server came back, the job trained all 40 steps and
then failed at its last checkpoint ("Timed out waiting 20000ms for recv"). Rank 0, the writer of
meta.json, ran the retention pass (reading older checkpoints back over S3) before the world's barrier,
and rank 1 waited in that barrier past the peer timeout.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sailor_core.runtime.checkpoint_io import CheckpointIO
from sailor_core.runtime.checkpoint_writer import AsyncCheckpointer
from sailor_core.runtime.comm import Waiter
from tests.waits import hold_for, wait_for

PEER_TIMEOUT_S = 2.0  # the process group's timeout: how long a rank waits for a peer in a collective
PASS_S = 5.0  # how long rank 0's retention pass takes (object storage read back from a fraction of a core)


def _state(v: float) -> dict:
    t = torch.full((2, 2), float(v))
    return {"tp": 1, "tp_rank": 0, "shard_dims": {"w": None}, "params": {"w": t}, "exp_avg": {"w": t * 0},
            "exp_avg_sq": {"w": t * 0}}


def _rank(rank: int, tmp: Path) -> None:
    """Two checkpoints (the last one blocking, as a job's end), each rank writing its layer, rank 0 the meta."""
    code = 1
    try:
        slow_pass = AsyncCheckpointer._prune

        def _prune(self: AsyncCheckpointer, newest: int) -> None:
            hold_for(PASS_S, "a retention pass reading older checkpoints back from slow storage")
            slow_pass(self, newest)

        AsyncCheckpointer._prune = _prune  # type: ignore[method-assign]
        store = dist.FileStore(str(tmp / "store"), 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=timedelta(seconds=PEER_TIMEOUT_S))
        io = CheckpointIO(str(tmp / "ckpt"), rank=rank, device=torch.device("cpu"), waiter=Waiter(),
                          log=lambda _m: None)
        for step in (1, 2):
            meta = {"num_layers": 2, "step": step} if rank == 0 else None
            io.save(step, lambda s=step, m=meta: ({rank: _state(s)}, m), f"part_s{rank}_t0.json",
                    blocking=step == 2)
        (tmp / f"rank-{rank}.saved").write_text(str(time.monotonic()))  # through the last checkpoint
        io.close()
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001 - reported to the parent through the file
        (tmp / f"rank-{rank}.err").write_text(traceback.format_exc())
    finally:
        os._exit(code)  # a forked child must not run pytest's exit handlers


@pytest.mark.timeout(120)
def test_a_slow_retention_pass_at_the_last_checkpoint_does_not_time_out_the_peers(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, tmp_path)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        wait_for(lambda: all(p.exitcode is not None for p in procs), 60, "both ranks to end")
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
    errors = [f.read_text() for f in sorted(tmp_path.glob("rank-*.err"))]
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0, 0]
    assert (tmp_path / "ckpt" / "step_00000002" / "meta.json").exists()
    # rank 1 came through the checkpoint without waiting for rank 0's pass; rank 0 after its pass
    through = [float((tmp_path / f"rank-{r}.saved").read_text()) for r in range(2)]
    assert through[0] - through[1] > PASS_S / 2, through
