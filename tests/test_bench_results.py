"""`make bench`'s runner (bench/results.py): benches that need root or a GPU this machine lacks are
skipped with the reason, one that says it skipped counts as skipped, a failure or a timeout does not
stop the others, a timed-out bench's whole process group goes, and docs/results.md lists them all."""

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


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_results", REPO / "bench" / "results.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    benches = tmp_path / "bench"
    benches.mkdir()
    scripts = {
        "a_ok": 'print("figure=1.0")',
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
    for fact in ("- cpus: ", "- cpu model: ", "- load average (1, 5, 15 min) before: "):
        assert fact in page
    assert "### a_ok.py" in page and "```text\nfigure=1.0\n```" in page
    assert "### b_needs_root.py" not in page and "- b_needs_root.py: needs root: not root (uid 1000)" in page
    assert "- c_says_skip.py: needs a GPU (none here)" in page
    assert "### d_fails.py" in page and "failed (exit 3)" in page and "Traceback: boom" in page
    assert "e_hangs.py: timed out (still running after 3 s)" in page
    assert "results.py" not in page.split("## Machine")[1]  # the runner does not run itself
    pid = int((tmp_path / "grandchild.pid").read_text())
    for _ in range(50):  # the timed-out bench's whole process group is killed, its children too
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the hung bench's child {pid} outlived its run")
    printed = capsys.readouterr().out
    assert "skipped: bench/b_needs_root.py: needs root" in printed and "failed: bench/d_fails.py: exit 3" in printed


def test_named_benches_only_and_an_unwritable_page_is_refused_before_running(results, tmp_path):
    out = tmp_path / "only.md"
    assert results.main(["a_ok", "b_needs_root.py", "--out", str(out)]) == 0
    page = out.read_text()
    assert "### a_ok.py" in page and "### d_fails" not in page and "- b_needs_root.py: needs root" in page
    assert "not run: c_says_skip, d_fails, e_hangs." in page
    with pytest.raises(SystemExit, match="no bench"):
        results.main(["nope", "--out", str(out)])
    assert results.main(["a_ok", "--out", str(tmp_path / "missing" / "r.md")]) == 2


def test_the_real_bench_list_names_scripts_that_exist():
    spec = importlib.util.spec_from_file_location("bench_results_real", REPO / "bench" / "results.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    every = mod.benches([])
    assert set(mod.NEEDS) <= set(every) and "results" not in every and "validate_testbed" in every
