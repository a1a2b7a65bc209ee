"""`sailor train` runs in the run history, beside the flow's: `sailor runs list` and `runs show --plot` see them.

Contract: `TrainRecord.open(store, plan_name, model, settings)` writes a `running` row for a new run id
(`train-<8 hex>`, named `sailor-train:<plan file stem>`: a name the flow's `run_name` rule never
allows, so the flow's reruns never take such a run for their job) and holds a lease while the run
goes (a killed `sailor train` shows `crashed`, as a killed flow does). `finish(status, rows, wall_s)`
saves the step records under the run's state folder (`<store>/runs/<run id>/state` for a local store,
`<store>/runs/<run id>` for s3:// and gs://; `metrics/v<version>.jsonl`, the layout the flow uses),
records where they are, and writes the final row: steps, final loss, tokens, wall time. A store that
cannot be written is reported once on stderr and training goes on without a record: the history is
for people, the run is the user's.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer

from sailor_core.errors import SailorError

if TYPE_CHECKING:
    from tasks.records import MetricRow


@dataclass
class TrainRecord:
    history: Any  # tasks.history.RunHistory
    keeper: Any  # tasks.history.LeaseKeeper
    run_id: str
    state: Any  # tasks.runstate.RunState
    tokens_per_step: int

    @classmethod
    def open(cls, store: str | None, plan_name: str, model: str, settings: dict[str, Any],
             tokens_per_step: int) -> TrainRecord | None:
        from sailor_cli.options import open_store
        from tasks.history import LeaseKeeper, RunHistory, RunStatus
        from tasks.runstate import state_for

        run_id = f"train-{uuid.uuid4().hex[:8]}"
        try:
            opened = open_store(store)
            where = opened.location.uri
            state = state_for(where, run_id, Path(where) / "runs" / run_id)
            history = RunHistory(opened)
            history.run_status(run_id, RunStatus.RUNNING, "sailor train on this machine",
                               {"name": f"sailor-train:{plan_name}", "provider": "train", "model": model,
                                "params": json.loads(json.dumps(settings, default=str))})
            keeper = LeaseKeeper(history, run_id).start()
        except (SailorError, OSError) as e:
            typer.echo(f"note: this run is not recorded in the run history ({e})", err=True)
            return None
        typer.echo(f"run {run_id} (sailor runs show {run_id}{'' if store is None else ' --store ' + store})")
        return cls(history=history, keeper=keeper, run_id=run_id, state=state, tokens_per_step=tokens_per_step)

    def finish(self, status: str, rows: list[dict[str, Any]], wall_s: float, reason: str = "") -> None:
        from tasks.history import RunEvent, RunStatus
        from tasks.runstate import flush_metrics

        self.keeper.stop()
        try:
            for v in sorted({int(r.get("plan_version", 0)) for r in rows}):
                flush_metrics(self.state, v, [cast("MetricRow", r) for r in rows if int(r.get("plan_version", 0)) == v])
            self.history.event(self.run_id, RunEvent.CLUSTER, "where the run's state lives",
                               {"cluster": {"isolation": "process", "provider": "train", "state_uri": self.state.uri}})
            steps = max((int(r["step"]) for r in rows), default=0)
            final = {"steps_done": steps, "final_loss": rows[-1].get("loss") if rows else None,
                     "tokens": steps * self.tokens_per_step, "wall_s": round(wall_s, 2),
                     "plan_versions": len({r.get("plan_version", 0) for r in rows})}
            kind = {"done": RunStatus.COMPLETED, "stopped": RunStatus.CANCELLED}.get(status, RunStatus.FAILED)
            self.history.run_status(self.run_id, kind, reason or f"{steps} steps done", final)
        except (SailorError, OSError) as e:
            typer.echo(f"note: the run history did not take this run's end ({e})", err=True)
