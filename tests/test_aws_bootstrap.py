"""The VM startup script and the assignment hand-off (infra/bootstrap.py), for aws and gcp."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from infra.bootstrap import (
    AGENT_PATH,
    AGENT_SCRIPT,
    ASSIGNMENT_FILE,
    assignment_commands,
    assignment_json,
    render_startup_script,
)
from infra.provider import WorkerAssignment
from sailor_core.errors import ProviderError

pytestmark = pytest.mark.aws

A = WorkerAssignment(run_id="r1", plan_version=3, plan_json='{"stages": []}', rendezvous_endpoint="10.0.0.5:29400",
                     ranks=(2, 3), world_size=4, checkpoint_uri="s3://bucket/r1/ckpt", model="gpt-tiny",
                     total_steps=100, checkpoint_interval=10, metrics_uri="s3://bucket/r1/metrics/w1.jsonl",
                     env={"SAILOR_STAGE": "1"})


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_startup_script_is_valid_bash_deterministic_and_starts_the_worker(cloud: str, tmp_path) -> None:
    s = render_startup_script(cloud=cloud, run_id="r1", vm_name="w0")
    assert s == render_startup_script(cloud=cloud, run_id="r1",
                                      vm_name="w0")
    path = tmp_path / "s.sh"
    path.write_text(s)
    subprocess.run(["bash", "-n", str(path)], check=True)
    # the one bootstrap every provider runs, written out and started by systemd
    assert f"cat > {AGENT_PATH} <<'AGENT'\n{AGENT_SCRIPT}AGENT\n" in s and f"ExecStart=/bin/bash {AGENT_PATH}" in s
    assert f"Environment=SAILOR_ASSIGNMENT_FILE={ASSIGNMENT_FILE}" in s
    assert 'python -m infra.metadata --exec "systemctl kill --signal=SIGTERM sailor-worker.service"' in s
    assert "Environment=SAILOR_METADATA=" + cloud in s
    assert ("sailor-assignment?wait_for_change=true" in s) == (cloud == "gcp")


def test_no_secret_reaches_a_vm() -> None:
    with pytest.raises(ProviderError, match=r"refusing to copy \['AWS_SECRET_ACCESS_KEY'\].*instance role"):
        render_startup_script(cloud="aws", run_id="r", vm_name="w",
                              env={"AWS_SECRET_ACCESS_KEY": "abc"})
    with pytest.raises(ProviderError, match="GCS_TOKEN"):
        assignment_json(dataclasses.replace(A, env={"GCS_TOKEN": "t"}), "i-1")
    with pytest.raises(ValueError, match="cloud must be"):
        render_startup_script(cloud="azure", run_id="r", vm_name="w")


def test_ssm_commands_write_the_assignment_the_worker_reads(tmp_path) -> None:
    target = tmp_path / "etc-sailor"
    cmds = [c.replace("/etc/sailor", str(target)).replace("systemctl restart sailor-worker.service", "true")
            for c in assignment_commands(A, "i-0abc")]
    subprocess.run(["bash", "-euc", "\n".join(cmds)], check=True)
    got = json.loads((target / "assignment.json").read_text())
    # every field, as the local provider writes it, plus the worker id the VM's worker runs under
    assert got == {**dataclasses.asdict(A), "ranks": [2, 3], "command": [], "vm_id": "i-0abc"}
