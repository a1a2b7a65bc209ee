# ruff: noqa: F811  (pytest fixtures imported from tests.store_fixtures are test arguments)
"""`sailor profiles`: list/show/import-eth-easl/export, and bad input ending in one line and exit 2."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from profiles_store import open_store
from sailor_cli.main import main
from tests.paths import PUBLISHED_DATA, REPO
from tests.store_fixtures import BUCKET, s3_server  # noqa: F401 - fixture


def run(capsys, *argv: str) -> tuple[int, str, str]:  # noqa: ANN001
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def sailor(*argv: str) -> subprocess.CompletedProcess[str]:
    """The real console entry point in a subprocess: checks exit codes and that no traceback leaks."""
    return subprocess.run(
        [sys.executable, "-m", "sailor_cli.main", *argv], capture_output=True, text=True, cwd=REPO, timeout=60
    )


def test_list_json_lists_every_seed_pair(capsys, tmp_path):
    rc, out, _ = run(capsys, "profiles", "list", "--store", str(tmp_path / "s"), "--json")
    assert rc == 0
    pairs = json.loads(out)
    assert len(pairs) >= 17
    assert all({"model", "gpu_type", "mbs", "tp", "source"} <= set(p) for p in pairs)
    assert {"OPT-350", "GPT-Neo-2.7", "OPT-30", "LLAMA-3-8"} == {p["model"] for p in pairs}
    assert ("OPT-30", "GH-96") in {(p["model"], p["gpu_type"]) for p in pairs}


def test_list_table_and_show(capsys):
    rc, out, _ = run(capsys, "profiles", "list")  # the default store ($SAILOR_STORE) over the seed
    assert rc == 0 and "17 (model, GPU type) pairs" in out and "OPT-350" in out
    rc, out, _ = run(capsys, "profiles", "show", "OPT-350", "GH-96", "--json", "--layers")
    assert rc == 0
    doc = json.loads(out)
    assert doc["num_layers"] == 26 and doc["host"].endswith("profiles_tmp.json")
    point = next(p for p in doc["points"] if (p["mbs"], p["tp"]) == (1, 4))
    assert point["layers"] == 26 and len(point["per_layer"]) == 26
    assert point["forward_s"] == pytest.approx(0.0394, abs=5e-5)  # the simulator file's value (README 2b)
    rc, out, _ = run(capsys, "profiles", "show", "OPT-350", "A100-40")
    assert rc == 0 and "forward s (sum)" in out


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["profiles", "show", "GPT-5", "A100-40"], "unknown model 'GPT-5'"),
        (["profiles", "show", "OPT-350", "H100"], "unknown GPU type(s) ['H100']"),
        (["profiles", "show", "OPT-350", "cpu"], "no layer profiles for (OPT-350, cpu)"),
        (["profiles", "import-eth-easl", "/nonexistent/dir"], "llm_info.json is missing"),
        (["profiles", "list", "--store", "ftp://host/x"], "unsupported store URI scheme 'ftp'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, expect):
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert err.startswith("error: ") and expect in err and "to fix" in err
    assert err.count("\n") == 1


def test_corrupt_store_fails_without_traceback(tmp_path):
    store = open_store(str(tmp_path / "s"), seed=False)
    bad = store.location.path(
        "layer_profiles", "model=X", "gpu_type=Y", "part-00000000000000000001-abad1dea-replace.parquet"
    )
    store.location.put(bad, b"PAR1 truncated")
    proc = sailor("profiles", "list", "--store", str(tmp_path / "s"))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert "not a readable Parquet file" in proc.stderr and "to fix: delete that file" in proc.stderr


# The published files shipped in tests/data: profiles_tmp.json's 16 (model, GPU type) pairs and their
# 6493 layer profiles (the whole published tree, which the seed holds, adds OPT-30/GH-96: 17 and 7243;
# tests/test_store_backends.py rebuilds the seed from it where it is present).
SHIPPED_PAIRS, SHIPPED_LAYER_PROFILES, SEED_LAYER_PROFILES = 16, 6493, 7243


def test_import_then_export(capsys, tmp_path):
    uri = str(tmp_path / "mine")
    rc, out, _ = run(capsys, "profiles", "import-eth-easl", str(PUBLISHED_DATA), "--store", uri)
    assert rc == 0 and f"{SHIPPED_LAYER_PROFILES} layer_profiles" in out
    own = open_store(uri, seed=False)
    assert len(own.list_pairs()) == SHIPPED_PAIRS
    assert own.read_table("layer_profiles")["recorded_at"][0].as_py().year >= 2026
    rc, _, _ = run(capsys, "profiles", "import-eth-easl", str(PUBLISHED_DATA), "--store", uri)  # idempotent
    assert rc == 0 and open_store(uri, seed=False).read_table("layer_profiles").num_rows == SHIPPED_LAYER_PROFILES
    rc, out, _ = run(capsys, "profiles", "export", "--store", uri, "--out", str(tmp_path / "csv"))
    assert rc == 0
    with open(tmp_path / "csv" / "layer_profiles.csv") as f:
        rows = list(csv.DictReader(f))
    # the export is the store over the seed: the 16 imported pairs in place of the seed's, plus its OPT-30/GH-96
    assert sum(r["recorded_at"] >= "2026" for r in rows) == SHIPPED_LAYER_PROFILES  # imported now, not the seed's
    assert len(rows) == SEED_LAYER_PROFILES
    assert {"model", "gpu_type", "mbs", "tp", "layer", "forward_s", "source", "host"} <= set(rows[0])
    with open(tmp_path / "csv" / "gpu_prices.csv") as f:
        prices = {(r["gpu_type"], float(r["usd_per_gpu_hour"])) for r in csv.DictReader(f)}
    assert prices == {("A100-40", 3.673385), ("V100-16", 2.859998), ("GH-96", 11.06)}


@pytest.mark.s3
def test_cli_on_s3_and_its_errors(s3_server):
    proc = sailor("profiles", "list", "--json", "--store", s3_server.uri(BUCKET, "cli"))
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)) >= 17
    missing = sailor("profiles", "list", "--store", s3_server.uri("no-such-bucket", "x"))
    assert missing.returncode == 2 and "bucket 'no-such-bucket' does not exist" in missing.stderr
    wrong = s3_server.uri(BUCKET, "x").replace("secret_key=sailor-secret", "secret_key=wrong")
    denied = sailor("profiles", "list", "--store", wrong)
    assert denied.returncode == 2 and "access denied" in denied.stderr and "AWS_SECRET_ACCESS_KEY" in denied.stderr
    assert "secret_key=wrong" not in denied.stderr
    for p in (missing, denied):
        assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1
