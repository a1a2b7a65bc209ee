"""A training worker process: one rank per generation, surviving plan changes without restarting.

Contract (`python -m sailor_core.runtime.worker_proc`):
- Controlled mode (`--control HOST:PORT --worker-id W`, or env SAILOR_CONTROL / SAILOR_WORKER_ID):
  the controller hosts a torch TCPStore. For generation g = 0, 1, ... (from SAILOR_FIRST_GENERATION)
  the worker waits for key `g{g}/assign/{W}` (JSON: rank, world_size, plan, settings, resume,
  optional local_rank and rendezvous {host, port}; rank -1 means "exit"), joins a fresh process
  group (through the controller's store under prefix `g{g}/pg`, or through a TCPStore at the
  rendezvous that its rank 0 hosts), trains, and sets
  `g{g}/status/{W}` to `done`, `stopped` or `failed: <reason>`. After a failure (a peer died, a
  timeout) it drops its process group and waits for generation g+1 in the same process, keeping
  torch imported and the dataset in memory, so a reconfiguration costs a rendezvous and a
  checkpoint load, not a cold start.
- torchrun mode (`--assignment FILE`, with torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT): one
  generation from a JSON file {plan, settings, resume}.
Heartbeats: in controlled mode the worker sets `hb/{W}` to the current time every few seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from sailor_core.models.config import get_config
from sailor_core.models.tensor_parallel import set_wait
from sailor_core.plan_format import plan_from_dict
from sailor_core.runtime import comm
from sailor_core.runtime.data import TokenDataset, load_tokens
from sailor_core.runtime.engine import Trainer, TrainSettings, backend_for
from sailor_core.runtime.topology import layout

HEARTBEAT_S = 2.0
_GRAVEYARD: list[Any] = []  # trainers of aborted generations, never freed (see run_generation)


def _log(msg: str) -> None:
    print(f"[sailor-worker {os.getpid()} {time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d}] {msg}", file=sys.stderr, flush=True)


class _DataCache:
    """Corpus tokens kept across generations (reading and tokenising is part of a cold start)."""

    def __init__(self) -> None:
        self._key: Any = None
        self._ds: TokenDataset | None = None

    def get(self, settings: TrainSettings, seq_len: int, vocab: int) -> TokenDataset:
        key = (settings.data, seq_len, settings.seed, vocab)
        if self._key != key:
            self._ds = TokenDataset(load_tokens(settings.data), seq_len, settings.seed, vocab)
            self._key = key
        assert self._ds is not None
        return self._ds


def run_generation(assignment: dict[str, Any], *, data: _DataCache, init: dict[str, Any], local_rank: int = 0) -> str:
    """Join the process group described by `init`, train, and return 'done' or 'stopped'."""
    plan = plan_from_dict(assignment["plan"])
    settings = TrainSettings.from_dict(assignment["settings"])
    cfg = get_config(settings.model)
    rank, world = int(assignment["rank"]), int(assignment["world_size"])
    me = layout(plan)[rank]
    _log(f"plan version {settings.plan_version}: joining as rank {rank} of {world}")
    dist.init_process_group(backend_for(me.gpu_type), rank=rank, world_size=world,
                            timeout=timedelta(seconds=settings.timeout_s), **init)
    trainer = None
    try:
        ds = data.get(settings, cfg.sequence_length, cfg.vocab_size)
        trainer = Trainer(plan, cfg, settings, rank, world, local_rank=local_rank, dataset=ds, log=_log)
        if assignment.get("resume"):
            trainer.load_checkpoint()
        _log(f"plan version {settings.plan_version}: rank {rank} ready at step {trainer.step}")
        return trainer.train()
    except BaseException:
        # An aborted generation may leave gloo work running on its subgroups' threads (blocked on the
        # lost peer until its timeout). Destroying such a group joins those threads, and Python would
        # do that at whatever moment the garbage collector frees the trainer - stalling the next
        # generation. Keep them referenced; their threads end at the timeout.
        _GRAVEYARD.append(trainer)
        raise
    finally:
        if trainer is not None:
            trainer.close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        _log(f"plan version {settings.plan_version}: rank {rank} left its process group")


def _pg_store(a: dict[str, Any], control_store: tuple[str, int], gen: int) -> Any:
    """The rendezvous of one generation: the assignment's TCPStore (hosted by its rank 0, for jobs
    spanning machines) or a prefix of the controller's store (one machine)."""
    from torch.distributed import PrefixStore, TCPStore

    rdv = a.get("rendezvous")
    if not rdv:
        # a client connection of its own: an aborted generation may leave its store client mid-request,
        # and the control connection (status, next assignment) must not share that fate
        host, port = control_store
        own = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=float(a["settings"].get("timeout_s", 60))))
        return PrefixStore(f"g{gen}/pg", own)
    rank = int(a["rank"])
    st = TCPStore(str(rdv["host"]), int(rdv["port"]), world_size=int(a["world_size"]), is_master=rank == 0,
                  timeout=timedelta(seconds=float(a["settings"].get("timeout_s", 60))), wait_for_workers=False)
    return PrefixStore(f"v{a['settings'].get('plan_version', gen)}/pg", st)


def controlled(control: str, worker_id: str) -> int:
    from torch.distributed import TCPStore

    host, port = control.rsplit(":", 1)
    stop_hb = threading.Event()

    def heartbeat() -> None:
        hb_store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
        while not stop_hb.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):
                hb_store.set(f"hb/{worker_id}", str(time.time()))

    threading.Thread(target=heartbeat, daemon=True).start()
    current_gen = [0]

    def watch_abort() -> None:
        # The controller sets g{gen}/abort when a worker of that generation is lost; waking every
        # blocked wait here turns a lost peer into a reconfiguration within milliseconds.
        ab_store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
        while not stop_hb.wait(0.05):
            with contextlib.suppress(Exception):
                if not comm.ABORT.is_set() and ab_store.check([f"g{current_gen[0]}/abort"]):
                    comm.ABORT.set()

    if os.environ.get("SAILOR_ABORTABLE_WAITS", "1") != "0":  # 0: plain waits (lost peers then cost a timeout)
        comm.set_watched(True)
        set_wait(comm.wait)
    threading.Thread(target=watch_abort, daemon=True).start()
    data = _DataCache()
    gen = int(os.environ.get("SAILOR_FIRST_GENERATION", "0"))  # a worker added to a running job
    try:
        while True:
            try:
                # a fresh client per generation: after an aborted generation a connection of this
                # process was seen to stall, and the control path must not depend on old sockets
                store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=600))
                raw = store.get(f"g{gen}/assign/{worker_id}")
            except Exception as e:  # noqa: BLE001 - the controller went away or took too long
                _log(f"no assignment for generation {gen}: {e}")
                return 1
            a = json.loads(raw)
            if int(a["rank"]) < 0:
                return 0
            comm.ABORT.clear()
            current_gen[0] = gen
            try:
                status = run_generation(a, data=data, init={"store": _pg_store(a, (host, int(port)), gen)},
                                        local_rank=int(a.get("local_rank", 0)))
            except Exception as e:  # noqa: BLE001 - a lost peer or timeout: report and await a new plan
                status = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                _log(f"generation {gen} {status}")
            TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30)).set(
                f"g{gen}/status/{worker_id}", status)
            if status in ("done", "stopped"):
                return 0
            gen += 1
    finally:
        stop_hb.set()


def main(argv: list[str] | None = None) -> int:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 PID` dumps every thread's stack
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--control", default=os.environ.get("SAILOR_CONTROL"))
    ap.add_argument("--worker-id", default=os.environ.get("SAILOR_WORKER_ID"))
    ap.add_argument("--assignment", help="JSON file {plan, settings, resume} for a torchrun launch")
    a = ap.parse_args(argv)
    if a.assignment:
        with open(a.assignment) as f:
            spec = json.load(f)
        spec["rank"] = int(os.environ["RANK"])
        spec["world_size"] = int(os.environ["WORLD_SIZE"])
        status = run_generation(spec, data=_DataCache(), init={"init_method": "env://"},
                                local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        return 0 if status in ("done", "stopped") else 1
    if not (a.control and a.worker_id is not None):
        ap.error("pass --control HOST:PORT and --worker-id, or --assignment FILE under torchrun")
    return controlled(a.control, str(a.worker_id))


if __name__ == "__main__":
    sys.exit(main())
