"""The flow replays the job over a trace as a what-if before renting anything, and the UI gets it as an artifact.

A dry `sailor` flow run (gpt-tiny on the local provider: profile, plan, rent nothing) with
`what_if_trace` naming a small trace of ours: two places (the local zone's `cpu` devices, spot and
on-demand), spot preempted after ten minutes and back an hour later. The run publishes the
`what-if-<run id>` markdown artifact (a row per policy) and a `what_if` event with the figures,
and rents nothing; a trace that does not exist is refused with the other parameters, before the
run starts.
"""

from __future__ import annotations

import json

import pytest

pytest_plugins = ["tests.flow_fixtures"]

pytestmark = pytest.mark.usefixtures("prefect_harness")

TRACE = {
    "format": "sailor-trace", "version": 1, "name": "spot preempted for an hour",
    "places": [{"zone": "local", "gpu_type": "cpu", "market": "on-demand", "gpus_per_node": 1},
               {"zone": "local", "gpu_type": "cpu", "market": "spot", "gpus_per_node": 1}],
    "points": [{"at_s": 0, "counts": [2, 2], "usd_per_gpu_hour": [0.30, 0.10]},
               {"at_s": 600, "counts": [2, 0], "usd_per_gpu_hour": [0.30, 0.10], "taken": [0, 2]},
               {"at_s": 4200, "counts": [2, 2], "usd_per_gpu_hour": [0.30, 0.10]}],
}


def test_the_flow_publishes_a_what_if_replay_before_renting(profiled_store, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.sailor import sailor
    from profiles_store.store import open_store
    from tasks.history import RunHistory
    from tasks.reporting import artifact_key

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(TRACE))
    state = sailor(run_name="whatif", model="gpt-tiny", global_batch_size=8, objective="min-cost", provider="local",
                   workers=2, steps=200_000, checkpoint_interval=50, store_uri=profiled_store,
                   workdir=str(tmp_path / "work"), isolation="process", dry_run=True, what_if_trace=str(trace),
                   return_state=True)
    assert state.is_completed(), state.message
    h = RunHistory(open_store(profiled_store))
    run_id = [r for r in h.list_runs() if r.get("name") == "whatif"][-1]["run_id"]
    shown = h.show(run_id)
    ev = [e for e in shown["events"] if e["kind"] == "what_if"]
    assert len(ev) == 1, [e["kind"] for e in shown["events"]]
    doc = ev[0]
    results = {r["policy"]: r for r in doc["results"]}
    assert set(results) == {"sailor", "relaunch-same", "static", "periodic"}
    assert doc["total_steps"] == 200_000 and all(r["total_steps"] == 200_000 for r in results.values())
    # The preemption takes the spot devices the min-cost plan holds: static waits for them, the others move.
    assert results["static"]["waiting_s"] > 0 and results["sailor"]["switches"] >= 1
    assert "provisioned" not in [e["kind"] for e in shown["events"]]

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[artifact_key("what-if", run_id)])))
    assert arts, "no what-if artifact"
    md = str(arts[-1].data)
    assert arts[-1].type == "markdown" and "spot preempted for an hour" in md
    for policy in ("sailor", "relaunch-same", "static", "periodic"):
        assert f"| {policy} |" in md, md


def test_a_what_if_trace_that_does_not_exist_is_refused_before_the_run(profiled_store, tmp_path):
    from flows.params import InvalidParameters, validate_params

    with pytest.raises(InvalidParameters, match="what_if_trace: .*does not exist"):
        validate_params({"model": "gpt-tiny", "steps": 10, "what_if_trace": str(tmp_path / "nope.json")})
