"""TensorBoard event files from the runtime's per-step records, written beside the run, never by the workers.

Contract:
- `JsonlTail(path)` reads the complete JSON lines appended to a growing file since its last call (a line
  still being written waits for the next call; a file that does not exist yet reads as no lines).
- `EventWriter(logdir)` writes, with torch's standard `SummaryWriter`, one point per step record (the
  metrics rank 0 writes, sailor_core/runtime/engine.py): `train/loss`, `train/learning_rate`,
  `train/tokens_per_s`, `train/step_time_s`, `train/plan_version`, and `cost/usd_so_far` when the caller
  knows the cost; `stage/<k>/step_time_s` from per-rank records (`rank_metrics_dir`, each carrying its
  stage): the slowest rank of the stage at that step. The x axis is the optimizer step.
- `Follower(metrics_path, logdir, rank_dir=None)` is a thread that tails the records as they arrive
  (every `poll_s`) and writes them; `stop()` reads what is left, closes the files and returns the number
  of step records written. A step seen twice (a resumed or reconfigured run repeats steps after its
  checkpoint) is written again: TensorBoard keeps both points, the later plan version's last.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from typing import Any

# (scalar tag, record key): what one step record contributes
STEP_SCALARS = (("train/loss", "loss"), ("train/learning_rate", "lr"), ("train/tokens_per_s", "tokens_per_s"),
                ("train/step_time_s", "iteration_time_s"), ("train/plan_version", "plan_version"))


class JsonlTail:
    """The complete lines appended to a JSON-lines file since the last `read()`."""

    def __init__(self, path: str) -> None:
        self.path, self.offset = path, 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # rewritten from the start (a fresh run)
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a last line without its newline is still being written
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn line (a writer killed mid-line) is skipped, not fatal
            if isinstance(rec, dict):
                out.append(rec)
        return out


class EventWriter:
    """Step records as TensorBoard scalars under `logdir`."""

    def __init__(self, logdir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(logdir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=logdir)

    def step(self, rec: dict[str, Any], cost_usd: float | None = None) -> None:
        step = int(rec["step"])
        for tag, key in STEP_SCALARS:
            v = rec.get(key)
            if isinstance(v, int | float):
                self.writer.add_scalar(tag, float(v), step, walltime=rec.get("time"))
        if cost_usd is not None:
            self.writer.add_scalar("cost/usd_so_far", float(cost_usd), step, walltime=rec.get("time"))

    def ranks(self, records: Iterable[dict[str, Any]]) -> None:
        """Per-rank records: the slowest rank of each (step, stage) as that stage's step time."""
        slowest: dict[tuple[int, int], float] = {}
        for r in records:
            if "stage" in r and "iteration_time_s" in r:
                key = (int(r["step"]), int(r["stage"]))
                slowest[key] = max(slowest.get(key, 0.0), float(r["iteration_time_s"]))
        for (step, stage), s in sorted(slowest.items()):
            self.writer.add_scalar(f"stage/{stage}/step_time_s", s, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Follower(threading.Thread):
    """Tails a run's step records (and per-rank records) into TensorBoard event files while it trains."""

    def __init__(self, metrics_path: str, logdir: str, rank_dir: str | None = None, poll_s: float = 0.5) -> None:
        super().__init__(name="tensorboard-follower", daemon=True)
        self.tail = JsonlTail(metrics_path)
        self.rank_dir, self.poll_s = rank_dir, poll_s
        self.rank_tails: dict[str, JsonlTail] = {}
        self.events = EventWriter(logdir)
        self.written = 0
        self._stop_event = threading.Event()

    def poll(self) -> None:
        for rec in self.tail.read():
            if "step" in rec:
                self.events.step(rec)
                self.written += 1
        if self.rank_dir and os.path.isdir(self.rank_dir):
            for name in sorted(os.listdir(self.rank_dir)):
                if name.endswith(".jsonl"):
                    tail = self.rank_tails.setdefault(name, JsonlTail(os.path.join(self.rank_dir, name)))
                    self.events.ranks(tail.read())
        self.events.flush()

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            self.poll()

    def stop(self) -> int:
        self._stop_event.set()
        if self.is_alive():
            self.join()
        self.poll()  # what arrived since the last poll
        self.events.close()
        return self.written
