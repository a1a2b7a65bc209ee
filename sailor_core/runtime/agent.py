"""The per-VM worker agent behind `sailor worker` (interface: docs/runtime.md).

Contract:
- `WorkerAgent(control, vm_id, devices, secret=...)` runs one persistent worker process per device of
  the VM (`worker_proc` in controlled mode, worker id `<vm id>/<i>`, LOCAL_RANK=i, so rank i of the VM
  drives device i: the worker binds itself to it, sailor_core/runtime/devices.py). The workers take
  every assignment from the controller themselves (sailor_core/runtime/protocol.py): a new plan
  version is a new generation for the same processes, and a worker the new plan does not need sits
  it out. The agent never decides ranks.
- It beats `hb/vm/<vm id>` every `heartbeat_s` ({"time", "workers": {worker id: pid or null when it
  exited}}), forwards SIGUSR1 (a preemption notice: the workers checkpoint just in time), and on
  SIGTERM/SIGINT hands the workers SIGTERM (they checkpoint and stop), kills them after `grace_s`
  and exits 0.
- Worker logs live in the VM's own folder (`run_dir`), and so do rank 0's own step records
  (`metrics-v<version>.jsonl`, $SAILOR_METRICS_DIR); with `log_uri` (an object-storage or local
  folder URI under the run's state) they are copied to `<log_uri>/<vm id>/` every `upload_s`, on a
  preemption notice, when told to stop, and at exit, so nothing is left only on the VM.
- Exit status: 0 when every worker exited 0 (done, stopped, told to exit) or the agent was told to
  stop; 1 when a worker failed.
- JSON lines on `events` (default stdout): `started`, `heartbeat`, `worker_exited`, `exited`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

from sailor_core.runtime import protocol


class WorkerAgent:
    def __init__(self, control: str, vm_id: str, devices: int, *, secret: str, run_dir: str,
                 log_uri: str | None = None, events: IO[str] | None = None, heartbeat_s: float = protocol.HEARTBEAT_S,
                 grace_s: float = 30.0, upload_s: float = 30.0, first_generation: int = 0,
                 advertise_addr: str = "127.0.0.1", python: str = sys.executable):
        if devices < 1:
            raise ValueError(f"a VM runs at least one device, got {devices}")
        self.control, self.vm_id, self.devices, self.secret = control, vm_id, devices, secret
        self.client = protocol.ControlClient(control, secret)
        self.run_dir, self.log_uri = run_dir, log_uri
        os.makedirs(run_dir, exist_ok=True)
        self.events = events or sys.stdout
        self.heartbeat_s, self.grace_s, self.upload_s = heartbeat_s, grace_s, upload_s
        self.first_generation, self.advertise_addr, self.python = first_generation, advertise_addr, python
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._log_storage: Any = None
        self._lock = threading.Lock()
        self._upload_lock = threading.Lock()  # the periodic upload, the notice's and the last one, one at a time
        self._stop = threading.Event()

    def emit(self, ev: dict[str, Any]) -> None:
        line = json.dumps({"event": ev.pop("event"), "vm": self.vm_id, "time": time.time(), **ev})
        with self._lock:
            self.events.write(line + "\n")
            self.events.flush()

    def _log_path(self, local: int) -> str:
        return os.path.join(self.run_dir, f"worker-{local}.log")

    def _spawn(self, local: int) -> None:
        wid = protocol.worker_id(self.vm_id, local)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("SAILOR_WORKER_THREADS", "1"), PYTHONUNBUFFERED="1",
                   SAILOR_CONTROL=self.control, SAILOR_WORKER_ID=wid, LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(self.devices), SAILOR_ADVERTISE_ADDR=self.advertise_addr,
                   SAILOR_FIRST_GENERATION=str(self.first_generation), SAILOR_METRICS_DIR=self.run_dir,
                   **{protocol.SECRET_ENV: self.secret})
        log = open(self._log_path(local), "ab")  # noqa: SIM115 - the child's for its lifetime
        try:
            self.procs[wid] = subprocess.Popen([self.python, "-m", "sailor_core.runtime.worker_proc"], env=env,
                                               stdout=log, stderr=subprocess.STDOUT, cwd=self.run_dir)
        finally:
            log.close()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGUSR1:
            for p in self.procs.values():
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGUSR1)
            # The VM goes away when the notice's grace ends: its logs and step records leave now.
            threading.Thread(target=self.upload_logs, daemon=True).start()
            return
        self._stop.set()
        # Told to stop: the step records so far leave at once, not only after the workers' grace (whoever stops
        # this VM may not wait that long: a command's guardian gives its children 5 s).
        threading.Thread(target=self.upload_logs, daemon=True).start()

    def _heartbeat(self, *, last: bool = False) -> None:
        workers = {w: (p.pid if p.poll() is None else None) for w, p in self.procs.items()}
        # the last beat, as the agent exits, tries briefly: the controller may be gone with its flow
        client = protocol.ControlClient(self.control, self.secret, retry_s=2.0) if last else self.client
        with contextlib.suppress(protocol.ProtocolError):
            client.set(protocol.vm_heartbeat_key(self.vm_id), json.dumps({"time": time.time(), "workers": workers}))
        self.emit({"event": "heartbeat", "workers": workers})

    @staticmethod
    def _every(period_s: float, fn: Any, done: threading.Event) -> None:
        while True:
            fn()
            if done.wait(period_s):
                return

    def upload_logs(self) -> None:
        """The VM's worker logs and step records, copied under `log_uri` (best effort)."""
        if not self.log_uri:
            return
        with self._upload_lock:
            self._upload()

    def _upload(self) -> None:
        """One pass of `upload_logs`."""
        from sailor_core.runtime.checkpoint import open_storage

        assert self.log_uri is not None

        try:
            # One client for the agent's life: making one (an S3 client) costs more than the uploads,
            # and the last upload is on the path of the VM's release.
            storage = self._log_storage = self._log_storage or open_storage(self.log_uri)
            # the step records first (small, and what the run's history needs), then the logs
            names = sorted(n for n in os.listdir(self.run_dir) if n.startswith("metrics-v") and n.endswith(".jsonl"))
            names += [f"worker-{local}.log" for local in range(self.devices)]
            for name in names:
                with contextlib.suppress(OSError):
                    with open(os.path.join(self.run_dir, name), "rb") as f:
                        storage.write(f"{self.vm_id}/{name}", f.read())
        except Exception as e:  # noqa: BLE001 - logs are best effort; training must not stop for them
            self.emit({"event": "log_upload_failed", "reason": str(e)[:200]})

    def run(self) -> int:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                signal.signal(sig, self._on_signal)
        for local in range(self.devices):
            self._spawn(local)
        self.emit({"event": "started", "workers": {w: p.pid for w, p in self.procs.items()}})
        reported: set[str] = set()
        done = threading.Event()
        # Beats and uploads on threads of their own: a slow upload (the first one imports pyarrow, on
        # a VM with a fraction of a core) must never hold back the heartbeat the flow judges us by.
        beats = threading.Thread(target=self._every, args=(self.heartbeat_s, self._heartbeat, done), daemon=True)
        uploads = threading.Thread(target=self._every, args=(self.upload_s, self.upload_logs, done), daemon=True)
        beats.start()
        uploads.start()
        try:
            while not self._stop.is_set():
                for wid, p in self.procs.items():
                    if p.poll() is not None and wid not in reported:
                        reported.add(wid)
                        self.emit({"event": "worker_exited", "worker": wid, "returncode": p.returncode})
                if len(reported) == len(self.procs):
                    break
                self._stop.wait(0.1)
        finally:
            stopped = self._stop.is_set()
            self._shutdown()
            done.set()
            # What the VM leaves goes first: the last beat may wait on a controller that is gone (retries).
            self.upload_logs()
            uploads.join(timeout=self.grace_s)
            self._heartbeat(last=True)
        failed = [w for w, p in self.procs.items() if p.returncode not in (0, -signal.SIGTERM, None)]
        status = "cancelled" if stopped else ("failed" if failed else "done")
        self.emit({"event": "exited", "status": status, "failed": failed})
        return 0 if stopped or not failed else 1

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
