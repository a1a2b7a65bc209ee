"""The per-VM worker agent behind `sailor worker` (interface: docs/runtime.md).

Contract:
- Input: an assignment JSON file, rewritten (atomically, by rename) by the orchestrator for each new
  plan version: {"plan_version", "plan" (sailor plan dict), "settings" (TrainSettings fields: model,
  steps, seed, data, checkpoint_dir, checkpoint_every, timeout_s, ...), "ranks" (global ranks this
  VM runs), "rendezvous" {"host", "port"} (a TCPStore that the VM running rank 0 hosts; use a
  fresh port per plan version), "resume", "cancel"}.
- The agent hosts a local control store and runs one persistent worker process per rank
  (`worker_proc` controlled mode). A new plan version becomes a new generation for the same
  processes: it sets the running generation's abort key (so ranks blocked on a lost peer wake up),
  hands out the new ranks, starts processes if it needs more and retires surplus ones.
- Output: JSON lines on `events` (a file or stdout): `heartbeat` every `heartbeat_s` (workers,
  pids, alive), `metrics` per rank and step (step, loss on rank 0, iteration_time_s,
  memory_bytes, plan_version), `status` per worker and plan version (done | stopped | failed:
  reason), `worker_exited` when a process dies, and `exited` last (done | cancelled | failed).
- SIGTERM/SIGINT or "cancel": true: workers get SIGTERM (they take a just-in-time checkpoint and
  stop), are killed after `grace_s`, and the agent exits 0. SIGUSR1 is forwarded (just-in-time
  checkpoint without stopping).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import IO, Any

from sailor_core.domain import SailorError


class WorkerAgent:
    def __init__(self, assignment_path: str, *, events: IO[str] | None = None, vm_id: str = "",
                 run_dir: str | None = None, heartbeat_s: float = 2.0, grace_s: float = 30.0,
                 python: str = sys.executable):
        self.assignment_path = assignment_path
        self.events = events or sys.stdout
        self.vm_id = vm_id or os.uname().nodename
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="sailor-agent-")
        os.makedirs(self.run_dir, exist_ok=True)
        self.heartbeat_s, self.grace_s, self.python = heartbeat_s, grace_s, python
        self.procs: dict[int, subprocess.Popen[bytes]] = {}  # local worker id -> process
        self.rank_of: dict[int, int] = {}
        self.gen = -1
        self.version: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._signal: int | None = None
        self._offsets: dict[str, int] = {}

    def emit(self, ev: dict[str, Any]) -> None:
        line = json.dumps({"event": ev.pop("event"), "vm": self.vm_id, "time": time.time(), **ev})
        with self._lock:
            self.events.write(line + "\n")
            self.events.flush()

    def _read_assignment(self) -> dict[str, Any] | None:
        try:
            with open(self.assignment_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None  # absent or mid-write: try again on the next poll

    def _spawn(self, wid: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("SAILOR_WORKER_THREADS", "1"), PYTHONUNBUFFERED="1",
                   SAILOR_CONTROL=f"127.0.0.1:{self.store.port}", SAILOR_FIRST_GENERATION=str(self.gen))
        log = open(os.path.join(self.run_dir, f"worker-{wid}.log"), "ab")  # noqa: SIM115 - the child's
        self.procs[wid] = subprocess.Popen([self.python, "-m", "sailor_core.runtime.worker_proc", "--worker-id", str(wid)],
                                           env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _apply(self, a: dict[str, Any]) -> None:
        from sailor_core.plan_format import plan_from_dict

        plan = plan_from_dict(a["plan"])
        ranks = [int(r) for r in a["ranks"]]
        if any(not 0 <= r < plan.num_gpus for r in ranks):
            raise SailorError(f"assignment ranks {ranks} outside the plan's 0..{plan.num_gpus - 1}")
        if self.gen >= 0:
            self.store.set(f"g{self.gen}/abort", "new plan")
        self.gen += 1
        self.version = int(a.get("plan_version", self.gen))
        alive = sorted(w for w, p in self.procs.items() if p.poll() is None)
        while len(alive) < len(ranks):
            wid = max(self.procs, default=-1) + 1
            self._spawn(wid)
            alive.append(wid)
        settings = dict(a["settings"], plan_version=self.version)
        settings.setdefault("extra", {})["rank_metrics_dir"] = self.run_dir
        self.rank_of = {}
        for i, wid in enumerate(alive):
            if i < len(ranks):
                self.rank_of[wid] = ranks[i]
                body = {"rank": ranks[i], "world_size": plan.num_gpus, "plan": a["plan"], "settings": settings,
                        "resume": bool(a.get("resume")), "local_rank": i, "rendezvous": a.get("rendezvous")}
            else:
                body = {"rank": -1}
            self.store.set(f"g{self.gen}/assign/{wid}", json.dumps(body))
        self.emit({"event": "assigned", "plan_version": self.version, "ranks": self.rank_of})

    def _tail_metrics(self) -> None:
        for wid, rank in list(self.rank_of.items()):
            path = os.path.join(self.run_dir, f"rank-{rank}.jsonl")
            try:
                with open(path) as f:
                    f.seek(self._offsets.get(path, 0))
                    chunk = f.read()
                    complete = chunk[: chunk.rfind("\n") + 1]
                    self._offsets[path] = self._offsets.get(path, 0) + len(complete.encode())
            except OSError:
                continue
            for line in complete.splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    keep = ("step", "loss", "iteration_time_s", "memory_bytes", "plan_version", "samples", "stage",
                            "pipeline", "rank")
                    self.emit({"event": "metrics", "worker": wid, **{k: rec.get(k) for k in keep}})

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGUSR1:
            for p in self.procs.values():
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGUSR1)
            return
        self._signal = signum
        self._stop.set()

    def run(self) -> int:
        from torch.distributed import TCPStore

        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                signal.signal(sig, self._on_signal)
        mtime = None
        statuses: dict[tuple[int, int], str] = {}
        last_hb = 0.0
        outcome = "failed"
        try:
            while not self._stop.is_set():
                try:
                    m = os.stat(self.assignment_path).st_mtime_ns
                except OSError:
                    m = None
                if m is not None and m != mtime:
                    a = self._read_assignment()
                    if a is not None:
                        mtime = m
                        if a.get("cancel"):
                            self._stop.set()
                            break
                        if int(a.get("plan_version", 0)) != self.version:
                            self._apply(a)
                for wid, p in list(self.procs.items()):
                    key = f"g{self.gen}/status/{wid}"
                    if wid in self.rank_of and (self.gen, wid) not in statuses and self.store.check([key]):
                        statuses[(self.gen, wid)] = self.store.get(key).decode()
                        self.emit({"event": "status", "worker": wid, "rank": self.rank_of[wid],
                                   "plan_version": self.version, "status": statuses[(self.gen, wid)]})
                    if p.poll() is not None and not getattr(p, "_reported", False):
                        p._reported = True  # type: ignore[attr-defined]
                        self.emit({"event": "worker_exited", "worker": wid, "returncode": p.returncode})
                self._tail_metrics()
                mine = [statuses.get((self.gen, w)) for w in self.rank_of]
                if self.rank_of and all(s in ("done", "stopped") for s in mine):
                    outcome = "done" if all(s == "done" for s in mine) else "stopped"
                    break
                now = time.monotonic()
                if now - last_hb >= self.heartbeat_s:
                    last_hb = now
                    self.emit({"event": "heartbeat", "plan_version": self.version, "workers": [
                        {"worker": w, "pid": p.pid, "rank": self.rank_of.get(w), "alive": p.poll() is None}
                        for w, p in self.procs.items()]})
                time.sleep(0.1)
            if self._stop.is_set():
                outcome = "cancelled"
        finally:
            self._shutdown()
            self._tail_metrics()
            self.emit({"event": "exited", "status": outcome, "plan_version": self.version})
        return 0 if outcome in ("done", "stopped", "cancelled") else 1

    def _shutdown(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)  # workers checkpoint just in time, then stop
        deadline = time.monotonic() + self.grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait()
