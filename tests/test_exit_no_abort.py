"""No exit path aborts (issue 25 item 5): a command that printed its one-line error exits 2, never 134
with "terminate called without an active exception".

The abort came after the answer: the store reads Parquet from `pa.BufferReader(bytes)`, pyarrow's scanner
drops its last reference to those bytes on a pool thread after `read_table` returned, and when that
happened once the interpreter was finalising, the thread's GIL request ended it inside a noexcept C++
destructor (std::terminate). Under load it hit about 1 run in 20. The CLI now leaves through
`sailor_cli.main._leave` (threads joined, atexit callbacks run, output flushed, no finalisation).
These tests run the real entry point in subprocesses, several at once so the two cores are busy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.paths import REPO

ROUNDS = 4  # each error path this many times, 3 processes at a time (about 10 s on two cores)


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "SAILOR_STORE": str(tmp / "default-store"), "PREFECT_HOME": str(tmp / "prefect")}


def _corrupt_stores(tmp: Path) -> tuple[Path, Path]:
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    runs = open_store(str(tmp / "runs"), seed=False)
    history = RunHistory(runs)
    history.run_status("r1", "running", "start", {"name": "a"})
    history.run_status("r2", "completed", "done", {"name": "b"})
    part = next((tmp / "runs" / "runs" / "run_id=r2").glob("*.parquet"))
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])  # r1 reads, then r2 fails
    profiles = open_store(str(tmp / "profiles"), seed=False)
    profiles.location.put(profiles.location.path(
        "layer_profiles", "model=OPT-350", "gpu_type=A100-40", "part-00000000000000000001-abad1dea-replace.parquet"),
        b"PAR1 truncated")
    return tmp / "runs", tmp / "profiles"


def test_error_paths_exit_2_with_one_line_and_never_abort(tmp_path: Path) -> None:
    runs, profiles = _corrupt_stores(tmp_path)
    (tmp_path / "pool.json").write_text(json.dumps({"zones": {"us-central1-a": {"gpus": {"A100-40": {
        "count": 8, "gpus_per_node": 4, "usd_per_gpu_hour": 3.67}}}}}))
    commands = {
        "runs list, corrupt store": ["runs", "list", "--store", str(runs)],
        "plan, corrupt store": ["plan", "--pool", str(tmp_path / "pool.json"), "--model", "OPT-350",
                                "--global-batch-size", "64", "--store", str(profiles)],
        "replay, no trace": ["replay", "--trace", str(tmp_path / "none"), "--model", "OPT-350",
                             "--global-batch-size", "1024", "--steps", "10"],
    }

    def once(name: str) -> tuple[str, int, str]:
        p = subprocess.run([sys.executable, "-m", "sailor_cli.main", *commands[name]], capture_output=True,
                           text=True, cwd=REPO, env=_env(tmp_path), timeout=120)
        return name, p.returncode, p.stderr

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(once, [n for _ in range(ROUNDS) for n in commands]))
    bad = [(name, rc, err[-300:]) for name, rc, err in results
           if rc != 2 or "terminate called" in err or len(err.strip().splitlines()) != 1 or "to fix" not in err]
    assert not bad, bad


def test_the_exit_still_joins_threads_runs_atexit_and_flushes(tmp_path: Path) -> None:
    """What a normal exit cleans up is cleaned up: a non-daemon thread finishes, atexit callbacks run (Prefect's,
    logging's, weakref.finalize: an open TemporaryDirectory is removed), buffered output reaches the pipe."""
    script = textwrap.dedent(f"""
        import atexit, sys, tempfile, threading, time
        keep = tempfile.TemporaryDirectory(dir={str(tmp_path)!r})
        print(keep.name)
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
        atexit.register(lambda: print("atexit ran"))
        sys.argv = ["sailor", "runs", "list", "--json", "--store", {str(tmp_path / "empty")!r}]
        from sailor_cli.main import main
        main()
        print("main returned")  # never: main leaves the process
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                       env=_env(tmp_path), timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "[]" in lines and "thread done" in lines and lines[-1] == "atexit ran", p.stdout
    assert "main returned" not in lines
    assert not Path(lines[0]).exists()  # the TemporaryDirectory's finalizer ran at exit


def test_an_unexpected_error_still_shows_its_traceback_and_exits_1(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import sys
        import sailor_cli.main as m
        def boom(argv):
            raise RuntimeError("a bug")
        m._main = boom
        m.main()
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                       env=_env(tmp_path), timeout=60)
    assert p.returncode == 1 and "Traceback" in p.stderr and "RuntimeError: a bug" in p.stderr
