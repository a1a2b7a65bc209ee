"""The rule that prunes what runs leave (tasks/retention.py), and the Prefect server watch's states
(tasks/outage.py; tests/test_prefect_outage.py kills a real server)."""

from __future__ import annotations

import http.server
import threading

from tasks.outage import PrefectWatch
from tasks.retention import KEEP_RUNS, prune_older_runs, prune_run, prune_wheel_cache
from tasks.runstate import RunState


def _checkpoint(root, step: int, valid: bool = True) -> None:
    d = root / "checkpoints" / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "layer_0000.tp0of1.pt").write_bytes(b"x" * 10)
    if valid:
        (d / "meta.json").write_text("{}")


def _state(root) -> RunState:
    return RunState(uri=str(root), flow_uri=str(root), vm_uri=str(root))


def test_a_run_keeps_its_newest_valid_checkpoint_and_drops_its_wheel_copy(tmp_path):
    for step in (10, 20, 30):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 40, valid=False)  # a torn newest one: 30 is what a resume reads, and stays
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "sailor_prefect-0-py3-none-any.whl").write_bytes(b"w" * 100)
    removed = prune_run(_state(tmp_path), newest_valid=30)
    assert sorted(removed) == ["checkpoints/step_00000010", "checkpoints/step_00000020",
                               "code/sailor_prefect-0-py3-none-any.whl"]
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_00000030", "step_00000040"]
    assert prune_run(_state(tmp_path), newest_valid=None) == []  # no valid one: every checkpoint stays


def test_earlier_runs_beyond_the_newest_keep_no_checkpoint(tmp_path):
    ids = [f"r{k}" for k in range(KEEP_RUNS + 2)]
    for i in ids:
        _checkpoint(tmp_path / i, 5)
    removed = prune_older_runs(ids, lambda i: _state(tmp_path / i))
    assert {r.split("/")[0] for r in removed} == set(ids[:2])
    assert all(list((tmp_path / i / "checkpoints").iterdir()) for i in ids[2:])


def test_the_wheel_cache_keeps_the_newest_builds(tmp_path):
    import os

    for k in range(5):
        d = tmp_path / f"hash{k}"
        d.mkdir()
        os.utime(d, (1000 + k, 1000 + k))
    assert prune_wheel_cache(tmp_path, keep=tmp_path / "hash0") == ["hash1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hash0", "hash2", "hash3", "hash4"]


def test_the_watch_tells_up_down_and_lost_by_the_servers_answers():
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    now = [0.0]
    w = PrefectWatch(f"http://127.0.0.1:{server.server_port}/health", outage_s=30, clock=lambda: now[0])
    w.look()
    assert w.state() == "up"
    server.shutdown()
    server.server_close()
    w.look()
    assert w.state() == "down" and w.outages == 1
    now[0] = 29.0
    assert w.state() == "down"
    now[0] = 30.0
    assert w.state() == "lost" and "has not answered for 30 s" in w.why()
