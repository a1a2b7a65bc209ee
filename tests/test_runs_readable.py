"""Runs readable after they end: `sailor runs list|show` on runs of `sailor train`, and on runs whose state
lived on the testbed's temporary object store (gone with the run), without a lookup anywhere else.

Before, `runs show --plot` of every run made as root failed looking up `s3://sailor-runs/...` on AWS (a
public bucket name anyone could own) and printed its fix twice; `sailor train` runs never appeared in
`runs list`; and `runs list` in another folder said `0 run(s)` with no hint of which store it read.
"""

from __future__ import annotations

import json

from sailor_cli.main import main

PLAN = {"format": "sailor-plan", "version": 1, "model": "gpt-tiny", "global_batch_size": 4,
        "stages": [{"layers": [0, 5], "replicas": [{"gpu_type": "cpu", "gpus_per_node": 1, "zone": "local",
                                                    "tp": 1}]}],
        "pipelines": [{"microbatch_size": 2, "num_microbatches": 2}]}


def test_a_sailor_train_run_is_listed_and_plotted(tmp_path, capsys):
    plan = tmp_path / "one.json"
    plan.write_text(json.dumps(PLAN))
    store = str(tmp_path / "store")
    assert main(["train", str(plan), "--steps", "3", "--store", store]) == 0
    capsys.readouterr()
    assert main(["runs", "list", "--store", store, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"], r["steps_done"]) for r in runs] == [("sailor-train:one", "completed", 3)]
    png = tmp_path / "c.png"
    assert main(["runs", "show", runs[0]["run_id"], "--store", store, "--plot", str(png), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in shown["steps"]] == [1, 2, 3]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_runs_list_names_the_store_it_read(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SAILOR_STORE", raising=False)
    assert main(["runs", "list"]) == 0
    out = capsys.readouterr()
    assert f"0 run(s) in the store {tmp_path / '.sailor' / 'store'}" in out.out
    assert "another folder" in out.err


def _testbed_run(store: str, workdir: str, state_uri: str) -> str:
    from profiles_store.store import open_store
    from tasks.history import RunEvent, RunHistory, RunStatus

    h = RunHistory(open_store(store))
    h.run_status("demo-1", RunStatus.RUNNING, "started", {"name": "demo", "params": {"workdir": workdir}})
    h.event("demo-1", RunEvent.CLUSTER, "where the run's VMs and state live",
            {"cluster": {"isolation": "netns", "state_uri": state_uri}})
    # a worker's error as gloo words it: text to show, not markup (it broke `runs show` with a MarkupError)
    h.event("demo-1", "lost", "VM a: worker reported failed: RuntimeError: [/__w/pytorch/gloo/pair.cc:553] "
            "Connection closed by peer [10.213.1.7]:38083", {})
    h.run_status("demo-1", RunStatus.COMPLETED, "done", {"steps_done": 4})
    return "demo-1"


def test_an_older_testbed_run_is_read_from_the_folder_its_objects_outlived_the_server_in(tmp_path, capsys):
    from tasks.runstate import RunState, flush_metrics

    wd, store = tmp_path / "wd", str(tmp_path / "store")
    folder = wd / "objects" / "sailor-runs" / "runs" / "demo-1"
    flush_metrics(RunState(uri=str(folder), flow_uri=str(folder), vm_uri=str(folder)), 1,
                  [{"step": s, "loss": 5.0 - s, "plan_version": 1} for s in range(1, 5)])
    run_id = _testbed_run(store, str(wd), "s3://sailor-runs/runs/demo-1")
    assert main(["runs", "show", run_id, "--store", store, "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "1-4, each once" in out and "[/__w/pytorch/gloo/pair.cc:553]" in " ".join(out.split())


def test_a_run_whose_state_is_gone_says_so_once_and_asks_no_other_bucket(tmp_path, capsys, monkeypatch):
    # No route anywhere but loopback: a lookup on AWS would fail with "Could not resolve host" (as before).
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = str(tmp_path / "store")
    run_id = _testbed_run(store, str(tmp_path / "gone"), "s3://sailor-runs/runs/demo-1")
    assert main(["runs", "show", run_id, "--store", store, "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("to fix:") == 1 and "testbed's object store" in err and "resolve host" not in err, err
