"""A training worker process: one rank per generation, surviving plan changes without restarting.

Contract (`python -m sailor_core.runtime.worker_proc`):
- Controlled mode (`--control HOST:PORT --worker-id W`, or env SAILOR_CONTROL / SAILOR_WORKER_ID, with
  the run's secret in SAILOR_RUN_SECRET): the controller speaks sailor_core/runtime/protocol.py. For
  generation g = 0, 1, ... (from SAILOR_FIRST_GENERATION) the worker waits for its assignment
  (`g<g>/assign/<W>`; rank -1 means "exit", -2 "sit this generation out"), joins a fresh process group
  through a TCPStore that the generation's rank 0 hosts at SAILOR_ADVERTISE_ADDR (announced under
  `g<g>/rdv`), trains, reports each step (rank 0, `metrics/v<version>`, and its own file under
  $SAILOR_METRICS_DIR), holds at the assignment's `hold_at_steps` until released, and sets `g<g>/status/<W>` to
  `done`, `stopped`, `switched` (a plan change ended it) or `failed: <reason>`. After a switch or a
  failure (a peer died, a timeout) it drops its process group and waits for generation g+1 in the
  same process, keeping torch imported, the dataset and its trainer's state in memory: the next
  generation keeps the layers it still holds at the step it resumes at (Trainer.resume), so a
  reconfiguration costs a rendezvous and at most a load of the layers it did not hold, not a cold
  start. The older trainer lives on only until then (`Kept`): its model and optimizer are freed
  before the next generation trains, and an aborted generation leaves only its process groups.
  SIGTERM while waiting for an assignment ends the process at once (exit 0).
- torchrun mode (`--assignment FILE`, with torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT): one
  generation from a JSON file {plan, settings, resume}.
Heartbeats: in controlled mode the worker sets `hb/<W>` to {"time", "step"} every few seconds.
Process state lives in the worker's `WorkerControl` (worker_control.py: heartbeats, the stop and abort
watchers, step reports and holds): its `Notices` (SIGUSR1, SIGTERM, the plan change's stop) and its
`Waiter` (waits a lost peer aborts), handed to each generation's trainer.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from sailor_core.errors import PeerLost
from sailor_core.models.config import config_from_dict, get_config
from sailor_core.plan_format import plan_from_dict
from sailor_core.runtime import protocol
from sailor_core.runtime.comm import Waiter
from sailor_core.runtime.data import TokenDataset
from sailor_core.runtime.devices import bind_device
from sailor_core.runtime.engine import Trainer, TrainSettings, backend_for
from sailor_core.runtime.islands import IslandSamples, IslandSettings
from sailor_core.runtime.notices import Notices
from sailor_core.runtime.protocol import ControlClient
from sailor_core.runtime.token_shards import ShardedTokenDataset, open_dataset
from sailor_core.runtime.topology import layout
from sailor_core.runtime.worker_control import WorkerControl, worker_log
from sailor_core.uris import s3_compat_settings

ASSIGNMENT_WAIT_S = 600.0  # how long a worker waits for its next generation before giving up
STOP_POLL_S = 0.5  # a worker waiting for its next generation notices SIGTERM within this


class _DataCache:
    """Corpus tokens kept across generations (reading and tokenising is part of a cold start)."""

    def __init__(self) -> None:
        self._key: Any = None
        self._ds: TokenDataset | ShardedTokenDataset | None = None

    def get(self, settings: TrainSettings, seq_len: int, vocab: int) -> TokenDataset | ShardedTokenDataset:
        key = (settings.data, seq_len, settings.seed, vocab)
        if self._key != key:
            self._ds = open_dataset(settings.data, seq_len, settings.seed, vocab)  # prepared shards or bytes
            self._key = key
        assert self._ds is not None
        return self._ds


class Kept:
    """The trainer this process keeps between generations: its model and optimizer state at the step it
    reached, for the next generation to keep from memory (Trainer.resume). The next generation takes
    it (`take`) and, once resumed, drops it, so at most one generation's state is alive while training."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    def take(self) -> Trainer | None:
        t, self.trainer = self.trainer, None
        return t


def run_generation(assignment: dict[str, Any], *, data: _DataCache, init: dict[str, Any], local_rank: int = 0,
                   on_metrics: Any = None, kept: Kept | None = None, on_loaded: Any = None,
                   graveyard: list[Any] | None = None, notices: Notices | None = None,
                   waiter: Waiter | None = None) -> str:
    """Join the process group described by `init`, train, and return 'done' or 'stopped'.

    `kept`: this process's trainer of its last generation, if any; where it holds the same shard at
    the resume step, its state is kept from memory instead of loaded. This generation's trainer
    replaces it there once resumed (and also when it then fails: a lost peer leaves its state whole),
    unless its state is torn (`Trainer.consistent`); a generation that fails before it resumed leaves
    the older one. `on_loaded(how)` is told how it resumed before training starts; `graveyard`
    receives the process groups of an aborted generation (see below). `notices` (installed once the
    trainer is built) and `waiter`: the process's (fresh ones when not given)."""
    plan = plan_from_dict(assignment["plan"])
    settings = TrainSettings.from_dict(assignment["settings"])
    # The worker process is an edge: before it opens storage, the AWS SDK's settings for an S3-compatible
    # endpoint go into its environment, the only place the SDK reads them (sailor_core/uris.py).
    os.environ.update(s3_compat_settings([settings.checkpoint_uri or "", settings.data or ""], os.environ))
    cfg = config_from_dict(settings.model_config) if settings.model_config else get_config(settings.model)
    rank, world = int(assignment["rank"]), int(assignment["world_size"])
    me = layout(plan)[rank]
    notices = notices or Notices()
    worker_log(f"plan version {settings.plan_version}: joining as rank {rank} of {world}")
    # Before any communication: NCCL works on the current GPU; on the testbed a device is a CPU share.
    bind_device(local_rank, me.gpu_type)
    dist.init_process_group(backend_for(me.gpu_type), rank=rank, world_size=world,
                            timeout=timedelta(seconds=settings.timeout_s), **init)
    previous = kept.take() if kept is not None else None
    trainer = None
    try:
        ds: Any = data.get(settings, cfg.sequence_length, cfg.vocab_size)
        if settings.islands:  # one island of a semi-synchronous run: its share of each global batch
            isl = IslandSettings.from_dict(settings.islands)
            ds = IslandSamples(ds, plan.global_batch_size, isl.global_batch_size, isl.batch_offset)
        trainer = Trainer(plan, cfg, settings, rank, world, local_rank=local_rank, dataset=ds, log=worker_log,
                          on_metrics=on_metrics, notices=notices, waiter=waiter)
        notices.install()
        loaded = trainer.resume(previous) if assignment.get("resume") else "none"
        previous = None  # resumed: the last generation's model and optimizer are freed before this one trains
        if kept is not None:
            kept.trainer = trainer
        if on_loaded is not None:
            on_loaded(loaded)
        worker_log(f"plan version {settings.plan_version}: rank {rank} ready at step {trainer.step}")
        return trainer.train()
    except BaseException:
        # An aborted generation may leave gloo work running on its subgroups' threads (blocked on the
        # lost peer until its timeout). Destroying such a group joins those threads, and Python would
        # do that at whatever moment the garbage collector frees it - stalling the next generation.
        # Keep the groups referenced (their threads end at the timeout), not the trainer: its model
        # and optimizer state live on only in `kept`, for the next generation's resume, and only
        # when whole (a step torn in the optimizer's update is of no use to anyone: freed now).
        if trainer is not None and graveyard is not None:
            graveyard.extend(trainer.process_groups())
        if trainer is not None and trainer.outer is not None:
            with contextlib.suppress(Exception):  # best effort: the others stop waiting for this island
                trainer.outer.leave()
        if kept is not None and kept.trainer is trainer and trainer is not None and not trainer.consistent:
            kept.trainer = None
        raise
    finally:
        if kept is not None and previous is not None:
            kept.trainer = previous  # failed before resuming: the older state is still the newest held
        if trainer is not None:
            trainer.close()
        with contextlib.suppress(Exception):  # no default group (never joined, or already left): nothing to do
            dist.destroy_process_group()
        worker_log(f"plan version {settings.plan_version}: rank {rank} left its process group")


def _pg_store(a: dict[str, Any], client: ControlClient, gen: int) -> Any:
    """The rendezvous of one generation: a TCPStore that its rank 0 hosts on its own VM (as torchrun's
    master does), announced to the other ranks through the controller under `g<g>/rdv`."""

    timeout = timedelta(seconds=float(a["settings"].get("timeout_s", 60)))
    rank, world = int(a["rank"]), int(a["world_size"])
    if rank == 0:
        addr = os.environ.get("SAILOR_ADVERTISE_ADDR", "127.0.0.1")
        st = TCPStore(addr, 0, world_size=world, is_master=True, timeout=timeout, wait_for_workers=False,
                      master_listen_fd=_listen_on(addr))
        client.set(protocol.rendezvous_key(gen), f"{addr}:{st.port}")
    else:
        host, port = client.wait(protocol.rendezvous_key(gen), timeout.total_seconds()).rsplit(":", 1)
        st = TCPStore(host, int(port), world_size=world, is_master=False, timeout=timeout)
    return PrefixStore(f"g{gen}/pg", st)


def _listen_on(addr: str) -> int:
    """A listening socket on `addr` only, for the rendezvous store to take over: TCPStore's own server
    listens on every interface, and the store is unauthenticated, so it must be reachable only at the
    address the job's peers use (loopback on one machine, the VM's private address on the testbed or
    a cloud). Returns the file descriptor, which the store owns from then on."""

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, 0))
    sock.listen(256)
    return sock.detach()


def controlled(control: str, worker_id: str, secret: str) -> int:
    """Controlled mode: one generation after another from the controller (see the module contract)."""
    ctl = WorkerControl(ControlClient(control, secret), worker_id)
    client = ctl.client
    ctl.start()
    data = _DataCache()
    gen = int(os.environ.get("SAILOR_FIRST_GENERATION", "0"))  # a worker added to a running job
    kept = Kept()
    try:
        while True:
            try:
                raw = _next_assignment(client, protocol.assign_key(gen, worker_id), ctl.notices)
            except protocol.ProtocolError as e:  # the controller went away or took too long
                worker_log(f"no assignment for generation {gen}: {e}")
                return 1
            if raw is None:
                worker_log(f"stopped (SIGTERM) while waiting for generation {gen}")
                return 0
            a = json.loads(raw)
            if int(a["rank"]) == protocol.EXIT:
                return 0
            ctl.waiter.abort.clear()
            ctl.current_gen = gen
            if int(a["rank"]) == protocol.IDLE:
                gen += 1
                kept.trainer = None  # others train on meanwhile: what it holds would be stale
                continue
            status = _train_generation(ctl, a, gen, data, kept)
            try:
                # stopped by SIGTERM (its VM is going): report briefly, the controller may be gone already
                (ctl.reports if ctl.notices.terminated else client).set(protocol.status_key(gen, worker_id), status)
            except protocol.ProtocolError as e:
                worker_log(f"cannot report generation {gen}: {e}")
                return 1
            if status in ("done", "stopped"):
                return 0
            gen += 1
    finally:
        ctl.stop.set()


def _next_assignment(client: ControlClient, key: str, notices: Notices) -> str | None:
    """The assignment under `key`; None when SIGTERM came while waiting for it (the VM is being
    released: nothing to checkpoint, so the process exits at once instead of at its agent's grace
    period); ProtocolError after ASSIGNMENT_WAIT_S."""
    deadline = time.monotonic() + ASSIGNMENT_WAIT_S
    while not notices.terminated:
        left = deadline - time.monotonic()
        if left <= 0:
            raise protocol.ProtocolError(f"no {key} from the controller within {ASSIGNMENT_WAIT_S:.0f}s")
        raw = client.get(key, wait_s=min(STOP_POLL_S, left))
        if raw is not None:
            return raw
    return None


def _train_generation(ctl: WorkerControl, a: dict[str, Any], gen: int, data: _DataCache, kept: Kept) -> str:
    """The generation's status to report; `kept` then holds the trainer to keep in memory for the next
    one, or None."""
    client, worker_id = ctl.client, ctl.worker_id
    ctl.training = gen
    ctl.holds = frozenset(int(x) for x in a.get("hold_at_steps") or ())
    try:
        status = run_generation(a, data=data, init={"store": _pg_store(a, client, gen)},
                                local_rank=int(a.get("local_rank", 0)), on_metrics=ctl.on_metrics,
                                kept=kept, graveyard=ctl.aborted_groups, notices=ctl.notices, waiter=ctl.waiter,
                                on_loaded=lambda how, g=gen: client.set(protocol.loaded_key(g, worker_id), how))
    except Exception as e:  # noqa: BLE001 - a lost peer, a timeout or this rank's own fault: report, await a new plan
        status = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        worker_log(f"generation {gen} {status}")
        if not isinstance(e, PeerLost):
            _abort_peers(ctl, gen, f"worker {worker_id} {status}")
    ctl.training = -1
    if ctl.switching == gen:  # the stop was the plan change's, not the run's end
        ctl.notices.stop = False
        if status == "stopped":
            status = "switched"
    # A generation that switched, or failed because a peer was lost, leaves this process's state
    # in memory at the step its trainer reached (Trainer.consistent says whether it is whole); the
    # next generation's resume decides what of it to keep (run_generation keeps it in `kept`).
    return status


def _abort_peers(ctl: WorkerControl, gen: int, reason: str) -> None:
    """This rank failed on its own (a full disk, a bad input, a bug): its peers would otherwise wait for
    it in their next collective until the timeout, or forever in a wait the timeout does not cover.
    Setting the generation's abort key wakes every one of them at once, as a lost VM does."""
    ctl.waiter.abort.set()
    try:
        ctl.client.set(protocol.abort_key(gen), reason)
    except protocol.ProtocolError as e:  # the controller is gone: it cannot restart anyone either
        worker_log(f"cannot abort generation {gen} for its peers: {e}")


def main(argv: list[str] | None = None) -> int:

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
    secret = os.environ.get(protocol.SECRET_ENV)
    if not secret:
        ap.error(f"controlled mode needs the run's secret in ${protocol.SECRET_ENV}")
    code = controlled(a.control, str(a.worker_id), secret)
    # Everything worth keeping is written (checkpoints are waited for, statuses reported). A normal
    # interpreter exit would also join the threads still blocked in collectives of aborted
    # generations (until their timeout: seconds on the path of a VM's release), so leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
