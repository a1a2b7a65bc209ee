"""The `sailor` flow on the aws provider (moto): two regions, a spot interruption, a replan, completion.

The VMs are moto's EC2 CPU instances (GPU type `cpu`; the spot VM interrupted is a 2-device VM that runs
two ranks), provisioned, tagged, secured and terminated by AwsProvider; the workers each VM's startup script
would start run on this machine instead (tests/fakes/agents_here.py), after the assignment went out by SSM.
The spot interruption is the two-minute notice as the VM's metadata relay reports it (moto emits none),
followed by EC2 taking the VM back.
Afterwards moto must hold no running instance and no security group of the run, and no credential
may appear in any log line, artifact, store row or file of the run.
"""

from __future__ import annotations

import pytest

from infra.aws import AwsConfig, AwsProvider
from infra.catalog import ScriptedPriceSource
from infra.cloud import RUN_TAG, ScriptedEventSource
from sailor_core.domain import Market
from tests.cloud_flow_fixtures import (
    INTERRUPTED_RUN_STEPS,
    assert_two_ranks_on_one_vm,
    cloud_store,
    leaks,
    notice_runs_out,
    when_step,
    zones_per_plan,
)
from tests.fakes.agents_here import AgentsHere
from tests.fakes.moto_server import DUMMY_KEY_ID, DUMMY_SECRET, MotoServer, client_factory

pytest_plugins = ["tests.flow_fixtures"]  # one Prefect test server per session, shared with test_flow

pytestmark = [pytest.mark.aws, pytest.mark.usefixtures("prefect_harness")]

ZONES = ("us-east-1a", "us-west-2a", "us-west-2b")
GPU = "cpu"  # CPU instances: c7i.2xlarge has one worker slot, c7i.4xlarge two (a multi-device VM)


@pytest.fixture(scope="module")
def moto():
    server = MotoServer()
    yield server
    server.stop()


def test_flow_on_aws_survives_a_spot_interruption_and_leaves_nothing(moto, request, tmp_path, monkeypatch):
    from flows.sailor import Deps, sailor
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    # The credentials a real run would have in its environment; none may leak anywhere.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", DUMMY_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", DUMMY_SECRET)
    moto.reset()
    store_uri = cloud_store(request.getfixturevalue("profiled_store"), tmp_path / "store", ZONES)
    prices = ScriptedPriceSource(cloud="aws")
    prices.set(instance_type="c7i.4xlarge", zone="us-east-1a", market=Market.SPOT, usd_per_hour=0.24)  # 2 devices
    prices.set(instance_type="c7i.2xlarge", zone="us-west-2a", market=Market.SPOT, usd_per_hour=0.13)
    prices.set(instance_type="c7i.2xlarge", zone="us-west-2b", market=Market.ON_DEMAND, usd_per_hour=0.40)
    notices = ScriptedEventSource()
    client_for = client_factory(moto.url)
    aws = AwsProvider(AwsConfig(regions=("us-east-1", "us-west-2"), zones=ZONES, max_vms_per_offering=1,
                                image_ids={"us-east-1": "ami-dca37ea5", "us-west-2": "ami-dca37ea5"},
                                wait_delay_s=0.05),
                      client_for=client_for, prices=prices, event_source=notices)
    provider = AgentsHere(aws, tmp_path / "agents")
    work = tmp_path / "work"
    interrupted: list[str] = []

    def interrupt() -> None:
        vm = next(v for v in aws.list_vms() if v.zone == "us-east-1a")
        notices.spot_interruption(vm)  # the two-minute notice, as the metadata relay reports it
        notice_runs_out(provider, vm.vm_id, 120.0)  # the 2-minute notice: the flow stops the workers first
        provider.reclaim(vm.vm_id)  # the VM powers off ...
        client_for("ec2", "us-east-1").terminate_instances(InstanceIds=[vm.vm_id])  # ... and EC2 takes it back
        interrupted.append(vm.vm_id)

    deps = Deps(provider=provider, store=open_store(store_uri), workdir=work, poll_s=1.5)
    watcher = when_step(deps.board, 4, interrupt)
    # The budget affords the two spot VMs (0.37/h) but no pair with the on-demand one (>= 0.53/h).
    state = sailor(run_name="aws-spot", model="gpt-tiny", global_batch_size=8, objective="max-throughput",
                   max_usd_per_hour=0.5, provider="aws", regions=["us-east-1", "us-west-2"], gpu_types=[GPU],
                   steps=INTERRUPTED_RUN_STEPS, checkpoint_interval=4, store_uri=store_uri, workdir=str(work),
                   deps=deps, return_state=True)
    watcher.join(timeout=30)
    assert state.is_completed(), state.message
    assert interrupted, "the interruption never fired"

    h = RunHistory(open_store(store_uri))
    run = h.show(next(r["run_id"] for r in h.list_runs() if r.get("name") == "aws-spot"))
    kinds = [e["kind"] for e in run["events"]]
    assert run["status"] == "completed"
    assert "preemption" in kinds and "reconfigured" in kinds, kinds
    zones = zones_per_plan(run)
    print(f"aws flow: zones per plan {[sorted(z) for z in zones]}, events {kinds}")
    assert "us-east-1a" in zones[0] and any(z.startswith("us-west-2") for z in zones[-1])  # two regions
    assert "us-east-1a" not in zones[-1]  # replanned onto the remaining capacity
    # The 2-device VM ran two ranks until it was taken back.
    assert_two_ranks_on_one_vm(run["plans"][0]["plan"], "us-east-1a")

    # Nothing left on the cloud: no running instance, no security group of the run; no worker here.
    for region in ("us-east-1", "us-west-2"):
        ec2 = client_for("ec2", region)
        res = ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
        assert [i["InstanceId"] for r in res["Reservations"] for i in r["Instances"]] == []
        assert ec2.describe_security_groups(Filters=[{"Name": "tag-key", "Values": [RUN_TAG]}])["SecurityGroups"] == []
    assert provider.alive() == []

    # No credential in any log line, artifact, store row or file of the run, nor in what went to the VMs.
    sent = []
    for region in ("us-east-1", "us-west-2"):
        for c in client_for("ssm", region).list_commands()["Commands"]:
            sent.append(str(c["Parameters"]))
    assert sent, "no assignment was sent to the VMs"
    assert leaks([DUMMY_KEY_ID, DUMMY_SECRET], store_uri=store_uri, folders=[work, tmp_path / "agents"],
                 extra=sent) == []
