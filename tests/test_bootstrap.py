"""The VM bootstrap (infra/bootstrap.py AGENT_SCRIPT), run for real: it installs exactly the run's
wheel into a fresh venv, refuses a wheel whose hash differs, and runs what the assignment says."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from infra.bootstrap import AGENT_SCRIPT
from infra.local import _deps_site
from sailor_core.runtime.protocol import ControlServer, job_key
from tasks.runstate import build_wheel, project_root


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return build_wheel(project_root() / "build" / "sailor-wheels")


def _run(tmp_path, assignment: dict) -> subprocess.CompletedProcess[str]:
    (tmp_path / "a.json").write_text(json.dumps(assignment))
    (tmp_path / "agent.sh").write_text(AGENT_SCRIPT)
    # a fresh VM has neither this run's settings nor a PYTHONPATH pointing at a checkout
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAILOR_") and k != "PYTHONPATH"}
    env.update(SAILOR_ASSIGNMENT_FILE=str(tmp_path / "a.json"), SAILOR_HOME=str(tmp_path / "home"),
               SAILOR_PYTHON=sys.executable, SAILOR_DEPS_SITE=_deps_site(), PATH="/usr/bin:/bin")
    return subprocess.run(["bash", str(tmp_path / "agent.sh")], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))


def test_the_bootstrap_installs_exactly_the_runs_wheel_and_runs_its_command(tmp_path, wheel):
    server = ControlServer()
    try:
        copy = tmp_path / "code" / wheel.name
        copy.parent.mkdir()
        shutil.copy(wheel, copy)
        sha = hashlib.sha256(copy.read_bytes()).hexdigest()
        a = {"run_secret": server.secret, "rendezvous_endpoint": server.endpoint, "vm_id": "vm-1", "plan_version": 7,
             "wheel_url": str(copy), "wheel_sha256": sha, "command": ["profiles", "list", "--json",
                                                                       "--store", str(tmp_path / "store")]}
        r = _run(tmp_path, a)
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout)  # the installed `sailor` ran and listed the seed's profiles
        assert server.get(job_key("vm-1", 7)) == "0"  # and the VM reported the command's exit status
        venv = tmp_path / "home" / "venv"
        assert (venv / ".sailor-wheel").read_text().strip() == sha
        site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sailor_core; print(sailor_core.__file__)"],
                              capture_output=True, text=True, cwd=str(tmp_path),
                              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).stdout
        assert str(venv) in site  # the wheel's copy, not this checkout
        # a wheel that is not the one the run built is refused, and nothing is installed from it
        (tmp_path / "home" / "venv" / ".sailor-wheel").write_text("other")
        r = _run(tmp_path, {**a, "wheel_sha256": "0" * 64})
        assert r.returncode == 3 and "the run expects" in r.stderr
    finally:
        server.close()
