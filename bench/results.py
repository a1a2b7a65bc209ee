"""`make bench`: runs the scripts under bench/, keeps each one's last run, and writes docs/results.md from them.

Every run of a bench (or its skip) is kept as its record, bench/records/<bench>.json: when it ran, on
what machine (CPU count, model name, OS, Python, user) and at what load (the load average before and
after it), its exit status, wall time and output. docs/results.md is generated from the records of
every bench under bench/, and from nothing else: what each bench measures (the first paragraph of its
docstring), then its last figures with the machine and load they were measured at. Running one bench
(`bench/results.py bench_store`) replaces its record and rewrites the page; `--render` rewrites the
page from the records alone. tests/test_bench_results.py checks that the page is the records' render.

A bench that needs what this machine lacks is not run but recorded as skipped, with the reason: root
for the local testbed's network namespaces and cgroups (`NEEDS`: bench_device_binding.py,
bench_semisync.py, bench_testbed_links.py, validate_testbed.py; `infra.testbed.testbed_support` says
why), a CUDA GPU (cuda_layer_check.py, gpu_check.py); a skip never replaces the record of an earlier run. A bench that
runs and opens a line with `skipped:` or `SKIP:` (and exits 0) is recorded as skipped with that line.
Each bench runs in its own process group, killed when it outlives `--timeout` or on Ctrl-C. Exit
status 1 when a bench failed or timed out (after writing the page), else 0.

    .venv/bin/python bench/results.py [NAME ...] [--out docs/results.md] [--timeout 3600] [--render]
    make bench [BENCHES="bench_store validate_testbed"] [RESULTS=/tmp/results.md] [BENCH_TIMEOUT=3600]

NAME: a script under bench/ with or without `.py` (default: every one but this).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
NEEDS = {  # what a bench needs beyond this project's venv; checked before it runs
    "bench_device_binding": "root",
    "bench_semisync": "root",
    "bench_testbed_links": "root",
    "validate_testbed": "root",
    "cuda_layer_check": "gpu",
    "gpu_check": "gpu",
}
STDERR_TAIL = 60  # lines of a failed bench's stderr on the page


@dataclass(frozen=True)
class Outcome:
    """What became of one bench: 'ok', 'failed', 'timed out' or 'skipped', and what it printed; when it
    ran (`started`, UTC), on what machine (`host`) and at what load (`load_before`, `load_after`)."""

    name: str
    status: str
    reason: str = ""  # why it was skipped, failed or timed out
    rc: int | None = None
    seconds: float = 0.0
    stdout: str = ""
    stderr: str = ""
    started: str = ""
    host: dict[str, str] = field(default_factory=dict)
    load_before: str = ""
    load_after: str = ""


def records_dir() -> Path:
    return BENCH / "records"


def load_records() -> dict[str, Outcome]:
    """Each bench's last recorded run, by name."""
    out = {}
    for f in sorted(records_dir().glob("*.json")):
        d = json.loads(f.read_text())
        out[d["name"]] = Outcome(**d)
    return out


def save_record(o: Outcome) -> None:
    """Keep `o` as its bench's last run; a skip does not replace a run that measured something."""
    path = records_dir() / f"{o.name}.json"
    if o.status == "skipped" and o.rc is None and path.exists():
        if json.loads(path.read_text()).get("status") != "skipped":
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    tail = "".join(o.stderr.splitlines(True)[-STDERR_TAIL:]) if o.status in ("failed", "timed out") else ""
    path.write_text(json.dumps({**asdict(o), "stderr": tail}, indent=1, sort_keys=True) + "\n")


def measures(name: str) -> str:
    """What a bench measures: the first paragraph of its docstring, on one line."""
    try:
        doc = ast.get_docstring(ast.parse((BENCH / f"{name}.py").read_text())) or ""
    except (OSError, SyntaxError):
        doc = ""
    return " ".join(doc.split("\n\n")[0].split()) or "(no docstring)"


def root_missing() -> str:
    """'' when this process can build the testbed, else why not."""
    sys.path.insert(0, str(ROOT))
    from infra.testbed import testbed_support

    ok, why = testbed_support()
    return "" if ok else f"needs root: {why}"


def gpu_missing() -> str:
    """'' when torch sees a CUDA device, else why not (asked in a child process: no torch import here)."""
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return f"needs a CUDA GPU (torch did not answer: {r.stderr.strip()[-200:]})"
    return "" if r.stdout.strip() == "True" else "needs a CUDA GPU (torch.cuda.is_available() is False)"


def benches(names: Sequence[str]) -> list[str]:
    """The benches to run: `names` (checked), else every script under bench/ but this one, in name order."""
    every = sorted(p.stem for p in BENCH.glob("*.py") if p.name != Path(__file__).name)
    if not names:
        return every
    chosen = [n.removesuffix(".py").removeprefix("bench/") for n in names]
    unknown = [n for n in chosen if n not in every]
    if unknown:
        raise SystemExit(f"no bench {unknown} under bench/; to fix: one of {every}")
    return chosen


def skip_reason(name: str, checks: dict[str, Callable[[], str]]) -> str:
    """Why `name` cannot run here ('' if it can): the check of what it NEEDS."""
    need = NEEDS.get(name)
    return checks[need]() if need else ""


def skipped_line(stdout: str) -> str:
    """The reason a bench that ran gave for skipping: its first line opening with `skipped:` or `SKIP:`."""
    for line in stdout.splitlines():
        s = line.strip()
        if s.lower().startswith("skipped:") or s.startswith("SKIP:"):
            return s.split(":", 1)[1].strip()
    return ""


def _tee(src: IO[str], dst: IO[str], into: list[str]) -> None:
    for line in src:
        into.append(line)
        dst.write(line)
        dst.flush()


def run_bench(name: str, timeout_s: float) -> Outcome:
    """Runs the bench `name` (a script under bench/) with this Python in its own process group, its
    output shown as it comes and kept; the group is killed when it outlives `timeout_s` or on Ctrl-C."""
    print(f"== bench/{name}.py", flush=True)
    started, host, load_before = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), machine(), load_average()
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, str(BENCH / f"{name}.py")], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    out: list[str] = []
    err: list[str] = []
    assert p.stdout is not None and p.stderr is not None
    readers = [threading.Thread(target=_tee, args=(p.stdout, sys.stdout, out), daemon=True),
               threading.Thread(target=_tee, args=(p.stderr, sys.stderr, err), daemon=True)]
    for t in readers:
        t.start()
    timed_out = False
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(p)
    except BaseException:
        _kill_group(p)
        raise
    for t in readers:
        t.join(10)
    took = time.monotonic() - t0
    stdout, stderr = "".join(out), "".join(err)
    if timed_out:
        status, reason, rc = "timed out", f"still running after {timeout_s:.0f} s", None
    elif p.returncode == 0 and skipped_line(stdout):
        status, reason, rc = "skipped", skipped_line(stdout), 0
    elif p.returncode != 0:
        status, reason, rc = "failed", f"exit {p.returncode}", p.returncode
    else:
        status, reason, rc = "ok", "", 0
    return Outcome(name, status, reason, rc, took, stdout, stderr, started=started, host=host,
                   load_before=load_before, load_after=load_average())


def _kill_group(p: subprocess.Popen[str]) -> None:
    """SIGTERM to the bench's process group, SIGKILL 15 s later if it is still there (its finally blocks
    tear down what it built on SIGTERM)."""
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def machine() -> dict[str, str]:
    """This machine as the page names it: CPUs, their model, OS, Python, user, load average now."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": str(os.cpu_count()), "cpu model": model or platform.processor() or "unknown",
            "os": platform.platform(), "python": platform.python_version(),
            "user": "root" if os.geteuid() == 0 else f"uid {os.geteuid()} (not root)"}


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _block(text: str) -> str:
    """`text` in a fenced code block (a longer fence when the text holds one)."""
    fence = "````" if "```" in text else "```"
    return f"{fence}text\n{text.rstrip()}\n{fence}\n" if text.strip() else "(no output)\n"


def _when(o: Outcome) -> str:
    load = (f"load average {o.load_before} before, {o.load_after} after (1, 5, 15 min; the 1-min alone where one)"
            if o.load_before else "load average not recorded")
    h = o.host
    where = (f"{h.get('cpus', '?')} CPUs ({h.get('cpu model', 'unknown')}), {h.get('os', 'unknown OS')}, "
             f"Python {h.get('python', '?')}, as {h.get('user', '?')}") if h else "machine not recorded"
    return f"{o.started or 'date not recorded'} on {where}; {load}"


def render(records: dict[str, Outcome], names: Sequence[str]) -> str:
    """docs/results.md from the records of the benches `names` (see the module's contract)."""
    lines = ["# Benchmark results", "",
             "Generated by bench/results.py from each bench's last recorded run (bench/records/); nothing here is",
             "written by hand. Figures hold for the machine and load they were measured at.", "",
             "| bench | last run | status |", "| --- | --- | --- |"]
    for n in names:
        o = records.get(n)
        lines.append(f"| {n}.py | {o.started if o else 'never'} | "
                     f"{(o.status + (f' ({o.reason})' if o.reason else '')) if o else 'not run yet'} |")
    for n in names:
        o = records.get(n)
        lines += ["", f"## {n}.py", "", f"What it measures: {measures(n)}", ""]
        if o is None:
            lines += ["Not run yet: `.venv/bin/python bench/results.py " + n + "` runs it and records it here."]
            continue
        lines += [f"`.venv/bin/python bench/{n}.py`: {o.status}{f' ({o.reason})' if o.reason else ''}, "
                  f"{o.seconds:.0f} s, {_when(o)}.", ""]
        lines.append(_block(o.stdout).rstrip())
        if o.stderr.strip():
            lines += ["", f"stderr (last {STDERR_TAIL} lines):", "", _block(o.stderr).rstrip()]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Runs the benches, keeps their records, writes the page, prints what was skipped and failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="benches to run (default: all)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds a bench may run (default 3600)")
    ap.add_argument("--render", action="store_true", help="only rewrite the page from the records")
    a = ap.parse_args(argv)
    names = [] if a.render else benches(a.names)
    out = Path(a.out)
    if not os.access(out if out.exists() else out.parent, os.W_OK):  # before an hour of benches, not after
        print(f"cannot write {out}; to fix: pass --out (make bench RESULTS=...) to a writable place", file=sys.stderr)
        return 2
    outcomes = run_all(names, a.timeout)
    out.write_text(render(load_records(), benches([])))
    print(f"\nwrote {out}")
    for o in outcomes:
        if o.status != "ok":
            print(f"{o.status}: bench/{o.name}.py: {o.reason}")
    return 1 if any(o.status in ("failed", "timed out") for o in outcomes) else 0


def run_all(names: Sequence[str], timeout_s: float) -> list[Outcome]:
    """Runs (or skips, with the reason) each bench of `names` in turn, keeping each one's record."""
    checks: dict[str, Callable[[], str]] = {"root": root_missing, "gpu": gpu_missing}
    known: dict[str, str] = {}
    outcomes = []
    for name in names:
        need = NEEDS.get(name, "")
        if need and need not in known:
            known[need] = skip_reason(name, checks)
        if need and known[need]:
            print(f"== bench/{name}.py: skipped: {known[need]}", flush=True)
            o = Outcome(name, "skipped", known[need], started=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                        host=machine(), load_before=load_average(), load_after=load_average())
        else:
            o = run_bench(name, timeout_s)
        save_record(o)
        outcomes.append(o)
    return outcomes


if __name__ == "__main__":
    sys.exit(main())
