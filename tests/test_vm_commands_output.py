"""One-off commands on rented VMs keep their output (infra/bootstrap.py writes it under the run's logs),
and a failure quotes it (tasks/remote.py VmCommands.failure): the error says why, not only "see the logs"."""

from __future__ import annotations

from pathlib import Path

from sailor_core.errors import Failure
from tasks.jobs import CodeRef
from tasks.remote import UNFINISHED, VmCommands
from tasks.runstate import RunState


def test_a_failed_job_quotes_each_vms_kept_output_and_names_the_unfinished_ones(tmp_path: Path) -> None:
    state = RunState(uri=str(tmp_path), flow_uri=str(tmp_path), vm_uri=str(tmp_path))
    remote = VmCommands(provider=None, controller=None, state=state, code=CodeRef(), run_id="r1")  # type: ignore[arg-type]
    remote.job = 1_000_003
    jobs = tmp_path / "logs" / "jobs"
    jobs.mkdir(parents=True)
    (jobs / "vm-a-1000003.log").write_text("line 1\n" + "x" * 5000 + "\nerror: this VM has no device 0; to fix: ...\n")
    (jobs / "vm-a-1000002.log").write_text("an earlier job's output\n")
    err = remote.failure("measuring zb <-> zb", {"vm-a": 1, "vm-b": UNFINISHED, "vm-c": 0, "vm-d": 137})
    assert isinstance(err, Failure)
    text = str(err)
    assert "vm-a exited 1:" in text and "error: this VM has no device 0" in text and "line 1" not in text
    assert "an earlier job's output" not in text  # the last job's, not another's
    assert "vm-b had not finished when another VM's command failed" in text
    assert "vm-c" not in text
    assert "vm-d exited 137:\n(no output kept: the VM ended before its command did)" in text
    assert str(tmp_path / "logs" / "jobs") in text


def test_the_bootstrap_keeps_a_jobs_output_in_object_storage_where_the_flow_reads_it(tmp_path: Path) -> None:
    """The snippet of infra/bootstrap.py that uploads a one-off command's output, run as a testbed VM runs it:
    against the testbed's S3 server (no folders there: creating one failed with INTERNAL_FAILURE)."""
    import os
    import subprocess
    import sys

    from infra.bootstrap import AGENT_SCRIPT
    from tasks.runstate import TestbedObjectStore

    snippet = AGENT_SCRIPT.split("\"$pyrun\" -c '", 1)[1].split("' \"$(field log_uri)\"", 1)[0]
    objects = TestbedObjectStore(tmp_path / "objects", "127.0.0.1")
    try:
        state = objects.state("r1")
        (tmp_path / "out").write_text("link measured\n")
        (tmp_path / "err").write_text("error: something\n")
        r = subprocess.run([sys.executable, "-c", snippet, state.logs("vm"), "vm-a-1000001.log", str(tmp_path / "out"),
                            str(tmp_path / "err")], capture_output=True, text=True, env={**os.environ, **state.vm_env},
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        remote = VmCommands(provider=None, controller=None, state=state, code=CodeRef(), run_id="r1")  # type: ignore[arg-type]
        remote.job = 1_000_001
        assert remote.output("vm-a") == "link measured\nerror: something\n"
    finally:
        objects.close()
