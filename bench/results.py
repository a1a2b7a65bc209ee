"""`make bench`: runs the scripts under bench/, one after the other, and writes docs/results.md.

A bench that needs what this machine lacks is not run but listed as skipped, with the reason: root
for the local testbed's network namespaces and cgroups (`NEEDS`: bench_device_binding.py,
bench_testbed_links.py, validate_testbed.py; `infra.testbed.testbed_support` says why), a CUDA GPU
(cuda_layer_check.py, gpu_check.py). A bench that runs and opens a line with `skipped:` or `SKIP:`
(and exits 0) is listed as skipped with that line too. docs/results.md gets the date, the machine
(CPU count, model name, load average before and after), and per bench its command, exit status, wall
time and output (stdout in a code block; stderr's tail too when it failed), then the skipped benches
and why. Each bench runs in its own process group, killed when it outlives `--timeout` or on Ctrl-C.
Exit status 1 when a bench failed or timed out (after writing the page), else 0.

    .venv/bin/python bench/results.py [NAME ...] [--out docs/results.md] [--timeout 3600]
    make bench [BENCHES="bench_store validate_testbed"] [RESULTS=/tmp/results.md] [BENCH_TIMEOUT=3600]

NAME: a script under bench/ with or without `.py` (default: every one but this).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
NEEDS = {  # what a bench needs beyond this project's venv; checked before it runs
    "bench_device_binding": "root",
    "bench_testbed_links": "root",
    "validate_testbed": "root",
    "cuda_layer_check": "gpu",
    "gpu_check": "gpu",
}
STDERR_TAIL = 60  # lines of a failed bench's stderr on the page


@dataclass(frozen=True)
class Outcome:
    """What became of one bench: 'ok', 'failed', 'timed out' or 'skipped', and what it printed."""

    name: str
    status: str
    reason: str = ""  # why it was skipped, failed or timed out
    rc: int | None = None
    seconds: float = 0.0
    stdout: str = ""
    stderr: str = ""


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
        return Outcome(name, "timed out", f"still running after {timeout_s:.0f} s", None, took, stdout, stderr)
    if p.returncode == 0 and skipped_line(stdout):
        return Outcome(name, "skipped", skipped_line(stdout), 0, took, stdout, stderr)
    if p.returncode != 0:
        return Outcome(name, "failed", f"exit {p.returncode}", p.returncode, took, stdout, stderr)
    return Outcome(name, "ok", "", 0, took, stdout, stderr)


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


def render(outcomes: Sequence[Outcome], host: dict[str, str], started: str, load_before: str, load_after: str,
           not_asked: Sequence[str] = ()) -> str:
    """docs/results.md: the machine, every bench that ran with its output, then the skipped ones and why,
    and the benches left out of a run of named ones (`not_asked`)."""
    lines = ["# Benchmark results", "",
             f"Written by bench/results.py (`make bench`) on {started}. The figures are this machine's, at its",
             "load at the time: rerun on a quiet machine before comparing them with another run's.", "",
             "## Machine", ""]
    lines += [f"- {k}: {v}" for k, v in host.items()]
    lines += [f"- load average (1, 5, 15 min) before: {load_before}; after: {load_after}", "", "## Benches", ""]
    ran = [o for o in outcomes if o.status != "skipped" or o.rc is not None]
    for o in ran:
        lines += [f"### {o.name}.py", "",
                  f"`.venv/bin/python bench/{o.name}.py`: {o.status}"
                  f"{f' ({o.reason})' if o.reason else ''}, {o.seconds:.0f} s", "", _block(o.stdout)]
        if o.status in ("failed", "timed out") and o.stderr.strip():
            tail = "".join(o.stderr.splitlines(True)[-STDERR_TAIL:])
            lines += [f"stderr (last {STDERR_TAIL} lines):", "", _block(tail)]
    if not ran:
        lines += ["(none ran)", ""]
    skipped = [o for o in outcomes if o.status == "skipped"]
    lines += ["## Skipped", ""]
    lines += [f"- {o.name}.py: {o.reason}" for o in skipped] or ["(none)"]
    failed = [o for o in outcomes if o.status in ("failed", "timed out")]
    if failed:
        lines += ["", "## Failed", ""] + [f"- {o.name}.py: {o.status} ({o.reason})" for o in failed]
    if not_asked:
        lines += ["", "## Not run", "", f"Only the benches named were asked for; not run: {', '.join(not_asked)}."]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Runs the benches, writes the page, prints what was skipped and failed (see the module)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="benches to run (default: all)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds a bench may run (default 3600)")
    a = ap.parse_args(argv)
    names = benches(a.names)
    out = Path(a.out)
    if not os.access(out if out.exists() else out.parent, os.W_OK):  # before an hour of benches, not after
        print(f"cannot write {out}; to fix: pass --out (make bench RESULTS=...) to a writable place", file=sys.stderr)
        return 2
    checks: dict[str, Callable[[], str]] = {"root": root_missing, "gpu": gpu_missing}
    known: dict[str, str] = {}
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    host, load_before = machine(), load_average()
    outcomes = []
    for name in names:
        need = NEEDS.get(name, "")
        if need and need not in known:
            known[need] = skip_reason(name, checks)
        if need and known[need]:
            print(f"== bench/{name}.py: skipped: {known[need]}", flush=True)
            outcomes.append(Outcome(name, "skipped", known[need]))
            continue
        outcomes.append(run_bench(name, a.timeout))
    not_asked = [n for n in benches([]) if n not in names]
    out.write_text(render(outcomes, host, started, load_before, load_average(), not_asked))
    print(f"\nwrote {out}")
    for o in outcomes:
        if o.status != "ok":
            print(f"{o.status}: bench/{o.name}.py: {o.reason}")
    return 1 if any(o.status in ("failed", "timed out") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
