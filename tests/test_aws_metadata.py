"""The on-VM metadata pollers (infra/metadata.py) against local HTTP fakes of IMDSv2 and GCE metadata."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infra.metadata import (
    AwsImdsPoller,
    GcpMetadataPoller,
    MetadataUnavailable,
    Notice,
    poller_from_env,
    watch,
)

pytestmark = pytest.mark.aws


class MetadataFake:
    """IMDSv2 (token required, tokens can be expired) and GCE metadata (Metadata-Flavor required)."""

    def __init__(self) -> None:
        self.instance_action: dict | None = None
        self.rebalance: dict | None = None
        self.preempted = "FALSE"
        self.maintenance = "NONE"
        self.tokens: set[str] = set()
        self.token_puts = 0
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    fake.token_puts += 1
                    tok = f"tok{fake.token_puts}"
                    fake.tokens.add(tok)
                    return self._send(200, tok)
                self._send(400, "")

            def do_GET(self):
                if self.path.startswith("/latest/"):
                    if self.headers.get("X-aws-ec2-metadata-token") not in fake.tokens:
                        return self._send(401, "")
                    doc = {"/latest/meta-data/spot/instance-action": fake.instance_action,
                           "/latest/meta-data/events/recommendations/rebalance": fake.rebalance}.get(self.path)
                    return self._send(200, json.dumps(doc)) if doc else self._send(404, "Not Found")
                if self.path.startswith("/computeMetadata/v1/"):
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403, "Missing Metadata-Flavor:Google header.")
                    key = self.path.removeprefix("/computeMetadata/v1/")
                    val = {"instance/preempted": fake.preempted, "instance/maintenance-event": fake.maintenance}.get(
                        key
                    )
                    return self._send(200, val) if val is not None else self._send(404, "")
                self._send(404, "")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def meta():
    f = MetadataFake()
    yield f
    f.stop()


def test_aws_imdsv2_interruption_and_rebalance(meta) -> None:
    p = AwsImdsPoller(base_url=meta.url)
    assert p.poll() == []
    meta.rebalance = {"noticeTime": "2026-03-01T12:00:00Z"}
    (n,) = p.poll()
    assert n.kind == "rebalance-recommendation" and not n.imminent and n.at.hour == 12
    meta.instance_action = {"action": "terminate", "time": "2026-03-01T12:02:00Z"}
    kinds = [(x.kind, x.action, x.imminent) for x in p.poll()]
    assert kinds == [("spot-interruption", "terminate", True), ("rebalance-recommendation", "", False)]
    assert meta.token_puts == 1  # the token is reused
    meta.tokens.clear()  # expired: renewed once, transparently
    assert len(p.poll()) == 2 and meta.token_puts == 2


def test_gcp_preempted_and_maintenance(meta) -> None:
    p = GcpMetadataPoller(base_url=meta.url)
    assert p.poll() == []
    meta.preempted = "TRUE"
    assert [(n.kind, n.imminent) for n in p.poll()] == [("preempted", True)]
    meta.maintenance = "TERMINATE_ON_HOST_MAINTENANCE"
    assert [n.kind for n in p.poll()] == ["preempted", "maintenance"]


def test_unreachable_metadata_is_not_a_notice() -> None:
    with pytest.raises(MetadataUnavailable):
        AwsImdsPoller(base_url="http://127.0.0.1:9", timeout_s=0.5).poll()


def test_watch_calls_back_once_per_notice_then_stops(meta) -> None:
    got: list[Notice] = []
    stop = threading.Event()
    p = poller_from_env({"SAILOR_METADATA": "aws", "SAILOR_METADATA_URL": meta.url})
    assert isinstance(p, AwsImdsPoller) and poller_from_env({}) is None

    def on_notice(n: Notice) -> None:
        got.append(n)
        if n.imminent:
            stop.set()  # the agent checkpoints and stops watching

    t = threading.Thread(target=watch, args=(p, on_notice, stop), kwargs={"interval_s": 0.02})
    t.start()
    meta.rebalance = {"noticeTime": "2026-03-01T12:00:00Z"}
    meta.instance_action = {"action": "stop", "time": "2026-03-01T12:02:00Z"}
    t.join(timeout=10)
    assert not t.is_alive()
    assert [n.kind for n in got] in (["spot-interruption", "rebalance-recommendation"],
                                     ["rebalance-recommendation", "spot-interruption"])


def test_notice_unit_runs_its_command_once_on_an_imminent_notice(meta, tmp_path) -> None:
    import os
    import subprocess
    import sys

    flag = tmp_path / "sigterm-sent"
    meta.preempted = "TRUE"
    env = {**os.environ, "SAILOR_METADATA": "gcp", "SAILOR_METADATA_URL": meta.url}
    done = subprocess.run(
        [sys.executable, "-m", "infra.metadata", "--exec", f"echo x >> {flag}", "--interval-s", "0.05"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "notice: preempted" in done.stdout
    assert flag.read_text() == "x\n"
