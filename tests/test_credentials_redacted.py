"""Credentials in a store URI are never stored, logged or printed (issue 44, item 18).

`sailor demo --store "s3://bucket/store?...&secret_key=SENTINEL"` kept the URI as it was in the flow
run's parameters (Prefect's database) and in the run history's `runs` table, and `sailor runs show
--json` printed it; unknown query keys (`session_token=`) were echoed in messages. Here a real S3
server (rclone) takes a sentinel as its secret key, the demo runs against it as a user runs it, and
every byte the run left (Prefect's database, the work folder, temporary files, the store's objects,
what the commands printed) is searched for the sentinel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sailor_core.errors import StoreError
from tests.paths import REPO

SECRET = "SENTINEL-secret-7d1f"
TOKEN = "SENTINEL-token-52aa"


def test_redact_hides_every_credential_and_every_unknown_key():
    from sailor_core.uris import redact, redact_text, redact_values

    uri = (f"s3://b/store?endpoint_override=127.0.0.1%3A9000&access_key=AKIDSENTINEL&secret_key={SECRET}"
           f"&session_token={TOKEN}&mystery=SENTINEL-mystery&scheme=http")
    shown = redact(uri)
    assert "SENTINEL" not in shown and "mystery" not in shown
    assert "endpoint_override=127.0.0.1:9000" in shown and "scheme=http" in shown and "secret_key=***" in shown
    assert "SENTINEL" not in redact("s3://AKID:SENTINEL-pw@bucket/x")
    assert redact("/a/local/folder") == "/a/local/folder"
    assert "SENTINEL" not in redact_text(f"cannot open 's3://b/x?secret_key={SECRET}': denied")
    assert "SENTINEL" not in json.dumps(redact_values({"params": {"store_uri": uri, "n": 3, "l": [uri]}}))


def test_credentials_move_from_the_uri_to_the_sdk_environment():
    from sailor_core.uris import split_credentials

    uri, env = split_credentials(f"s3://b/s?endpoint_override=h%3A1&access_key=AK&secret_key={SECRET}"
                                 f"&session_token={TOKEN}")
    assert "SENTINEL" not in uri and "endpoint_override=h:1" in uri
    assert env == {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": TOKEN}


def test_a_store_uri_with_an_unknown_query_key_is_refused_without_echoing_it():
    from sailor_core.uris import store_target

    with pytest.raises(StoreError) as e:
        store_target("s3://b/s?endpoint_override=h%3A1&SENTINEL-key=SENTINEL-value", env={})
    assert "SENTINEL" not in str(e.value) and "to fix" in str(e.value)


def test_the_run_history_keeps_and_shows_no_credential(tmp_path):
    from profiles_store.store import HistoryRecord, open_store
    from tasks.history import RunHistory, RunStatus

    store = open_store(str(tmp_path / "store"), env={})
    history = RunHistory(store)
    uri = f"s3://b/store?endpoint_override=h%3A1&secret_key={SECRET}"
    history.run_status("r-1", RunStatus.RUNNING, f"started with {uri}", {"name": "r", "params": {"store_uri": uri}})
    assert SECRET not in repr([r.payload for r in store.read_history("runs")] + [r.reason for r in
                                                                               store.read_history("runs")])
    # a row written before redaction existed is not shown either
    store.append_history("runs", [HistoryRecord(run_id="r-2", kind=str(RunStatus.RUNNING), time=history.clock(),
                                                reason="", payload={"name": "old", "params": {"store_uri": uri}})])
    assert SECRET not in json.dumps(history.show("r-2"), default=str)
    assert history.show("r-2")["params"]["store_uri"].startswith("s3://b/store?endpoint_override=h:1")


def _sentinels_under(root: Path) -> list[str]:
    found = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            if SECRET.encode() in data or TOKEN.encode() in data:
                found.append(str(p.relative_to(root)))
    return found


@pytest.mark.s3
def test_sailor_demo_with_credentials_in_the_store_uri_leaves_them_nowhere(tmp_path):
    from profiles_store.local_servers import LocalS3Server

    with LocalS3Server(secret_key=SECRET) as s3:
        s3.create_bucket("demo")
        store = s3.uri("demo", "store") + f"&session_token={TOKEN}"
        env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "TMPDIR": str(tmp_path / "tmp"),
               "SAILOR_STORE": str(tmp_path / "default-store")}
        (tmp_path / "tmp").mkdir()
        demo = subprocess.run([sys.executable, "-m", "sailor_cli.main", "demo", "--steps", "2", "--isolation",
                               "process", "--workdir", str(tmp_path / "work"), "--store", store],
                              capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
        runs = subprocess.run([sys.executable, "-m", "sailor_cli.main", "runs", "list", "--json", "--store", store],
                              capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
        assert runs.returncode == 0, runs.stderr[-1500:]
        run_ids = [r["run_id"] for r in json.loads(runs.stdout)]
        assert run_ids, (demo.returncode, demo.stdout[-1500:], demo.stderr[-1500:])
        shown = subprocess.run([sys.executable, "-m", "sailor_cli.main", "runs", "show", run_ids[-1], "--json",
                                "--store", store], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
        assert shown.returncode == 0, shown.stderr[-1500:]
        assert json.loads(shown.stdout)["params"]["store_uri"].startswith("s3://demo/store")
        objects = []
        from pyarrow import fs as pafs

        s3fs = s3.filesystem()
        for info in s3fs.get_file_info(pafs.FileSelector("demo", recursive=True)):
            if info.type == pafs.FileType.File:
                with s3fs.open_input_stream(info.path) as f:
                    data = f.read()
                if SECRET.encode() in data or TOKEN.encode() in data:
                    objects.append(info.path)
    printed = demo.stdout + demo.stderr + runs.stdout + runs.stderr + shown.stdout + shown.stderr
    assert SECRET not in printed and TOKEN not in printed
    assert objects == [], objects
    assert _sentinels_under(tmp_path) == [], "a credential was written to disk"
