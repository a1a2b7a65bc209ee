"""The Prefect UI shows a run's plan, frontier and training-curves artifacts, checked in headless Chromium.

Starts a real `prefect server start` on a free port (its own PREFECT_HOME), runs the `sailor` flow
against it in a subprocess (a dry run: profile, plan and publish the artifacts, rent nothing), then
loads the artifact's page in headless Chromium and looks for the artifact in the rendered DOM.
Skipped only where no Chromium is installed (Debian: `apt-get install chromium`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# The session fixtures (one test server, one profiled store) are shared by every module that loads them.
pytest_plugins = ["tests.flow_fixtures"]

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install chromium)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(api: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"prefect server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"{api}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("prefect server did not become healthy")


def _dom(url: str, profile_dir: Path) -> str:
    out = subprocess.run(
        [
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile_dir}",
            "--virtual-time-budget=20000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout


def test_the_ui_shows_the_runs_plan_artifact(profiled_store, tmp_path):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": api, "PREFECT_SERVER_API_PORT": str(port), "PREFECT_API_URL": ""}
    server = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        _wait_healthy(api, server)
        # a dry run trains nothing: its curves artifact is published as the monitor does, from step records
        # of two plan versions (tests/test_flow.py checks that a training run publishes it)
        code = ("from flows.sailor import sailor; import json; from tasks.reporting import publish_curves; "
                f"r = sailor(run_name='ui', steps=5, workers=2, dry_run=True, store_uri={profiled_store!r}, "
                f"workdir={str(tmp_path / 'work')!r}); print('RUN', r['run_id']); "
                "publish_curves(r['run_id'], [{'step': s, 'loss': 5.0 - s / 4, 'tokens_per_s': 900.0 + 40 * (s > 3), "
                "'plan_version': 1 + (s > 3)} for s in range(1, 8)])")
        run = subprocess.run([sys.executable, "-c", code], env={**env, "PREFECT_API_URL": api}, cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        run_id = next(line.split()[1] for line in run.stdout.splitlines() if line.startswith("RUN "))
        key = f"plan-{run_id}".lower()
        dom = _dom(f"http://127.0.0.1:{port}/artifacts/key/{key}", tmp_path / "chromium")
        assert "Can't connect to Server API" not in dom
        assert key in dom, dom[-3000:]
        assert "Plan v1 for gpt-tiny" in dom
        frontier = _dom(f"http://127.0.0.1:{port}/artifacts/key/frontier-{run_id}".lower(), tmp_path / "chromium2")
        assert f"frontier-{run_id}".lower() in frontier and "Pareto frontier of throughput against cost" in frontier
        curves = _dom(f"http://127.0.0.1:{port}/artifacts/key/curves-{run_id}".lower(), tmp_path / "chromium3")
        assert f"curves-{run_id}".lower() in curves and "Loss and tokens/s per step" in curves, curves[-3000:]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
