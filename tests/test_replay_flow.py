"""A run the flow really made, replayed from its stored history, decides as the flow did.

One `sailor` flow run on the local provider (gpt-tiny, 2 slots, 40 steps: one to a few minutes with
the session's Prefect test server and profiled store, most of it reconfigurations): a spot worker
is preempted at step 5 (a forced switch), spot becomes dearer than on-demand at step 12 (a switch
that pays) and on-demand a cent dearer at step 28 (stay). `sailor replay --run` rebuilds the run's
trace and job from the store and replays it under the `sailor` policy: the same decisions at the
same steps, with the same reasons. The run keeps the flow's online calibration (on a loaded machine
it corrects the estimate mid-run, a replan of its own; the replay applies the same factors and says
what woke each replan), the reconfiguration time the flow assumed at each replan is rebuilt from the
store's measurements recorded before it, and workers lost on a loaded machine are events of the run
too, replayed as such (the death of a VM already preempted is no second loss).
"""

from __future__ import annotations

import json

import pytest

pytest_plugins = ["tests.flow_fixtures"]

pytestmark = pytest.mark.usefixtures("prefect_harness")

SCENARIO = """
offerings:
  - {market: spot, count: 2, usd_per_gpu_hour: 0.10}
  - {market: on-demand, count: 2, usd_per_gpu_hour: 0.30}
events:
  - {at_step: 5, kind: preemption, market: spot, grace_s: 1}
  - {at_step: 12, kind: price_change, market: spot, usd_per_gpu_hour: 40.0}
  - {at_step: 28, kind: price_change, market: on-demand, usd_per_gpu_hour: 0.31}
"""


def test_replaying_a_flow_run_from_its_history_yields_its_decisions(profiled_store, tmp_path):
    import contextlib
    import io

    from flows.sailor import sailor
    from profiles_store.store import open_store
    from sailor_cli.main import main
    from tasks.history import RunHistory

    sc = tmp_path / "scenario.yaml"
    sc.write_text(SCENARIO)
    state = sailor(run_name="replayed", model="gpt-tiny", global_batch_size=8, objective="min-cost", provider="local",
                   workers=2, steps=40, checkpoint_interval=4, store_uri=profiled_store,
                   workdir=str(tmp_path / "work"), scenario=str(sc), isolation="process", return_state=True)
    assert state.is_completed(), state.message
    h = RunHistory(open_store(profiled_store))
    run_id = [r for r in h.list_runs() if r.get("name") == "replayed"][-1]["run_id"]
    decided = h.show(run_id)["decisions"]
    flow = [(d["kind"], d["detail"]["step"]) for d in decided]
    assert flow[0][0] == "switch" and "preemption" in decided[0]["reason"], flow
    assert any("switch pays" in d["reason"] for d in decided), flow

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["replay", "--run", run_id, "--store", profiled_store, "--json"])
    assert rc == 0
    doc = json.loads(out.getvalue())
    assert [tuple(d) for d in doc["flow_decisions"]] == flow
    assert [tuple(d) for d in doc["replay_decisions"]] == flow, doc["result"]["decisions"]
    assert doc["same"] is True
    reasons = [d["reason"] for d in doc["result"]["decisions"] if d["trigger"] != "start"]
    for theirs, ours in zip(decided, reasons, strict=True):
        if "adopting the new plan" in theirs["reason"]:  # forced: the flow names its VMs, the replay its GPUs
            assert "adopting the new plan" in ours
        else:  # the same words and numbers: what woke it, remaining steps, dollars, reconfiguration, steps redone
            assert theirs["reason"] == ours
    assert doc["result"]["finished"]
