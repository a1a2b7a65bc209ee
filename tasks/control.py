"""The orchestration's side of the runtime's control protocol, and the heartbeat board.

Contract (no Prefect):
- `Controller(host=...)` hosts one torch TCPStore (a fresh one per plan version) in the flow's process,
  advertised to the workers at `host` (loopback for the local provider): the rendezvous of that version's workers, which run the runtime's agent in controlled
  mode (`python -m sailor_core.runtime.worker_proc --control HOST:PORT --worker-id VM_ID`, see
  sailor_core/runtime/worker_proc.py). `assign(job, resume)` hands every worker its generation-0
  assignment (rank, world size, plan, training settings); `heartbeats(ids)` and `statuses(ids)`
  read what the workers report (`hb/<id>` every few seconds, `g0/status/<id>` at the end).
  `close()` releases the port.
- `HeartbeatBoard`: the latest heartbeat time and training step per VM, written by the monitor from
  the controller and read by the local provider (its `heartbeats` source), so a hung worker is found
  by the provider's own timeout the same way a dead one is.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

from sailor_core.plan_format import plan_to_dict
from tasks.jobs import Job


class HeartbeatBoard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._beats: dict[str, dict[str, float]] = {}

    def beat(self, vm_id: str, *, at: float | None = None, step: int | None = None) -> None:
        with self._lock:
            cur = dict(self._beats.get(vm_id, {}))
            if at is not None:
                cur["time"] = max(at, cur.get("time", 0.0))
            if step is not None:
                cur["step"] = step
            self._beats[vm_id] = cur

    def forget(self, vm_id: str) -> None:
        with self._lock:
            self._beats.pop(vm_id, None)

    def get(self, vm_id: str) -> dict[str, Any] | None:
        with self._lock:
            b = self._beats.get(vm_id)
            return dict(b) if b else None


def checkpoint_steps(checkpoint_dir: str, num_layers: int) -> int | None:
    """Newest complete checkpoint step under the folder (None: none yet)."""
    from sailor_core.runtime import checkpoint as ckpt

    try:
        return ckpt.latest_valid_step(ckpt.open_storage(checkpoint_dir), num_layers)
    except Exception:
        return None


class Controller:
    def __init__(self, *, host: str = "127.0.0.1", timeout_s: float = 60.0) -> None:
        from torch.distributed import TCPStore

        # The master store listens on every interface; `host` is the address workers are told.
        self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        self.endpoint = f"{host}:{self.store.port}"

    def assign(self, job: Job, *, resume: bool, collective_timeout_s: float = 30.0) -> None:
        from sailor_core.runtime.engine import TrainSettings

        plan = plan_to_dict(job.plan)
        for rank, vm in enumerate(job.vms):
            settings = TrainSettings(
                model=job.plan.model, steps=job.total_steps, seed=job.seed, data=job.data_uri or None,
                checkpoint_dir=str(job.checkpoint_dir), checkpoint_every=job.checkpoint_interval, resume=resume,
                metrics_out=str(job.metrics_file(vm)), plan_version=job.version, timeout_s=collective_timeout_s,
            )
            self.store.set(f"g0/assign/{vm.vm_id}", json.dumps(
                {"rank": rank, "world_size": len(job.vms), "plan": plan, "settings": settings.to_dict(),
                 "resume": resume}))

    def _get(self, key: str) -> str | None:
        try:
            if self.store.check([key]):
                return self.store.get(key).decode()
        except Exception:
            return None
        return None

    def heartbeats(self, vm_ids: list[str]) -> dict[str, float]:
        out = {}
        for v in vm_ids:
            raw = self._get(f"hb/{v}")
            if raw is not None:
                try:
                    out[v] = float(raw)
                except ValueError:
                    continue
        return out

    def statuses(self, vm_ids: list[str]) -> dict[str, str]:
        return {v: s for v in vm_ids if (s := self._get(f"g0/status/{v}")) is not None}

    def close(self) -> None:
        # Dropping the last reference shuts the store's server down.
        self.store = None  # type: ignore[assignment]


def now() -> float:
    return time.time()
