"""`make bench`'s runner (bench/results.py): benches that need root or a GPU this machine lacks are
skipped with the reason, one that says it skipped counts as skipped, a failure or a timeout does not
stop the others, a timed-out bench's whole process group goes, each run is kept as the bench's record,
and docs/results.md is generated from the records alone: the page in the tree is their render."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.paths import REPO
from tests.waits import wait_for


def _runner(name: str) -> ModuleType:
    """bench/results.py loaded as module `name` (its dataclasses look their module up in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / "results.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    mod = _runner("bench_results")
    benches = tmp_path / "bench"
    benches.mkdir()
    scripts = {
        "a_ok": '"""Measures one figure."""\nprint("figure=1.0")',
        "b_needs_root": 'raise SystemExit("must not run")',
        "c_says_skip": 'print("skipped: needs a GPU (none here)")',
        "d_fails": 'import sys; print("half"); print("Traceback: boom", file=sys.stderr); sys.exit(3)',
        "e_hangs": textwrap.dedent(f"""
            import subprocess, sys
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            open({str(tmp_path / "grandchild.pid")!r}, "w").write(str(child.pid))
            child.wait()
        """),
        "results": 'raise SystemExit("the runner is not a bench")',
    }
    for name, src in scripts.items():
        (benches / f"{name}.py").write_text(src)
    monkeypatch.setattr(mod, "BENCH", benches)
    monkeypatch.setattr(mod, "NEEDS", {"b_needs_root": "root", "c_says_skip": "gpu"})
    monkeypatch.setattr(mod, "root_missing", lambda: "needs root: not root (uid 1000)")
    monkeypatch.setattr(mod, "gpu_missing", lambda: "")  # as if there were one: the bench itself says it skips
    return mod


def test_every_bench_runs_or_is_skipped_with_its_reason_and_the_page_lists_them(results, tmp_path, capsys):
    out = tmp_path / "results.md"
    t0 = time.monotonic()
    assert results.main(["--out", str(out), "--timeout", "3"]) == 1  # d failed and e timed out
    assert time.monotonic() - t0 < 60
    page = out.read_text()
    assert page.startswith("# Benchmark results")
    a_ok = page.split("## a_ok.py")[1].split("\n## ")[0]
    assert "What it measures: Measures one figure." in a_ok and "```text\nfigure=1.0\n```" in a_ok
    for fact in (" CPUs (", "load average ", " UTC on "):  # the machine and load it ran at
        assert fact in a_ok
    assert "skipped (needs root: not root (uid 1000))" in page.split("## b_needs_root.py")[1]
    assert "skipped (needs a GPU (none here))" in page.split("## c_says_skip.py")[1]
    d_fails = page.split("## d_fails.py")[1]
    assert "failed (exit 3)" in d_fails and "Traceback: boom" in d_fails
    assert "timed out (still running after 3 s)" in page.split("## e_hangs.py")[1]
    assert "## results.py" not in page  # the runner does not run itself
    assert page == results.render(results.load_records(), results.benches([]))  # the records, nothing else
    pid = int((tmp_path / "grandchild.pid").read_text())
    # the timed-out bench's whole process group is killed, its children too
    wait_for(lambda: not _alive(pid), 5, f"the hung bench's child {pid} to end with its run")
    printed = capsys.readouterr().out
    assert "skipped: bench/b_needs_root.py: needs root" in printed and "failed: bench/d_fails.py: exit 3" in printed


def test_named_benches_only_and_an_unwritable_page_is_refused_before_running(results, tmp_path):
    out = tmp_path / "only.md"
    assert results.main(["a_ok", "b_needs_root.py", "--out", str(out)]) == 0
    page = out.read_text()
    assert "figure=1.0" in page.split("## a_ok.py")[1] and "skipped (needs root" in page.split("## b_needs_root")[1]
    for never in ("c_says_skip", "d_fails", "e_hangs"):  # not asked for, and never run before
        assert "Not run yet" in page.split(f"## {never}.py")[1].split("\n## ")[0]
    with pytest.raises(SystemExit, match="no bench"):
        results.main(["nope", "--out", str(out)])
    assert results.main(["a_ok", "--out", str(tmp_path / "missing" / "r.md")]) == 2


def test_one_bench_rerun_replaces_its_record_and_a_skip_keeps_an_earlier_run(results, tmp_path):
    out = tmp_path / "results.md"
    results.main(["a_ok", "d_fails", "--out", str(out)])
    first = results.load_records()
    assert set(first) == {"a_ok", "d_fails"}
    (results.BENCH / "a_ok.py").write_text('print("figure=2.0")')
    assert results.main(["a_ok", "--out", str(out)]) == 0
    again = results.load_records()
    assert "figure=2.0" in again["a_ok"].stdout and again["d_fails"] == first["d_fails"]
    assert "figure=2.0" in out.read_text() and "Traceback: boom" in out.read_text()  # the page keeps d_fails
    # a bench that ran once and cannot run now keeps its figures, not the skip
    (results.records_dir() / "b_needs_root.json").write_text(results.json.dumps(
        {**results.asdict(again["a_ok"]), "name": "b_needs_root"}))
    results.main(["b_needs_root", "--out", str(out)])
    assert results.load_records()["b_needs_root"].status == "ok"


def test_the_page_in_the_tree_is_the_render_of_the_records():
    mod = _runner("bench_results_page")
    page = (REPO / "docs" / "results.md").read_text()
    assert page == mod.render(mod.load_records(), mod.benches([])), (
        "docs/results.md is not what bench/results.py renders from bench/records/; to fix: "
        "`.venv/bin/python bench/results.py --render` (never edit the page by hand)")


def test_the_real_bench_list_names_scripts_that_exist():
    mod = _runner("bench_results_real")
    every = mod.benches([])
    assert set(mod.NEEDS) <= set(every) and "results" not in every and "validate_testbed" in every


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
