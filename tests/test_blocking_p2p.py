"""Pipeline point-to-point stays deadlock-free when a send blocks until its receive is posted (NCCL).

Gloo buffers sends, so a schedule that sends before posting the receive its peer's send is waiting
for still runs on CPU, and hangs on NCCL once activations are a few MB. Here every rank's
point-to-point calls go through `RendezvousP2P`, a wrapper of torch.distributed's p2p functions:
- a rank issues its operations in program order and a send does not start (the caller blocks)
  until the peer has posted the matching receive, which the receiver announces through the job's
  TCPStore (key "src>dst#n", the n-th message of that pair: messages of a pair match in order, as in
  NCCL and gloo). So a rank blocked in a send posts nothing else, as a CUDA stream blocked on an NCCL
  send launches nothing after it;
- a `batch_isend_irecv` posts all of its receives before it starts its sends, as an NCCL group
  launches all of its operations together;
- a send not matched within RENDEZVOUS_TIMEOUT_S fails its rank with "deadlock".
Every plan then trains in forked processes (the engine's `Trainer` over gloo) and must reach the
losses of one process (the same tolerance as tests/test_runtime.py). A test of the wrapper itself
shows that it turns the classic unbatched exchange (both ranks send, then receive) into a failure.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401 - AdamW imports it lazily (10 s on a busy box): the forked ranks inherit it
import torch.distributed as dist

from profiles_store.tables import LAYER_PROFILES
from sailor_core.domain import ParallelPlan, PipelineBatch, Replica, Stage
from sailor_core.models import get_config
from sailor_core.runtime.engine import Trainer, TrainSettings

CFG = get_config("gpt-tiny")
STEPS = 4
RENDEZVOUS_TIMEOUT_S = 20.0  # a send unmatched this long is a deadlock (ranks start together: see _rank_main)
JOB_DEADLINE_S = 240.0  # a whole job, however loaded the machine; it then fails instead of hanging


class RendezvousDeadlock(RuntimeError):
    """A send's matching receive was never posted."""


class _Op:
    """Stands in for dist.P2POp while the wrapper is installed (P2POp accepts only torch's own isend/irecv)."""

    def __init__(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int | None = None, group: Any = None,
                 tag: int = 0):
        if group is not None:
            raise ValueError("RendezvousP2P handles the default group only (the engine's pipeline sends)")
        self.op, self.tensor, self.peer, self.tag = op, tensor, peer, tag


class RendezvousP2P:
    """Rendezvous sends over a gloo job (see the module docstring)."""

    def __init__(self, store: Any, rank: int, timeout_s: float):
        self.store, self.rank, self.timeout = store, rank, timedelta(seconds=timeout_s)
        self.sent: Counter[int] = Counter()
        self.received: Counter[int] = Counter()
        self._isend, self._irecv = dist.isend, dist.irecv

    def install(self) -> None:
        dist.isend, dist.irecv = self.isend, self.irecv  # type: ignore[assignment]
        dist.send = lambda tensor, dst=None, **_: self.isend(tensor, dst).wait()  # type: ignore[assignment]
        dist.recv = lambda tensor, src=None, **_: self.irecv(tensor, src).wait()  # type: ignore[assignment]
        dist.P2POp = _Op  # type: ignore[assignment,misc]
        dist.batch_isend_irecv = self.batch_isend_irecv  # type: ignore[assignment]

    @staticmethod
    def _key(src: int, dst: int, n: int) -> str:
        return f"{src}>{dst}#{n}"

    def irecv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
        assert src is not None and group is None, (src, group)
        n = self.received[src]
        self.received[src] += 1
        work = self._irecv(tensor, src=src, tag=tag)
        self.store.set(self._key(src, self.rank, n), "posted")
        return work

    def isend(self, tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0) -> Any:
        assert dst is not None and group is None, (dst, group)
        n = self.sent[dst]
        self.sent[dst] += 1
        try:
            self.store.wait([self._key(self.rank, dst, n)], self.timeout)
        except Exception as e:  # noqa: BLE001 - the store's timeout error type varies by version
            raise RendezvousDeadlock(
                f"deadlock: rank {self.rank}'s send #{n} to rank {dst} met no posted receive within "
                f"{self.timeout.total_seconds():.0f} s") from e
        return self._isend(tensor, dst=dst, tag=tag)

    def batch_isend_irecv(self, ops: list[_Op]) -> list[Any]:
        works: dict[int, Any] = {}
        for i, op in enumerate(ops):
            if op.op == self.irecv:  # bound methods: equal, not identical
                works[i] = self.irecv(op.tensor, op.peer, tag=op.tag)
        for i, op in enumerate(ops):
            if op.op == self.isend:
                works[i] = self.isend(op.tensor, op.peer, tag=op.tag)
        if len(works) != len(ops):
            raise ValueError("a batch holds an operation that is neither isend nor irecv")
        return [works[i] for i in range(len(ops))]


# -- a gloo job of forked processes -----------------------------------------------------------------


def _rank_main(rank: int, world: int, port: Any, rendezvous_s: float | None, body: Callable[[int, int], None],
               err_dir: str) -> None:
    code = 1
    try:
        from torch.distributed import PrefixStore, TCPStore

        torch.set_num_threads(1)
        if rank == 0:  # rank 0 hosts the store, so the parent forks with no store server thread running
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
            port.value = store.port
        else:
            deadline = time.monotonic() + 60
            while port.value == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError("rank 0 published no store port within 60 s")
                time.sleep(0.01)
            store = TCPStore("127.0.0.1", port.value, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=PrefixStore("pg", store), rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        if rendezvous_s is not None:
            RendezvousP2P(PrefixStore("rdv", store), rank, rendezvous_s).install()
        body(rank, world)
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001 - reported to the parent through the file
        Path(err_dir, f"rank-{rank}.err").write_text(traceback.format_exc())
    finally:
        os._exit(code)  # a forked child must not run the parent's (pytest's) exit handlers


def run_job(world: int, body: Callable[[int, int], None], tmp: Path, *, rendezvous_s: float | None) -> list[str]:
    """Run `body(rank, world)` on `world` forked gloo ranks. Returns the failed ranks' tracebacks;
    the first failure kills the other ranks (they would wait for it until gloo's timeout)."""
    tmp.mkdir(parents=True, exist_ok=True)
    # Forking is fast and safe here: the parent runs no torch.distributed thread while it forks (a child forked
    # while a store server thread held a lock hung before registering, and the job timed out waiting for it).
    ctx = multiprocessing.get_context("fork")
    port = ctx.Value("i", 0)  # rank 0's store port, shared with the other ranks
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, rendezvous_s, body, str(tmp)))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOB_DEADLINE_S
    try:
        while any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                return [f"job still running after {JOB_DEADLINE_S:.0f} s"]
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
    return [f.read_text() for f in sorted(tmp.glob("rank-*.err"))]


def train_plan(p: ParallelPlan, tmp: Path, *, rendezvous_s: float | None = RENDEZVOUS_TIMEOUT_S,
               steps: int = STEPS) -> list[float]:
    out = tmp / "metrics.jsonl"

    def body(rank: int, world: int) -> None:
        settings = TrainSettings(model=CFG.name, steps=steps, metrics_out=str(out), timeout_s=60)
        trainer = Trainer(p, CFG, settings, rank, world)
        dist.barrier()  # ranks start the schedule together, so a send's wait measures the schedule only
        trainer.train()

    errors = run_job(p.num_gpus, body, tmp, rendezvous_s=rendezvous_s)
    assert not errors, "\n".join(errors)
    return [json.loads(line)["loss"] for line in out.read_text().splitlines()]


def rep(tp: int = 1) -> Replica:
    return Replica(gpu_type="cpu", zone="local", tp=tp, gpus_per_node=2)


def plan(
    stages: list[tuple[tuple[int, int], list[Replica]]], pipelines=((2, 4),), schedule: str = "1f1b"
) -> ParallelPlan:
    pipes = tuple(PipelineBatch(microbatch_size=m, num_microbatches=n) for m, n in pipelines)
    return ParallelPlan(model=CFG.name, global_batch_size=sum(x.samples for x in pipes), schedule=schedule,
                        stages=tuple(Stage(first_layer=a, last_layer=b, replicas=tuple(r)) for (a, b), r in stages),
                        pipelines=pipes)


SINGLE = plan([((0, 5), [rep()])])
PLANS = {
    "1f1b-2stages": plan([((0, 2), [rep()]), ((3, 5), [rep()])]),
    "gpipe-3stages-uneven": plan([((0, 1), [rep()]), ((2, 4), [rep()]), ((5, 5), [rep()])], schedule="gpipe"),
    "1f1b-3stages-uneven": plan([((0, 1), [rep()]), ((2, 4), [rep()]), ((5, 5), [rep()])]),
    # fewer microbatches than stages: the warm-up is cut short on the first stages
    "1f1b-4stages-2microbatches": plan([((0, 0), [rep()]), ((1, 2), [rep()]), ((3, 4), [rep()]), ((5, 5), [rep()])],
                                       ((4, 2),)),
    # TP degrees change between stages: a sender feeds several TP ranks, gradients come back from several
    "1f1b-tp2-then-tp1": plan([((0, 3), [rep(2)]), ((4, 5), [rep()])]),
    "1f1b-tp1-tp2-tp1": plan([((0, 1), [rep()]), ((2, 3), [rep(2)]), ((4, 5), [rep()])]),
    # two pipelines whose stage-0 replicas shard differently, with their own microbatch counts
    "1f1b-2pipelines-mixed-tp": plan([((0, 2), [rep(1), rep(2)]), ((3, 5), [rep(1), rep(1)])], ((2, 1), (2, 3))),
}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> list[float]:
    return train_plan(SINGLE, tmp_path_factory.mktemp("single"), rendezvous_s=None)


@pytest.mark.parametrize("name", list(PLANS))
def test_schedule_runs_under_rendezvous_sends(name, baseline, tmp_path):
    got = train_plan(PLANS[name], tmp_path)
    assert len(got) == len(baseline) == STEPS and baseline[-1] < baseline[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, baseline, strict=True)) <= 1e-3, (got, baseline)


def _exchange(batched: bool) -> Callable[[int, int], None]:
    def body(rank: int, world: int) -> None:
        peer = 1 - rank
        out, into = torch.full((4,), float(rank)), torch.empty(4)
        works: list[Any]
        if batched:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)])
        else:  # the pre-fix engine's order: send first, then receive
            works = [dist.isend(out, dst=peer), dist.irecv(into, src=peer)]
        for w in works:
            w.wait()
        assert float(into[0]) == peer

    return body


def test_wrapper_turns_an_unbatched_exchange_into_a_deadlock(tmp_path):
    errors = run_job(2, _exchange(batched=False), tmp_path / "unbatched", rendezvous_s=3.0)
    assert errors and all("deadlock: rank" in e for e in errors), errors
    assert run_job(2, _exchange(batched=True), tmp_path / "batched", rendezvous_s=3.0) == []
    assert run_job(2, _exchange(batched=False), tmp_path / "gloo", rendezvous_s=None) == []  # gloo buffers


# -- device selection and the GPU check, without a GPU -----------------------------------------------


def test_each_cuda_rank_makes_its_own_gpu_current(monkeypatch):
    from sailor_core.runtime.comm import device_ids
    from sailor_core.runtime.engine import backend_for, select_device

    made_current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    got = [select_device("A100-40", local_rank) for local_rank in range(5)]
    assert got == made_current == [torch.device("cuda", r % 4) for r in range(5)]
    assert select_device("cpu", 3) == torch.device("cpu") and len(made_current) == 5  # CPU ranks touch no GPU
    assert device_ids(torch.device("cuda", 2)) == [2] and device_ids(torch.device("cpu")) is None
    assert backend_for("A100-40") == "nccl" and backend_for("cpu") == "gloo"


def test_gpu_check_prints_skip_lines_without_cuda():
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: run bench/gpu_check.py itself")
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(repo / "bench" / "gpu_check.py")], capture_output=True, text=True,
                       timeout=120, cwd=repo)
    checks = [ln for ln in r.stdout.splitlines() if ln.startswith("CHECK ")]
    assert r.returncode == 0, r.stderr
    assert [c.split(":")[0] for c in checks] == [f"CHECK {n}" for n in (
        "cuda", "train-1rank", "train-1f1b-2stages", "train-tp2", "train-dp2", "train-1f1b-2stages-dp2",
        "profile-opt350")]
    assert all(": SKIP " in c for c in checks), checks


def test_gpu_check_compares_a_profile_with_the_published_one(tmp_path):
    import dataclasses
    import importlib.util

    from profiles_store import open_store

    spec = importlib.util.spec_from_file_location(
        "gpu_check", Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    )
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    store = open_store(str(tmp_path / "store"))  # the shipped seed: the artifact's published profiles

    def published(gpu_type: str) -> list[Any]:
        return store.read(LAYER_PROFILES, {"model": "OPT-350", "gpu_type": [gpu_type]})

    same = [p for p in published("GH-96") if p.tp == 1 and p.mbs in (1, 2, 4)]
    ok, detail = gpu_check.compare_with_published(same, published, "GH-96")
    assert ok and "x1.00 of GH-96" in detail and "A100-40" not in detail, detail
    slow = [dataclasses.replace(p, forward_s=3 * p.forward_s, backward_s=3 * p.backward_s) for p in same]
    ok, detail = gpu_check.compare_with_published(slow, published, "GH-96")
    assert not ok and "x3.00 of the published GH-96" in detail, detail
    ok, detail = gpu_check.compare_with_published(slow, published, "H200")  # a type the artifact did not profile
    assert ok and "H200 is not published" in detail and "of A100-40" in detail, detail
    flat = [dataclasses.replace(p, forward_s=1e-3, backward_s=1e-3) for p in same]
    ok, detail = gpu_check.compare_with_published(flat, published, "H200")
    assert not ok and "does not grow with the microbatch" in detail, detail
    broken = [dataclasses.replace(same[0], forward_s=0.0), *same[1:]]  # a layer that took no time: not measured
    assert not gpu_check.compare_with_published(broken, published, "GH-96")[0]
