"""Hostile pool, plan, trace and scenario files get bounded work (issue 44, items 9, 13, 14 and 20).

The corpus lives in tests/hostile/<kind>/ (alias bombs, NaN, infinities, 1e400, numbers of 40 digits,
absurd gpus_per_vm, duplicate keys, control characters in names, negative times, ...); the files too
large or too binary to keep in the tree (a 50 MB pool of 680,000 zones, a binary file, 200,000-deep
JSON, /dev/zero) are made here. Each goes through the command that reads it, as a user runs it (the
real entry point in a subprocess): `sailor plan --pool`, `sailor simulate`, `sailor replay --trace`,
`sailor demo --scenario`. A file named `ok-*` must be accepted (exit 0); every other file must be
refused with exit 2 and one line (`error: ...; to fix: ...`), no traceback. Either within 10 s: the
subprocess is killed at 10 s and the test fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.paths import PUBLISHED_DATA, REPO

HOSTILE = REPO / "tests" / "hostile"
LIMIT_S = 10.0
STORE = str(PUBLISHED_DATA)  # the published profiles of OPT-350 on A100-40 and V100-16


def _command(kind: str, path: str, tmp: Path) -> list[str]:
    if kind == "pool":
        return ["plan", "--pool", path, "--model", "OPT-350", "--global-batch-size", "64", "--store", STORE]
    if kind == "plan":
        return ["simulate", path, "--model", "OPT-350", "--store", STORE]
    if kind == "trace":
        return ["replay", "--trace", path, "--model", "OPT-350", "--global-batch-size", "64", "--steps", "20",
                "--policy", "sailor", "--store", STORE]
    assert kind == "scenario"
    return ["demo", "--scenario", path, "--workdir", str(tmp / "work"), "--store", str(tmp / "store")]


# --- files made at test time -------------------------------------------------------------------------------------
def _zones(n: int) -> str:
    return json.dumps({"zones": {f"zone-{i:06d}-a": {"gpus": {"A100-40": {"count": 8, "usd_per_gpu_hour": 3.67}}}
                                 for i in range(n)}})


def _plan_with_stages(n: int) -> str:
    rep = {"gpu_type": "A100-40", "gpus_per_node": 4, "zone": "us-central1-a", "tp": 1}
    return json.dumps({"format": "sailor-plan", "version": 1, "model": "OPT-350", "global_batch_size": 64,
                       "stages": [{"layers": [i, i], "replicas": [rep]} for i in range(n)],
                       "pipelines": [{"microbatch_size": 1, "num_microbatches": 64}]})


def _trace_with_points(n: int) -> str:
    return json.dumps({"format": "sailor-trace", "version": 1, "name": "long",
                       "places": [{"zone": "us-central1-a", "gpu_type": "A100-40", "gpus_per_node": 4}],
                       "points": [{"at_s": 60 * i, "counts": [8 + 8 * (i % 2)], "usd_per_gpu_hour": [3.67]}
                                  for i in range(n)]})


GENERATED: dict[str, Callable[[], bytes]] = {
    # 680,000 zones, 50 MB: was still running at 180 s with 1.3 GB
    "pool/zones-680k.json": lambda: _zones(680_000).encode(),
    # within the size limit, over the zone limit
    "pool/zones-5000.json": lambda: _zones(5000).encode(),
    "pool/binary.yaml": lambda: bytes(range(256)) * 64,
    "pool/nul-bytes.yaml": lambda: b"zones:\0\0\0" + b"\0" * 4096,
    "pool/latin1.yaml": lambda: "zones:\n  zurich-\xe9:\n    gpus: {A100-40: 8}\n".encode("latin-1"),
    "pool/deep-200k.json": lambda: b"[" * 200_000 + b"]" * 200_000,
    "pool/deep-200k.yaml": lambda: b"[" * 200_000 + b"]" * 200_000,
    "pool/name-100k-chars.yaml": lambda: f"zones:\n  {'z' * 100_000}:\n    gpus: {{A100-40: 8}}\n".encode(),
    "pool/unknown-keys-20k.json": lambda: json.dumps({"zones": {"us-central1-a": {
        "gpus": {"A100-40": {"count": 8, **{f"key{i}": i for i in range(20_000)}}}}}}).encode(),
    "pool/gpu-types-5000.json": lambda: json.dumps({"zones": {"us-central1-a": {
        "gpus": {f"T{i}": {"count": 8, "gpus_per_vm": 1, "usd_per_gpu_hour": 1.0} for i in range(5000)}}}}).encode(),
    "plan/binary.json": lambda: bytes(range(256)) * 64,
    "plan/deep-200k.json": lambda: b'{"stages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
    "plan/stages-100k.json": lambda: _plan_with_stages(100_000).encode(),
    "trace/binary.json": lambda: bytes(range(256)) * 64,
    "trace/binary.csv": lambda: bytes(range(256)) * 64,
    "trace/deep-200k.json": lambda: b"[" * 200_000 + b"]" * 200_000,
    "trace/points-200k.json": lambda: _trace_with_points(200_000).encode(),
    "scenario/binary.yaml": lambda: bytes(range(256)) * 64,
}
DEVICES = ["pool/dev-zero", "plan/dev-zero", "trace/dev-zero.json", "scenario/dev-zero"]


def _cases() -> list[str]:
    on_disk = sorted(str(p.relative_to(HOSTILE)) for p in HOSTILE.glob("*/*") if p.is_file())
    return on_disk + sorted(GENERATED) + DEVICES


def _path(case: str, tmp: Path) -> str:
    if case in DEVICES:
        return "/dev/zero"
    if case in GENERATED:
        p = tmp / case.replace("/", "-")
        p.write_bytes(GENERATED[case]())
        return str(p)
    return str(HOSTILE / case)


def test_the_corpus_covers_every_kind_of_file_and_accepts_some():
    cases = _cases()
    for kind in ("pool", "plan", "trace", "scenario"):
        assert sum(c.startswith(kind + "/") for c in cases) >= 4, kind
    assert [c for c in cases if Path(c).name.startswith("ok-")], "a corpus that only refuses proves little"


@pytest.mark.parametrize("case", _cases())
def test_hostile_file_is_accepted_or_refused_with_one_line_within_10_s(tmp_path, case):
    kind = case.split("/")[0]
    argv = [sys.executable, "-m", "sailor_cli.main", *_command(kind, _path(case, tmp_path), tmp_path)]
    env = {**os.environ, "TMPDIR": str(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect"),
           "SAILOR_STORE": str(tmp_path / "store"), "COLUMNS": "200"}
    try:
        p = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=LIMIT_S)
    except subprocess.TimeoutExpired as e:
        out = (e.stderr or b"")[-600:] if isinstance(e.stderr, bytes) else (e.stderr or "")[-600:]
        pytest.fail(f"{case}: no answer within {LIMIT_S:g} s: {out!r}")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    if Path(case).name.startswith("ok-"):
        assert p.returncode == 0, (case, p.returncode, p.stderr[-1500:])
        return
    assert p.returncode == 2, (case, p.returncode, p.stderr[-1500:])
    assert "Traceback" not in p.stderr, (case, p.stderr[-1500:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and "to fix" in lines[0], (case, p.stderr[-1500:])
    assert len(lines[0]) < 2000, (case, len(lines[0]), lines[0][:300])  # no unbounded value in the message


def test_a_what_if_that_adds_an_absurd_count_is_refused_by_the_pool_limit():
    from profiles_store.eth_easl import read_eth_easl
    from sailor_core.errors import SailorError
    from sailor_core.planner.pool import MAX_GPUS, apply_what_if, load_pool_file

    book = read_eth_easl(PUBLISHED_DATA).profile_book("OPT-350")
    pool = load_pool_file(HOSTILE / "pool" / "ok-small.yaml", book)
    with pytest.raises(SailorError, match="more than 100,000"):
        apply_what_if(pool, f"+{MAX_GPUS * 10**9} A100-40 in us-central1-a", book)
    assert apply_what_if(pool, "+8 A100-40 in us-central1-a", book).entries[0].gpus == 16
