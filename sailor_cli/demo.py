"""`sailor demo`: the `sailor` flow on the embedded default, end to end, with a summary.

Contract: runs the `sailor` flow in Prefect's ephemeral mode (no server needed; a configured
server is used if there is one) on the local provider and the local store: gpt-tiny on up to 4
local worker slots under a 2 USD/hour limit, scripted by scenarios/demo.yaml (a spot worker
preempted at step 20, the on-demand price doubling at step 80). With `--scenario`, the scenario's `demo`
section sets the job: scenarios/geo.yaml trains gpt-wide, one sample per step, on the multi-zone testbed.
It prints what happened (plans with their zones, device types and TP, events, decisions, reconfiguration
times, cost) and checks that no worker process, namespace, veth or cgroup of the run is left. Exit status 0
when the run completed and nothing was left behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from sailor_cli.options import (
    GlobalBatchSizeOrNone,
    Isolation,
    Json,
    MaxStages,
    Scenario,
    StepsOrNone,
    Store,
    Workdir,
    check_folder,
)
from sailor_core.errors import SailorError
from sailor_core.units import clip, sig, usd

REPO = Path(__file__).resolve().parent.parent
DEMO_SCENARIO = REPO / "scenarios" / "demo.yaml"


def _prefect_env(workdir: Path) -> None:
    # Prefect reads these at import: ephemeral mode with a project-local home, no telemetry.
    os.environ.setdefault("PREFECT_HOME", str(workdir.parent / ".prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def demo(
    steps: StepsOrNone = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", help="most devices a plan may use (default: the scenario's, else 4)")] = None,
    global_batch_size: GlobalBatchSizeOrNone = None,
    scenario: Scenario = DEMO_SCENARIO,
    store: Store = None,
    workdir: Workdir = Path(".sailor"),
    as_json: Json = False,
    max_stages: MaxStages = None,
    isolation: Isolation = "auto",
) -> None:
    """Run the sailor flow locally: plan, train (gpt-tiny on 4 workers; a scenario may say what) through a
    preemption and a price change.

    The job is the scenario's `demo` section, else 120 steps of 8 sequences; the options override it.
    """
    for flag, folder in (("--workdir", workdir), ("--store", store)):  # before the Prefect server and VMs start
        check_folder(flag, folder)
    workdir = workdir.resolve()
    from infra.scenario import load_scenario
    from infra.testbed import default_home, trusted_home

    # the scenario first: a malformed (or hostile) file is refused before Prefect is even imported
    job = {"model": "gpt-tiny", "global_batch_size": 8, "objective": "max-throughput", "max_usd_per_hour": 2.0,
           "steps": 120, "workers": 4, **load_scenario(scenario).demo}  # the scenario's demo job, then the flags
    trusted_home(default_home())  # the VMs' folders: a testbed home another user owns is refused here
    _prefect_env(workdir)
    from flows.params import validate_params
    from flows.sailor import run_id_for, sailor
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    given = {"steps": steps, "workers": workers, "global_batch_size": global_batch_size}
    job.update({k: v for k, v in given.items() if v is not None})
    steps, workers = job["steps"], job["workers"]
    params = dict(run_name="demo", max_stages=max_stages, provider="local", scenario=str(scenario),
                  isolation=isolation, checkpoint_interval=0, store_uri=_without_credentials(store),
                  workdir=str(workdir), **job)
    validate_params({k: v for k, v in params.items() if v is not None})  # a user error: one line, exit 2
    typer.echo(f"sailor demo: {job['model']}, {steps} steps of {job['global_batch_size']} samples on up to {workers} "
               f"devices, scenario {scenario}")
    state = sailor(**params, return_state=True)
    # this demo's own run (its flow run's id), never merely the newest run named "demo" in the store
    run_id = run_id_for("demo", str(state.state_details.flow_run_id or ""))
    history = RunHistory(open_store(store))
    try:
        run = history.show(run_id)
    except SailorError:
        typer.echo(f"error: the flow ended {state.type.value.lower()} before it recorded run {run_id}: "
                   f"{state.message or ''}"[:400], err=True)
        raise typer.Exit(1) from None
    left = _left_behind(workdir / "runs" / run["run_id"] / "local", run["run_id"])
    if as_json:
        typer.echo(json.dumps({**run, "processes_left": left}, indent=2, default=str))
    else:
        _print(run, left)
    if not state.is_completed() or left:
        raise typer.Exit(1)


def _without_credentials(store: str | None) -> str | None:
    """The store URI the flow gets: Prefect keeps a flow run's parameters, so credentials in the URI's query
    (access_key, secret_key, session_token) move to this process's environment, where the AWS SDK finds them."""
    if not store:
        return store
    from sailor_core.uris import split_credentials

    uri, env = split_credentials(store)
    os.environ.update(env)
    return uri


def _left_behind(root: Path, run_id: str) -> list[str]:
    from infra.local import LocalProvider, _group_alive

    if not root.exists():
        return []
    p = LocalProvider(root)
    out = [f"VM {v.vm_id} still {v.state}" for v in p.list_vms(run_id) if v.state in ("running", "preempting")]
    for f in (root / "vms").glob("*.json"):
        rec = json.loads(f.read_text())
        if rec.get("pid") and _group_alive(int(rec["pid"])):
            out.append(f"worker process group {rec['pid']} of {rec['vm_id']} alive")
    out += [f"testbed leftover: {x}" for x in p.leftovers(run_id)]  # namespaces, veths, cgroups, folders
    return out


def _print(run: dict, left: list[str]) -> None:
    typer.echo("")
    typer.echo(f"run {run['run_id']}: {run.get('status')} ({run.get('status_reason', '')})")
    for p in run["plans"]:
        est = p.get("estimate") or {}
        reason = clip(str(p.get("reason", "")), 160)  # cut at a word, never inside one
        typer.echo(f"  plan v{p['version']}: {sig(est.get('iteration_time_s', 0))} s/it estimated, "
                   f"{usd(est.get('usd_per_hour', 0))} USD/h  <- {reason}")
        for stage in (p.get("plan") or {}).get("stages", []):
            first, last = stage.get("layers", ["?", "?"])
            where = ", ".join(f"{x.get('gpu_type')} tp {x.get('tp', 1)} on a {x.get('gpus_per_node', 1)}-device "
                              f"{x.get('market')} VM @{x.get('zone')}" for x in stage.get("replicas", []))
            typer.echo(f"    layers {first}-{last}: {where}")
    typer.echo("  events:")
    for e in run["events"]:
        typer.echo(f"    {e['time'][11:23]} {e['kind']:<16} {clip(str(e.get('reason', '')), 150)}")
    typer.echo("  decisions:")
    for d in run["decisions"]:
        typer.echo(f"    {d['time'][11:23]} {d['kind']:<7} {clip(d['reason'], 220)}")
    for m in run["measurements"]:
        if m["kind"] == "iteration_time":
            typer.echo(f"  measured vs estimated (plan v{m.get('plan_version')}): {sig(m['measured_s'])} s vs "
                       f"{sig(m['estimated_s'])} s (x{m['ratio']:.2f})")
        if m["kind"] == "reconfiguration":
            typer.echo(f"  reconfiguration to plan v{m.get('plan_version')}: {m['reconfiguration_s']:.1f} s "
                       f"from the event to the first step")
    cluster = run.get("cluster") or {}
    if cluster:
        typer.echo(f"  cluster: isolation {cluster.get('isolation')}, checkpoints {cluster.get('checkpoint_uri')}")
    for k in ("steps_done", "usd_total", "wall_s"):
        if k in run:
            typer.echo(f"  {k}: {usd(run[k]) if k == 'usd_total' else run[k]}")
    typer.echo(f"  processes left: {'none' if not left else left}")
    typer.echo(f"  details: sailor runs show {run['run_id']}")
    if "final_loss" in run:  # the result last: what the run trained
        loss = run.get("final_loss")
        typer.echo(f"  result: {run.get('steps_done', 0)} steps, {int(run.get('tokens') or 0):,} tokens, final loss "
                   f"{'-' if loss is None else f'{loss:.4f}'}")
