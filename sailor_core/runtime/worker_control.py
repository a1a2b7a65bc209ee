"""A controlled worker's side channel to its controller (the worker process: worker_proc.py; the keys:
protocol.py): heartbeats, the watchers of its generation's stop and abort keys, rank 0's step
records, and holds at scripted steps.

Contract: `WorkerControl(client, worker_id).start()` sets `hb/<W>` every HEARTBEAT_S and watches
`g<g>/stop` (a plan change: `notices.stop`, so the ranks agree on the step to end at) and `g<g>/abort`
(a lost member: every abortable wait wakes) of the current generation until `stop` is set;
`on_metrics(record)` writes rank 0's step record to its own file under $SAILOR_METRICS_DIR and to
`metrics/v<version>` (retried METRICS_RETRY_S only: training does not wait on a controller that is
gone), and holds at a step of `holds` until the controller releases it (at most HOLD_MAX_S).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

from sailor_core.models.tensor_parallel import set_wait
from sailor_core.runtime import protocol
from sailor_core.runtime.comm import Waiter
from sailor_core.runtime.notices import Notices
from sailor_core.runtime.protocol import ControlClient

METRICS_RETRY_S = 2.0  # how long rank 0 retries a step report (the step's record is also in its own file)


def worker_log(msg: str) -> None:
    """A line on stderr with the process id and the time to the millisecond."""
    print(
        f"[sailor-worker {os.getpid()} {time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d}] {msg}",
        file=sys.stderr,
        flush=True,
    )


class WorkerControl:
    """A controlled worker's side channel: heartbeats, the stop and abort watchers, step metrics."""

    def __init__(self, client: ControlClient, worker_id: str) -> None:
        self.client = client
        self.worker_id = worker_id
        self.stop = threading.Event()
        self.current_gen = 0
        self.last_step = 0
        self.switching = -1  # the generation the controller asked to end for a plan change
        self.training = -1  # the generation this process trains in now (-1: none: waiting, or sitting one out)
        self.holds: frozenset[int] = frozenset()  # steps the current generation holds at (Assignment.hold_at_steps)
        self.metrics_dir = os.environ.get("SAILOR_METRICS_DIR")  # rank 0's own step records go here too
        # Step reports retry briefly: training must not wait long on a controller that is gone (the record
        # is in the file above); the other requests retry for the client's usual deadline.
        self.reports = ControlClient(f"{client.host}:{client.port}", client.secret, retry_s=METRICS_RETRY_S)
        self.aborted_groups: list[Any] = []  # process groups of aborted generations (run_generation)
        self.notices = Notices()  # this process's: SIGUSR1/SIGTERM, and the plan change's stop
        # 0: plain waits (lost peers then cost a timeout)
        self.waiter = Waiter(abortable=os.environ.get("SAILOR_ABORTABLE_WAITS", "1") != "0")

    def start(self) -> None:
        """Starts the heartbeat and the stop and abort watchers (daemon threads until `stop` is set)."""
        threading.Thread(target=self.heartbeat, daemon=True).start()
        threading.Thread(target=self.watch, args=(protocol.stop_key, self.switch), daemon=True).start()
        if self.waiter.abortable:  # the TP layers' collectives wait through it too
            set_wait(self.waiter.wait)
        threading.Thread(target=self.watch, args=(protocol.abort_key, self.abort), daemon=True).start()

    def heartbeat(self) -> None:
        """Sets `hb/<W>` to {"time", "step"} every HEARTBEAT_S until stopped."""
        while not self.stop.wait(protocol.HEARTBEAT_S):
            with contextlib.suppress(protocol.ProtocolError):
                self.client.set(protocol.heartbeat_key(self.worker_id),
                                json.dumps({"time": time.time(), "step": self.last_step}))

    def watch(self, key: Any, act: Any) -> None:
        """Long-poll the current generation's `key(g)`; when it is set, `act(g)` once for that generation."""
        while not self.stop.is_set():
            gen = self.current_gen
            try:
                hit = self.client.get(key(gen), wait_s=5.0)
            except protocol.ProtocolError:
                self.stop.wait(1.0)
                continue
            if hit is not None and gen == self.current_gen and act(gen):
                while gen == self.current_gen and not self.stop.is_set():
                    self.stop.wait(0.05)

    def abort(self, gen: int) -> bool:
        """A member of the generation was lost: wakes every blocked wait (a reconfiguration within
        milliseconds instead of a timeout); False when already aborting."""
        if self.waiter.abort.is_set():
            return False
        self.waiter.abort.set()
        return True

    def switch(self, gen: int) -> bool:
        """A plan change: finish the current step, checkpoint, and go on to g+1 keeping the state in memory;
        False unless this process trains in generation `gen` and was not asked already."""
        if self.training != gen or self.switching == gen:
            return False
        self.switching = gen
        self.notices.stop = True  # every rank agrees on the step through the step's all-reduce
        return True

    def on_metrics(self, rec: dict[str, Any]) -> None:
        """Records a step's metrics (rank 0): in this process's own file (`metrics-v<version>.jsonl` under
        $SAILOR_METRICS_DIR, the source of truth its agent uploads) and under the controller's
        `metrics/v<version>`; notes the step for heartbeats, and holds at a step of `holds`."""
        self.last_step = int(rec.get("step", self.last_step))
        version = int(rec.get("plan_version") or 0)
        line = json.dumps(rec)
        if self.metrics_dir:
            try:
                with open(os.path.join(self.metrics_dir, f"metrics-v{version}.jsonl"), "a") as f:
                    f.write(line + "\n")
            except OSError as e:  # a full disk: the controller's copy below still has the record
                worker_log(f"cannot keep step {self.last_step}'s record: {e}")
        with contextlib.suppress(protocol.ProtocolError):
            self.reports.append(protocol.metrics_key(version), line)
        if self.last_step in self.holds:
            self.hold(self.last_step)

    def hold(self, step: int) -> None:
        """Wait at `step` until the controller's side releases it (it has seen the step: a scripted event
        happens exactly there), at most HOLD_MAX_S; the other ranks wait in their next collective."""
        gen = self.training
        try:
            self.client.set(protocol.held_key(gen), str(step))
            released = self.client.get(protocol.release_key(gen, step), wait_s=protocol.HOLD_MAX_S)
        except protocol.ProtocolError as e:
            worker_log(f"holding at step {step}: {e}; going on")
            return
        if released is None:
            worker_log(f"held at step {step} for {protocol.HOLD_MAX_S:.0f}s without a release; going on")
