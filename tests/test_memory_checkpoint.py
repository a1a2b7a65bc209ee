"""A lost worker costs no steps when the survivors together still hold every layer.

Pure rules (`newest_complete_step`, `writers`) on hand-made holdings, then a real run: four local
workers (two stages x two pipelines) train with no periodic checkpoint; one dies; the next plan puts
every layer on every survivor (one stage x three replicas), so each must get layers it never held.
Before, they could only go back to a checkpoint (here none: step 0); now the survivors write the
step they reached from memory and the job resumes there, repeating nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import replace

from sailor_core.domain import ParallelPlan, PipelineBatch, Stage
from sailor_core.runtime import checkpoint as ckpt
from sailor_core.runtime.engine import TrainSettings
from sailor_core.runtime.launcher import run_local
from sailor_core.runtime.memory_checkpoint import Held, newest_complete_step, writers
from tests.test_runtime import CFG, plan, rep


def h(step: int, *shards: tuple[int, int, int]) -> Held:
    return Held(step, step * 8, step, shards)


def test_the_newest_step_whose_layers_are_held_whole():
    stage0 = [(0, 0, 1), (1, 0, 1)]
    stage1 = [(2, 0, 1), (3, 0, 1)]
    helds = [h(9, *stage0), h(9, *stage1), h(9, *stage0), Held(-1, 0, 0, ())]  # the lost rank held stage 1 too
    assert newest_complete_step(helds, 4, newer_than=5) == 9
    assert newest_complete_step(helds, 4, newer_than=9) is None  # a checkpoint already has it
    assert newest_complete_step(helds[::2], 4, newer_than=None) is None  # stage 1 lost with its only copy
    # a TP-2 layer needs both shards of that degree at that step; another degree's shard does not help
    tp = [h(7, (0, 0, 2)), h(7, (0, 0, 1)), h(6, (0, 1, 2))]
    assert newest_complete_step(tp, 1, newer_than=None) == 7  # the degree-1 copy is whole by itself
    assert newest_complete_step([tp[0], tp[2]], 1, newer_than=None) is None  # shards of two different steps
    assert newest_complete_step([tp[0], h(7, (0, 1, 2))], 1, newer_than=None) == 7


def test_each_shard_is_written_once_by_the_lowest_rank_holding_it():
    helds = [h(9, (0, 0, 1), (1, 0, 1)), h(9, (2, 0, 1)), h(9, (0, 0, 1), (1, 0, 1)), h(8, (2, 0, 1))]
    assert writers(helds, 9) == {0: [(0, 0, 1), (1, 0, 1)], 1: [(2, 0, 1)]}


def _one_stage_on_every_survivor(p: ParallelPlan, lost: set[int], survivors: int) -> ParallelPlan:
    """A replan that moves layers: one stage holding every layer, one replica per survivor."""
    one = replace(p.stages[0].replicas[0], tp=1)
    stage = Stage(first_layer=0, last_layer=p.stages[-1].last_layer, replicas=(one,) * survivors)
    sizes = [p.global_batch_size // survivors + (1 if i < p.global_batch_size % survivors else 0)
             for i in range(survivors)]
    return replace(p, stages=(stage,), pipelines=tuple(PipelineBatch(microbatch_size=s, num_microbatches=1)
                                                        for s in sizes))


def _steps(path) -> list[int]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(ln)["step"] for ln in f if ln.strip()]


def test_a_lost_replica_resumes_from_the_survivors_memory(tmp_path):
    p = plan([((0, 2), [rep(), rep()]), ((3, 5), [rep(), rep()])], ((2, 2), (2, 2)))
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    settings = TrainSettings(model="gpt-tiny", steps=14, metrics_out=str(metrics), timeout_s=30,
                             checkpoint_uri=str(ck), checkpoint_interval=0)  # only at the end
    pids: dict[int, int] = {}
    events: list[dict] = []
    result: list = []

    def on_event(ev: dict) -> None:
        events.append(ev)
        if ev["event"] == "started":
            pids.update({int(w): int(x) for w, x in ev["pids"].items()})

    t = threading.Thread(target=lambda: result.append(run_local(
        p, CFG, settings, run_dir=str(tmp_path / "run"), replan=_one_stage_on_every_survivor, on_event=on_event)))
    t.start()
    deadline = time.monotonic() + 240
    while len(_steps(metrics)) < 6 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    reached = max(_steps(metrics))
    os.kill(pids[3], signal.SIGKILL)  # stage 1 of pipeline 1: its layers live on in pipeline 0
    t.join(timeout=300)
    assert not t.is_alive() and result and result[0].status == "done", events[-3:]
    assert [e for e in events if e["event"] == "reconfigured"]
    steps = _steps(metrics)
    # the steps after the loss continue from where the survivors were, not from 0 (no checkpoint existed)
    logs = "".join(f.read_text() for f in (tmp_path / "run").glob("worker-*.log"))
    written = re.search(r"checkpoint step (\d+) written from the survivors' memory", logs)
    about = re.compile(r"lost|failed|generation|resum|kept|checkpoint|at step|error|timed out")
    why = [ln for ln in logs.splitlines() if about.search(ln)]
    assert written, ("the survivors did not write their step: the next plan started over; events "
                     f"{[e['event'] for e in events]}; worker log lines:\n" + "\n".join(why[-30:]))
    assert int(written.group(1)) >= reached, (written.group(0), reached)
    assert set(steps) == set(range(1, 15))
    repeated = sorted({x for x in steps if steps.count(x) > 1})
    assert all(x > int(written.group(1)) for x in repeated), (repeated, steps)  # nothing before it is redone
    quarantined = list((ck / ckpt.QUARANTINE).glob("*")) if (ck / ckpt.QUARANTINE).exists() else []
    assert ckpt.latest_valid_step(ckpt.open_storage(str(ck)), CFG.num_layers) == 14, quarantined
