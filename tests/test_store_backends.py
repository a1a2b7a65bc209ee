# ruff: noqa: F811  (pytest fixtures imported from tests.store_fixtures are test arguments)
"""Backend set-up and reachability errors, the shipped seed, and the schema documentation.

The contract suite (test_store_contract.py) checks behaviour on every backend; this module checks
what differs by URI: unreachable endpoints, missing buckets and credentials, bad URIs, and that
the seed is reproducible from the published data.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from profiles_store import StoreError, open_store
from profiles_store.backend import resolve
from profiles_store.build_seed import build_seed
from profiles_store.local_servers import free_port
from profiles_store.schemas import HISTORY_TABLES, META_VERSION, SCHEMA_VERSION, TABLES
from profiles_store.store import MARKER, SEED_DIR
from profiles_store.tables import MODELS
from tests.paths import REFERENCE_DATA, REPO
from tests.store_fixtures import BUCKET, gcs_server, s3_server  # noqa: F401 - fixtures


def test_uri_resolution():
    loc = resolve("s3://bkt/some/prefix?endpoint_override=http://127.0.0.1:9&region=eu-west-1", {})
    assert (loc.scheme, loc.bucket, loc.root, loc.endpoint) == ("s3", "bkt", "bkt/some/prefix", "http://127.0.0.1:9")
    assert resolve("gs://b?endpoint_override=127.0.0.1:9&anonymous=true", {}).root == "b"
    local = resolve("file:///tmp/x/", {})
    assert (local.scheme, local.root) == ("file", "/tmp/x")
    assert resolve(None, os.environ).root.endswith("store")  # $SAILOR_STORE (tests/conftest.py)
    assert resolve(None, {"SAILOR_STORE": "/elsewhere/s"}).root == "/elsewhere/s"
    with pytest.raises(StoreError, match="names no bucket"):
        resolve("s3:///x", {})
    with pytest.raises(StoreError, match="unsupported store URI scheme 'hdfs'"):
        resolve("hdfs://nn/x", {})


def test_uris_read_the_environment_they_are_handed_and_never_write_it():
    from sailor_core.uris import S3_COMPAT_ENV, filesystem_for, s3_compat_settings

    before = dict(os.environ)
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_REGION": "eu-west-1", "SAILOR_GCS_ENDPOINT": "127.0.0.1:8"}
    assert resolve("s3://bkt/x", env).endpoint == "http://127.0.0.1:9"
    assert resolve("s3://bkt/x", {}).endpoint == ""  # the process's environment is not consulted behind the caller
    assert resolve("gs://b/x", env).endpoint == "127.0.0.1:8"
    filesystem_for("s3://bkt/x?endpoint_override=127.0.0.1:9&access_key=a&secret_key=b&scheme=http")
    assert dict(os.environ) == before
    # The SDK's S3-compatible settings are returned for the entry point to apply, less what env has.
    assert s3_compat_settings(["s3://bkt/x?endpoint_override=127.0.0.1:9"], {}) == S3_COMPAT_ENV
    assert s3_compat_settings(["s3://bkt/x"], env) == S3_COMPAT_ENV  # the endpoint from env
    assert s3_compat_settings(["s3://bkt/x", "/local", "gs://b/x?endpoint_override=h:1"], {}) == {}
    assert s3_compat_settings(["s3://b/x?endpoint_override=h:1"], S3_COMPAT_ENV) == {}


def test_aws_endpoint_url_environment_is_honoured(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    store = open_store(f"s3://{BUCKET}/env-endpoint")
    assert store.location.endpoint == s3_server.endpoint
    assert len(store.list_pairs()) >= 17


def test_local_store_path_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreError, match="is a file, not a folder"):
        open_store(str(tmp_path / "f"))


def test_opening_writes_nothing(tmp_path):
    store = open_store(str(tmp_path / "s"))
    store.list_pairs()
    store.profile_book("OPT-350")
    assert not (tmp_path / "s").exists()


@pytest.mark.s3
def test_s3_unreachable_endpoint_fails_fast():
    # (how fast is not asserted here: a hang is caught by the suite's timeout)
    with pytest.raises(StoreError) as e:
        open_store(f"s3://{BUCKET}/x?endpoint_override=http://127.0.0.1:{free_port()}&access_key=a&secret_key=b")
    msg = str(e.value)
    assert "unreachable" in msg and "endpoint_override" in msg and "\n" not in msg and "secret_key=b" not in msg


@pytest.mark.s3
def test_s3_missing_bucket_and_bad_credentials(s3_server):
    with pytest.raises(StoreError, match=r"bucket 'not-there' does not exist.*to fix: create it"):
        open_store(s3_server.uri("not-there", "x"))
    with pytest.raises(StoreError, match=r"access denied.*AWS_ACCESS_KEY_ID"):
        open_store(s3_server.uri(BUCKET, "x").replace("secret_key=sailor-secret", "secret_key=nope"))
    anonymous = f"s3://{BUCKET}/x?endpoint_override={s3_server.endpoint}&anonymous=true"
    with pytest.raises(StoreError, match="access denied"):
        open_store(anonymous).list_pairs()


@pytest.mark.gcp
def test_gcs_missing_bucket_and_unreachable_endpoint(gcs_server):
    with pytest.raises(StoreError, match=r"bucket 'not-there' does not exist"):
        open_store(gcs_server.uri("not-there", "x"))
    with pytest.raises(StoreError, match="unreachable"):
        open_store(f"gs://{BUCKET}/x?endpoint_override=http://127.0.0.1:{free_port()}&anonymous=true&retry_seconds=1")


# -- the seed ---------------------------------------------------------------------------------


def test_seed_is_small_licensed_and_current():
    files = [p for p in SEED_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 3 * 2**20
    assert (SEED_DIR / "LICENSE-eth-easl-sailor").read_text().startswith("MIT License")
    notice = (SEED_DIR / "NOTICE.md").read_text()
    assert "cf2c8e3cc53ce178fe58a4003f46b4b6b848fc33" in notice and "profiles_tmp.json" in notice
    for p in files:
        if p.suffix == ".parquet":
            assert pq.read_schema(p).metadata[META_VERSION] == str(SCHEMA_VERSION).encode(), p
    assert (SEED_DIR / MARKER).exists()


@pytest.mark.skipif(not REFERENCE_DATA.exists(), reason="../shared/reference_data is not here")
def test_seed_rebuilds_byte_for_byte(tmp_path):
    counts = build_seed(REFERENCE_DATA, tmp_path / "seed")
    assert counts["layer_profiles"] == 7243 and counts["network_links"] >= 1016
    built = {p.relative_to(tmp_path / "seed"): p.read_bytes() for p in (tmp_path / "seed").rglob("*") if p.is_file()}
    shipped = {
        p.relative_to(SEED_DIR): p.read_bytes()
        for p in SEED_DIR.rglob("*")
        if p.is_file() and p.name not in ("LICENSE-eth-easl-sailor", "NOTICE.md")
    }
    assert built == shipped, "the seed is stale: run python -m profiles_store.build_seed ../shared/reference_data"


def test_docs_describe_every_table_and_column():
    doc = (REPO / "docs" / "store.md").read_text()
    for name, spec in TABLES.items():
        if name in HISTORY_TABLES:
            assert f"`{name}`" in doc, name
            continue
        section = re.search(rf"### `{name}`(.*?)(?=\n### |\Z)", doc, re.S)
        assert section, f"docs/store.md has no section for {name}"
        for col in spec.columns:
            assert f"`{col}`" in section.group(1) or col in ("source", "host", "recorded_at", "settings"), (name, col)
    assert f"version {SCHEMA_VERSION}" in doc


def test_seed_folder_is_package_data():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'profiles_store = ["seed/**/*", "seed/*"]' in pyproject
    assert Path(SEED_DIR).is_relative_to(REPO / "profiles_store")


def test_a_nullable_column_added_later_reads_as_not_known_in_older_files(tmp_path):
    from sailor_core.models.config import get_config, model_spec

    store = open_store(str(tmp_path / "s"), seed=False)
    spec = model_spec(get_config("opt-tiny"))
    store.write(MODELS, [spec])
    assert store.model("opt-tiny").tied_head and not model_spec(get_config("gpt-tiny")).tied_head
    # a file written before `tied_head` existed: the same rows without it
    (f,) = list((tmp_path / "s" / "model_layers").rglob("*.parquet"))
    t = pq.read_table(f)
    pq.write_table(t.drop(["tied_head"]).replace_schema_metadata(t.schema.metadata), f)
    old = open_store(str(tmp_path / "s"), seed=False).model("opt-tiny")
    assert old.tied_head is False and old.layers == spec.layers


@pytest.mark.parametrize("server", ["LocalS3Server", "LocalGcsServer"])
def test_a_killed_test_run_leaves_no_object_store_server(server, tmp_path):
    """The servers run in sessions of their own; a test process killed by SIGTERM (a CI timeout) or SIGKILL
    runs no fixture finalizer, so the kernel's parent-death signal must end them."""
    import signal
    import subprocess
    import sys

    from sailor_cli.lifeline import descendants
    from tests.waits import wait_for

    code = (f"from profiles_store.local_servers import {server}; import sys, time; s = {server}(); s.start(); "
            f"print(s.proc.pid, flush=True); time.sleep(120)")
    # A killed process removes nothing: its server's log goes to this test's folder, not the shared /tmp.
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        assert p.stdout is not None
        pid = int(p.stdout.readline())
        assert pid in descendants(p.pid)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z",
             30, f"the {server} process to end")
