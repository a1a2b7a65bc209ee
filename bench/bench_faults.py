"""Fault-injection bench: a matrix of faults x phases against real runs, one row per case.

Every case starts a real command in a subprocess (`sailor train` on a plan with 2 stages and a TP
group, or one stage over 2 replicas; the `sailor` flow for flow cases), injects one fault at one
phase of the run, and classifies how the run ended:

- healed: exit 0, every step trained, the job went on from where it was (steps repeated after a
  recovery are the `steps lost`: the last step reached before the fault minus the step resumed from);
- failed_cleanly: the truthful exit status (1 a failure, with exactly one `error: ` line; 130 / 143
  when stopped by SIGINT / SIGTERM) and no traceback;
- hung: the command did not end within its bound (the collective `--timeout` plus 60 s after the
  fault, longer where the case waits on storage retries): it is killed and counted;
- wrong_exit: an exit status other than the case's expected one (0 healed, 1 failure, 2 bad input,
  130 SIGINT, 143 SIGTERM);
- leaked: a process of the case (any descendant seen while it ran), a mount under its folder, a
  namespace / veth / cgroup of the testbed, or a `sailor*` temporary folder in its private TMPDIR was
  left after it ended (everything found is then removed by the bench);
- unclean: the exit status was right but the evidence was not (a traceback, no or several `error: `
  lines, steps missing, steps lost beyond the checkpoint interval).

Each case runs in its own folder under a private temporary root, with its own TMPDIR and store.
Steps lost of a run that ended (failed or stopped) are what a `--resume` would repeat: the last step
reached minus the newest valid checkpoint's. The last line is
`cases=N healed=H failed_cleanly=F hung=0 wrong_exit=0 leaked=0 max_steps_lost=K` (skipped cases
are listed with their reason and not counted).

    python bench/bench_faults.py [--quick] [--only SUBSTRING] [--list]

Without root the cases that need it (a small tmpfs, the testbed's namespaces) are skipped and said so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sailor_cli.lifeline import _same, descendants, reap  # noqa: E402

NUM_LAYERS = 6  # gpt-tiny's blocks
HANG_GRACE_S = 60.0  # past the collective timeout (and the case's own waits) a run counts as hung
LEFTOVER_WAIT_S = 10.0  # the guardian's SIGTERM grace is 5 s: a process may take that long to go
TIMEOUT_S = 10.0  # `sailor train --timeout` of every case: a silent peer counts as lost after it
EVERY = 4  # checkpoint interval of the cases
STEPS = 16  # steps of a case that heals
LONG = 2000  # steps of a case that is stopped before it finishes
# The deadlines (a case's bound, its waits for training to start) are for an idle machine and scale with
# how slow it runs now: by the job's measured step time against NOMINAL_STEP_S once it trains, before that by
# the load average per core; at most MAX_PACE times. Beside two CPU hogs a step took about 3x as long.
NOMINAL_STEP_S = 0.08  # gpt-tiny's step on 2-3 workers of an idle 2-core machine
MAX_PACE = 5.0


def load_pace() -> float:
    """How much slower than idle this machine runs now, by its load average per core (1: idle)."""
    return min(MAX_PACE, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def step_pace(times: list[float]) -> float:
    """How much slower than NOMINAL_STEP_S the job's recent steps ran (the load's pace before it trained)."""
    if len(times) < 3:
        return load_pace()
    return min(MAX_PACE, max(1.0, statistics.median(times[-20:]) / NOMINAL_STEP_S))

_REPLICA = {"gpu_type": "cpu", "zone": "local", "region": "local", "market": "on-demand"}
# 2 VMs' worth of workers: stage 0 a TP group of 2, stage 1 one worker (3 workers, 2 stages, tp 2)
PLAN_2STAGES_TP = {
    "format": "sailor-plan", "version": 1, "model": "gpt-tiny", "global_batch_size": 8, "schedule": "1f1b",
    "precision": "fp32", "zero1": False,
    "stages": [{"layers": [0, 2], "replicas": [{**_REPLICA, "gpus_per_node": 2, "tp": 2}]},
               {"layers": [3, 5], "replicas": [{**_REPLICA, "gpus_per_node": 1, "tp": 1}]}],
    "pipelines": [{"microbatch_size": 2, "num_microbatches": 4}],
}
# one stage over 2 replicas (data parallel)
PLAN_2REPLICAS = {
    **PLAN_2STAGES_TP,
    "stages": [{"layers": [0, 5], "replicas": [{**_REPLICA, "gpus_per_node": 1, "tp": 1}] * 2}],
    "pipelines": [{"microbatch_size": 4, "num_microbatches": 1}] * 2,
}
PLANS = {"2stages-tp2": PLAN_2STAGES_TP, "2replicas": PLAN_2REPLICAS}
EXPECTED = {"healed": {0}, "failed": {1}, "bad_input": {2}, "SIGINT": {130}, "SIGTERM": {143}}


# -- one run under observation ---------------------------------------------------------------------
@dataclass
class Observed:
    """What a case saw: exit status (None: hung), seconds from the fault to heal or fail, steps lost."""

    rc: int | None
    seconds: float
    steps_lost: int | None
    leftovers: list[str]
    stderr: str
    steps_done: list[int] = field(default_factory=list)
    total_steps: int | None = None
    note: str = ""
    missed: str = ""  # why the fault never met what the case tests (its phase, its store): the case proves nothing


class Job:
    """A `sailor` command in its own session, with its output in files, watched every `poll()`."""

    def __init__(self, folder: Path, argv: list[str], *, env: dict[str, str] | None = None,
                 metrics: Path | None = None, script: list[str] | None = None) -> None:
        self.folder = folder
        self.tmp = folder / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.metrics = metrics or folder / "m.jsonl"
        self.env = {**os.environ, "TMPDIR": str(self.tmp), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "SAILOR_STORE": str(folder / "store"), "PREFECT_HOME": str(folder / "prefect"), **(env or {})}
        self.out, self.err = folder / "stdout.txt", folder / "stderr.txt"
        with open(self.out, "wb") as o, open(self.err, "wb") as e:
            cmd = [sys.executable, *script] if script else [sys.executable, "-m", "sailor_cli.main", *argv]
            self.proc = subprocess.Popen(cmd, stdout=o, stderr=e,
                                         stdin=subprocess.DEVNULL, cwd=REPO, env=self.env, start_new_session=True)
        _LIVE.append(self)
        self.t0 = time.monotonic()
        self.seen: dict[int, int] = {}  # every descendant seen while it ran: {pid: start time}
        self.arrivals: list[tuple[float, int]] = []  # (when seen, step) of each metrics line, in order
        self.iteration_times: list[float] = []  # the steps' measured times, in order
        self.fault_at: float | None = None
        self.ended_at: float | None = None
        self.step_at_fault = 0
        self._read = 0

    def poll(self) -> bool:
        """Updates what is known; True while the command runs."""
        if self.proc.poll() is None:
            self.seen.update(descendants(self.proc.pid))
        self._read_metrics()
        return self.proc.poll() is None

    def _read_metrics(self) -> None:
        try:
            with open(self.metrics, "rb") as f:
                f.seek(self._read)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1
        self._read += end
        now = time.monotonic()
        for ln in chunk[:end].decode(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                rec = json.loads(ln)
                self.arrivals.append((now, int(rec["step"])))
                self.iteration_times.append(float(rec.get("iteration_time_s") or 0.0))

    def steps(self) -> list[int]:
        return [s for _, s in self.arrivals]

    def last_step(self) -> int:
        return max(self.steps(), default=0)

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait(self, pred: Callable[[], bool], timeout: float, every: float = 0.05) -> bool:
        """Polls until `pred()` (True), the command ends or `timeout` passes (False)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            running = self.poll()
            if pred():
                return True
            if not running:
                return False
            time.sleep(every)
        return False

    def wait_steps(self, n: int, timeout: float = 120) -> bool:
        return self.wait(lambda: self.last_step() >= n, timeout * load_pace())

    def pace(self) -> float:
        """How much slower than an idle machine this job trains (its deadlines scale by it)."""
        return step_pace(self.iteration_times)

    def workers(self) -> list[int]:
        """PIDs of the live worker processes (sailor_core.runtime.worker_proc), oldest first."""
        out = []
        for pid in sorted(descendants(self.proc.pid)):
            with contextlib.suppress(OSError):
                if b"worker_proc" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out.append(pid)
        return out

    def fault(self) -> None:
        """Marks the moment the fault is injected."""
        self.poll()
        self.fault_at = time.monotonic()
        self.step_at_fault = self.last_step()

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def finish(self, bound_s: float) -> bool:
        """Waits for the command to end within `bound_s` of the fault (or start), scaled by its `pace`;
        False: hung, killed."""
        since = self.fault_at if self.fault_at is not None else self.t0
        bound_s *= self.pace()
        self.wait(lambda: False, max(0.0, since + bound_s - time.monotonic()), every=0.2)
        if self.proc.poll() is not None:
            self.poll()
            self.ended_at = time.monotonic()
            return True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        reap(self.seen, grace_s=1.0)
        return False

    def exit_status(self) -> int | None:
        rc = self.proc.returncode
        return None if rc is None else (128 - rc if rc < 0 else rc)  # as a shell shows a signal's death

    def leftovers(self, own_mounts: tuple[Path, ...] = ()) -> list[str]:
        """What the command left: live processes it started, mounts under its folder, sailor* temp folders.
        What is found is removed, so that nothing of a case outlives it."""
        end = time.monotonic() + LEFTOVER_WAIT_S
        while time.monotonic() < end and any(_same(p, s) for p, s in self.seen.items()):
            time.sleep(0.2)
        alive = [p for p, s in self.seen.items() if _same(p, s)]
        out = [f"process {p} ({_cmd(p)})" for p in alive]
        reap({p: self.seen[p] for p in alive}, grace_s=2.0)
        out += [f"mount {m}" for m in mounts_under(self.folder) if Path(m) not in own_mounts]
        if self.tmp.exists():
            left = [x for x in self.tmp.iterdir() if x.name.startswith("sailor")]
            out += [f"temp folder {x.name}" for x in left]
            for x in left:
                shutil.rmtree(x, ignore_errors=True)
        return out


_LIVE: list[Job] = []  # every job started: stopped by `stop_all` if the bench itself is stopped


def stop_all(root: Path) -> None:
    """Ends every job still running (SIGTERM, then SIGKILL) and unmounts what a case mounted under `root`."""
    for job in [j for j in _LIVE if j.folder.is_relative_to(root)]:
        if job.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.proc.pid, signal.SIGTERM)
            try:
                job.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(job.proc.pid, signal.SIGKILL)
                job.proc.wait(timeout=10)
        reap({p: s for p, s in job.seen.items() if _same(p, s)}, grace_s=2.0)
    for m in sorted(mounts_under(root), reverse=True):
        subprocess.run(["umount", "-l", m], check=False)


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80].strip()
    except OSError:
        return "?"


def mounts_under(folder: Path) -> list[str]:
    prefix = str(folder.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        points = [ln.split()[1] for ln in f]
    return [p for p in points if (p + "/").startswith(prefix)]


def steps_lost_by_repeats(steps: list[int]) -> int:
    """Steps repeated after recoveries: at each step that is not past the highest one reached so far,
    that highest step minus the step the job resumed from (the repeated step - 1); the most of them."""
    lost, top = 0, 0
    for s in steps:
        if s <= top:
            lost = max(lost, top - (s - 1))
        top = max(top, s)
    return lost


def _heal_seconds(arrivals: list[tuple[float, int]], fault_at: float, step_at_fault: int, repeated: bool) -> float:
    """Seconds from the fault to training again: to the first repeated step after a recovery, else to the
    step that ended the longest stall after the fault (0 when there was none)."""
    after = [(t, s) for t, s in arrivals if t > fault_at]
    if repeated:
        again = [t for t, s in after if s <= step_at_fault]
        return again[0] - fault_at if again else 0.0
    best, prev, stall_end = 0.0, fault_at, fault_at
    for t, _ in after:
        if t - prev > best:
            best, stall_end = t - prev, t
        prev = t
    return stall_end - fault_at if best > 1.0 else 0.0


def latest_valid(uri: str) -> int | None:
    from sailor_core.runtime import checkpoint as ckpt

    try:
        return ckpt.latest_valid_step(ckpt.open_storage(uri, retry_s=5), NUM_LAYERS)
    except Exception as e:  # noqa: BLE001 - an unreadable store reads as "nothing valid" to the bench
        print(f"(bench: cannot read checkpoints at {uri}: {type(e).__name__}: {e})"[:300], file=sys.stderr)
        return None


def observe(job: Job, bound_s: float, *, total: int | None, ck: str | None,
            own_mounts: tuple[Path, ...] = ()) -> Observed:
    """Ends the case (waiting at most `bound_s` after the fault) and measures what it left."""
    done = job.finish(bound_s)
    end = time.monotonic()
    rc = job.exit_status() if done else None
    steps = job.steps()
    left = job.leftovers(own_mounts)
    fault_at = job.fault_at if job.fault_at is not None else job.t0
    seconds = end - fault_at
    lost = steps_lost_by_repeats(steps)
    if rc == 0 and job.fault_at is not None:
        seconds = _heal_seconds(job.arrivals, fault_at, job.step_at_fault, lost > 0)
    elif rc not in (0, None) and ck is not None and steps:
        lost = job.last_step() - (latest_valid(ck) or 0)  # what a --resume would repeat
    return Observed(rc, seconds, lost, left, job.stderr(), steps, total)


# -- classification --------------------------------------------------------------------------------
def classify(expect: str, obs: Observed, *, interval: int = EVERY) -> tuple[str, str]:
    """(outcome, why) of a case that expected `expect` (a key of EXPECTED, or 'done-or-<SIG>')."""
    if obs.rc is None:
        return "hung", "killed at its bound"
    if obs.leftovers:
        return "leaked", "; ".join(obs.leftovers)[:200]
    if obs.missed:
        return "unclean", f"{obs.missed}: the case tested nothing; {obs.note}"
    wanted = EXPECTED.get(expect) or {0, *EXPECTED[expect.split("-")[-1]]}
    if obs.rc not in wanted:
        return "wrong_exit", f"exit {obs.rc}, expected {sorted(wanted)}: {_last_lines(obs.stderr)}"
    if "Traceback" in obs.stderr:
        return "unclean", f"traceback: {_last_lines(obs.stderr)}"
    if obs.steps_lost is not None and obs.steps_lost > interval:
        err = next((ln for ln in obs.stderr.splitlines() if ln.startswith("error: ")), "")[:300]
        lost = f"{obs.steps_lost} steps lost, more than the checkpoint interval {interval}"
        return "unclean", f"{lost}; {obs.note}; {err}"
    if obs.rc == 0:
        if obs.total_steps is not None and set(range(1, obs.total_steps + 1)) - set(obs.steps_done):
            return "unclean", f"exit 0 but steps missing: trained {sorted(set(obs.steps_done))[-5:]}"
        return "healed", obs.note
    errors = [ln for ln in obs.stderr.splitlines() if ln.startswith("error: ")]
    if obs.rc == 1 and len(errors) != 1:
        return "unclean", f"exit 1 with {len(errors)} 'error: ' lines: {_last_lines(obs.stderr)}"
    return "failed_cleanly", obs.note or (errors[0][:120] if errors else _last_lines(obs.stderr, 1))


def _last_lines(text: str, n: int = 2) -> str:
    return " | ".join([ln.strip() for ln in text.splitlines() if ln.strip()][-n:])[:240]


# -- cases ------------------------------------------------------------------------------------------
@dataclass
class Case:
    fault: str
    phase: str
    expect: str
    run: Callable[[Path], Observed]
    quick: bool = False
    needs: tuple[str, ...] = ()  # "root", "s3", "testbed"
    interval: int = EVERY
    counts_lost: bool = True  # False: no checkpoint can exist (a disk too small for one), all steps are lost

    @property
    def name(self) -> str:
        return f"{self.fault} @ {self.phase}"


def _plan_file(folder: Path, plan: str) -> Path:
    p = folder / f"plan-{plan}.json"
    p.write_text(json.dumps(PLANS[plan]))
    return p


def train_job(folder: Path, plan: str, steps: int, *, ck: str | None = "ck", every: int = EVERY,
              timeout_s: float = TIMEOUT_S, extra: tuple[str, ...] = ()) -> tuple[Job, str | None]:
    """`sailor train` of `plan` in `folder` (checkpoints in folder/ck, or the URI `ck` given)."""
    argv = ["train", str(_plan_file(folder, plan)), "--steps", str(steps), "--timeout", str(timeout_s),
            "--metrics-out", str(folder / "m.jsonl"), *extra]
    uri = None
    if ck is not None:
        uri = ck if "://" in ck else str(folder / ck)
        argv += ["--checkpoint-dir", uri, "--checkpoint-every", str(every)]
    return Job(folder, argv), uri


def _bound(timeout_s: float = TIMEOUT_S, waits_s: float = 0.0) -> float:
    return timeout_s + HANG_GRACE_S + waits_s


# worker faults: kill, freeze, preemption notices ----------------------------------------------------
def case_worker_killed(plan: str, which: int = -1) -> Callable[[Path], Observed]:
    def run(folder: Path) -> Observed:
        job, ck = train_job(folder, plan, STEPS)
        if not job.wait_steps(EVERY + 2):
            return observe(job, _bound(), total=STEPS, ck=ck)
        job.fault()
        os.kill(job.workers()[which], signal.SIGKILL)
        return observe(job, _bound(), total=STEPS, ck=ck)
    return run


def case_worker_frozen(plan: str, frozen_s: float | None) -> Callable[[Path], Observed]:
    """SIGSTOP of a worker; SIGCONT after `frozen_s` (None: never; the job must count it lost)."""
    def run(folder: Path) -> Observed:
        job, ck = train_job(folder, plan, STEPS)
        if not job.wait_steps(EVERY + 2):
            return observe(job, _bound(), total=STEPS, ck=ck)
        job.fault()
        victim = job.workers()[-1]
        os.kill(victim, signal.SIGSTOP)
        try:
            if frozen_s is not None:
                job.wait(lambda: False, frozen_s)
                os.kill(victim, signal.SIGCONT)
            return observe(job, _bound(waits_s=frozen_s or 0.0), total=STEPS, ck=ck)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGCONT)  # a frozen process cannot act on SIGTERM
    return run


def case_preempted(plan: str, notice_s: float) -> Callable[[Path], Observed]:
    """A spot preemption: SIGUSR1 (the notice: a just-in-time checkpoint) to a worker, SIGKILL after
    `notice_s` (shorter than a checkpoint write when small)."""
    def run(folder: Path) -> Observed:
        job, ck = train_job(folder, plan, STEPS, every=EVERY)
        if not job.wait_steps(EVERY + 2):
            return observe(job, _bound(), total=STEPS, ck=ck)
        job.fault()
        victim = job.workers()[-1]
        os.kill(victim, signal.SIGUSR1)
        job.wait(lambda: False, notice_s, every=0.01)
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        obs = observe(job, _bound(), total=STEPS, ck=ck)
        obs.note = f"notice {notice_s:g}s"
        return obs
    return run


# SIGINT / SIGTERM in each phase of `sailor train` --------------------------------------------------
def _ck_write_in_progress(ck: Path) -> bool:
    """A checkpoint file is being written (its temporary name exists) or a step's folder lacks meta.json."""
    for root, _, files in os.walk(ck):
        if any(".tmp-" in f for f in files):
            return True
        if Path(root).name.startswith("step_") and files and "meta.json" not in files:
            return True
    return False


def _has_child(job: Job, marker: bytes) -> bool:
    for pid in descendants(job.proc.pid):
        with contextlib.suppress(OSError):
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
    return False


def case_signal(sig: int, phase: str, plan: str = "2stages-tp2", *, group: bool = False) -> Callable[[Path], Observed]:
    """`sig` to the command (to its whole process group if `group`, as Ctrl-C in a terminal) at `phase`."""
    def run(folder: Path) -> Observed:
        total = 6 if phase == "teardown" else LONG
        job, ck = train_job(folder, plan, total, every=1 if phase == "checkpoint write" else EVERY)
        reached = _reach_phase(job, phase, folder)
        job.fault()
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.proc.pid, sig)
        else:
            job.signal(sig)
        obs = observe(job, _bound(), total=None if phase != "teardown" else total, ck=ck)
        obs.note = f"at step {job.step_at_fault}"
        obs.missed = "" if reached else f"phase '{phase}' not reached"  # the signal landed elsewhere
        return obs
    return run


def _reach_phase(job: Job, phase: str, folder: Path) -> bool:
    if phase == "CLI importing":  # before the CLI installed its signal handlers (its imports take ~0.6 s+)
        return job.wait(lambda: False, 0.15) or job.poll()
    if phase == "before workers start":  # handlers installed (its guardian runs), no worker yet
        return job.wait(lambda: _has_child(job, b"sailor_cli.lifeline"), 60, every=0.01) and not job.workers()
    if phase == "workers starting":
        # "started N workers ...": after the run's own line ("run train-... (sailor runs show ...)")
        return job.wait(lambda: any(ln.startswith("started") for ln in job.stdout().splitlines()), 120, every=0.01)
    if phase == "training":
        return job.wait_steps(3)
    if phase == "checkpoint write":
        return job.wait_steps(2) and job.wait(lambda: _ck_write_in_progress(folder / "ck"), 60, every=0.003)
    if phase == "replan":
        if not job.wait_steps(EVERY + 1):
            return False
        os.kill(job.workers()[-1], signal.SIGKILL)
        return job.wait(lambda: "lost workers" in job.stdout(), 60, every=0.01)
    if phase == "teardown":
        return job.wait_steps(6)
    raise ValueError(phase)


# a full disk under the checkpoints (root: a small tmpfs) ---------------------------------------------
def case_disk_full(plan: str, size_mib: int) -> Callable[[Path], Observed]:
    """Checkpoints to a tmpfs of `size_mib` (a gpt-tiny checkpoint is ~11 MiB: 3 MiB fits none, 16 one)."""
    def run(folder: Path) -> Observed:
        mnt = folder / "ck"
        mnt.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt)], check=True)
        try:
            job, ck = train_job(folder, plan, STEPS, ck="ck/run")
            job.wait_steps(1)
            job.fault()  # the fault is there from the start; the clock runs from the first step
            obs = observe(job, _bound(), total=STEPS, ck=ck, own_mounts=(mnt,))
            partial = [f.name for f in mnt.rglob("*") if ".tmp-" in f.name]
            dirs = {d.name: len(list(d.iterdir())) for d in sorted((mnt / "run").glob("*")) if d.is_dir()}
            obs.note = f"newest valid checkpoint {latest_valid(str(ck))}, files per step {dirs}"
            obs.note += f"; partial files {partial}" if partial else ""
            if partial:
                obs.leftovers.append(f"half-written files {partial[:3]}")
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        return obs
    return run


# the object store failing (a fault proxy in front of a local S3 server) ------------------------------
def case_store_outage(kind: str, outage_s: float, *, expect_failure: bool,
                      timeout_s: float = 30.0) -> Callable[[Path], Observed]:
    """Checkpoints to S3 through a proxy that answers `kind` for `outage_s` from the step after a checkpoint."""
    def run(folder: Path) -> Observed:
        from urllib.parse import quote

        from profiles_store.local_servers import LocalS3Server
        from tests.fakes.fault_proxy import FaultProxy

        with LocalS3Server() as s3, FaultProxy("127.0.0.1", s3.port) as proxy:
            s3.create_bucket("faults")
            uri = s3.uri("faults", "run").replace(quote(s3.endpoint, safe=""), quote(proxy.endpoint, safe=""))
            job, ck = train_job(folder, "2stages-tp2", STEPS, ck=uri, every=2, timeout_s=timeout_s)
            if job.wait_steps(5):
                job.fault()
                proxy.fault(kind, outage_s)
            waits = min(outage_s, 150.0) + (140.0 if expect_failure else 0.0)  # the store's 120 s of retries
            obs = observe(job, _bound(timeout_s, waits_s=waits), total=STEPS, ck=None)
            proxy.heal()
            valid = latest_valid(uri)
            if obs.rc not in (0, None) and obs.steps_done:
                obs.steps_lost = job.last_step() - (valid or 0)
            obs.note = f"{proxy.faulted_connections} connections faulted; newest valid checkpoint {valid}"
            if proxy.faulted_connections == 0:
                obs.missed = "the store's fault was never met"
        return obs
    return run


# the flow (`sailor demo`, the local provider; the testbed's isolated VMs as root) ----------------------
FLOW_STEPS = 160  # long enough that a fault at step ~5 lands well before the end (the heartbeat timeout is 20 s)
FLOW_EVERY = 10  # the demo's checkpoint interval
PLAIN_SCENARIO = "offerings:\n  - {market: on-demand, count: 4, usd_per_gpu_hour: 0.3}\n"
# two VMs of one device in one zone (the local link is the only one to know), on the testbed
TESTBED_SCENARIO = """
device_types:
  cpu: {cpu_per_device: 0.4}
regions:
  r1:
    za:
      - {device_type: cpu, devices_per_vm: 1, market: on-demand, count: 2, usd_per_gpu_hour: 0.30}
links: {same_zone_gbps: 1.0, same_region_gbps: 0.4, cross_region_gbps: 0.1}
cpu_budget_cores: 2
"""
_FLOW_STORE: dict[str, Path] = {}  # a store with gpt-tiny's profile, made by the first flow case, copied by the rest


def _flow_env(folder: Path) -> dict[str, str]:
    return {"SAILOR_LEASE_S": "6", "SAILOR_TESTBED_HOME": str(folder / "testbeds")}


def _flow_store(folder: Path) -> None:
    """The case's store starts as a copy of the first flow case's (profiles measured once)."""
    if "store" in _FLOW_STORE and _FLOW_STORE["store"].exists():
        shutil.copytree(_FLOW_STORE["store"], folder / "store")


def _keep_flow_store(folder: Path) -> None:
    if "store" not in _FLOW_STORE and (folder / "store").exists():
        keep = folder.parent / "flow-store"
        shutil.copytree(folder / "store", keep)
        _FLOW_STORE["store"] = keep


def demo_job(folder: Path, scenario: str, isolation: str, *argv: str) -> Job:
    _flow_store(folder)
    (folder / "scenario.yaml").write_text(scenario)
    return Job(folder, ["demo", "--scenario", str(folder / "scenario.yaml"), "--workers", "2", "--steps",
                        str(FLOW_STEPS), "--workdir", str(folder / "wd"), "--isolation", isolation, "--json", *argv],
               env=_flow_env(folder), metrics=folder / "none.jsonl")


def flow_steps(folder: Path) -> list[list[int]]:
    """Per run (in the order they started), the steps trained: the runs' metrics, plan version by version."""
    runs: dict[str, list[tuple[float, list[int]]]] = {}
    for f in (folder / "wd").rglob("*.jsonl"):
        # the flow's records per plan version (`metrics/v<version>.jsonl`), not rank 0's own copies of them
        # beside the worker logs (`logs/<vm>/metrics-v<version>.jsonl`), which would count each step twice
        if f.parent.name != "metrics":
            continue
        rel = f.relative_to(folder / "wd").parts
        run = rel[rel.index("runs") + 1] if "runs" in rel else "?"
        steps = []
        for ln in f.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                steps.append(int(json.loads(ln)["step"]))
        if steps:
            runs.setdefault(run, []).append((f.stat().st_mtime, steps))
    ordered = sorted(runs.values(), key=lambda parts: min(t for t, _ in parts))
    return [[s for _, st in sorted(parts) for s in st] for parts in ordered]


def wait_training(job: Job, folder: Path, n: int = 1, timeout: float = 240) -> bool:
    return job.wait(lambda: any(len(set(r)) >= n for r in flow_steps(folder)), timeout * load_pace(), every=0.5)


def flow_iteration_times(folder: Path) -> list[float]:
    """The measured step times of a flow case's runs (their `metrics/` records), in file order."""
    out: list[float] = []
    for f in sorted((folder / "wd").rglob("metrics/v*.jsonl")):
        for ln in f.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                out.append(float(json.loads(ln)["iteration_time_s"]))
    return out


def flow_fault(job: Job, folder: Path) -> None:
    """Marks the fault of a flow case, with the last step its runs' metrics show."""
    job.fault()
    job.step_at_fault = max((max(r) for r in flow_steps(folder)), default=0)


def observe_flow(job: Job, folder: Path, bound_s: float) -> Observed:
    job.iteration_times = flow_iteration_times(folder) or job.iteration_times  # the flow's pace, for its bound
    obs = observe(job, bound_s, total=None, ck=None)
    if job.fault_at is not None and job.ended_at is not None:
        obs.seconds = job.ended_at - job.fault_at  # a flow's steps arrive in batches: from the fault to its end
    obs.leftovers += testbed_leftovers(folder)
    runs = flow_steps(folder)
    obs.note = f"steps per run {[(min(r), max(r), len(r)) for r in runs]}; "
    gap = sorted(set(range(1, max((max(r) for r in runs), default=0) + 1)) - {s for r in runs for s in r})
    if gap:
        obs.note += f"no metrics record of steps {gap[0]}-{gap[-1]} ({len(gap)}); "
    obs.steps_done = runs[-1] if runs else []
    obs.steps_lost = steps_lost_by_repeats([s for r in runs for s in r])
    out = job.stdout()
    with contextlib.suppress(ValueError):
        doc = json.loads(out[out.index("{\n"):])
        obs.note += f"run {doc.get('status')}, {doc.get('steps_done')} steps, events " + ",".join(
            sorted({e["kind"] for e in doc.get("events", [])}))
        if obs.rc == 0 and doc.get("steps_done") != FLOW_STEPS:
            obs.note += f" (expected {FLOW_STEPS} steps)"
            obs.rc = -1
    _keep_flow_store(folder)
    return obs


def testbed_leftovers(folder: Path) -> list[str]:
    """Namespaces, links and cgroups of the case's testbeds still there, by the tags their records name."""
    tags = {p.parent.name for p in (folder / "testbeds").glob("*/testbed.json")}
    tags |= {p.name for p in (folder / "testbeds").iterdir() if p.is_dir()} if (folder / "testbeds").exists() else set()
    out: list[str] = []
    if not tags:
        return out
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    for tag in tags:
        out += [f"netns {ln.split()[0]}" for ln in ns.splitlines() if f"sb-{tag}-" in ln]
        out += [f"link {ln.split(':')[1].strip()}" for ln in links.splitlines() if f"sb{tag}" in ln]
        if (Path("/sys/fs/cgroup/cpu/sailor-testbed") / tag).exists():
            out.append(f"cgroup sailor-testbed/{tag}")
    return out


def case_agent_killed(folder: Path) -> Observed:
    """SIGKILL of one VM's agent (`sailor worker`) while the flow trains: the flow replans, completes."""
    job = demo_job(folder, PLAIN_SCENARIO, "process")
    agent: dict | None = None  # the VM whose agent is killed (none when the run never trained)
    if wait_training(job, folder, 5):
        recs = [json.loads(f.read_text()) for f in (folder / "wd").glob("runs/*/local/vms/*.json")]
        agent = next((r for r in recs if r.get("pid") and r.get("state") == "running"), None)
        flow_fault(job, folder)
        if agent:
            os.kill(int(agent["pid"]), signal.SIGKILL)
    obs = observe_flow(job, folder, 300)
    obs.note = f"agent of {agent['name'] if agent else 'no VM (none running)'} killed at step {job.step_at_fault}; " \
        + obs.note
    return obs


def case_link_down(cut_s: float) -> Callable[[Path], Observed]:
    """One testbed VM cut off (the host end of its veth down) for `cut_s`, then back."""
    def run(folder: Path) -> Observed:
        job = demo_job(folder, TESTBED_SCENARIO, "netns")
        veth = ""
        if wait_training(job, folder, 5, timeout=400):
            veth = _a_vm_link(folder)
            flow_fault(job, folder)
            down = subprocess.run(["ip", "link", "set", veth, "down"], capture_output=True, text=True)
            job.wait(lambda: False, cut_s, every=0.5)
            subprocess.run(["ip", "link", "set", veth, "up"], capture_output=True, check=False)
            veth += f" (set down: {(down.stderr.strip() or 'ok')[:60]})"
        obs = observe_flow(job, folder, 300 + cut_s)
        obs.note = f"{veth} down {cut_s:g}s at step {job.step_at_fault}; {obs.note}"
        return obs
    return run


def _a_vm_link(folder: Path) -> str:
    for rec in (folder / "testbeds").glob("*/testbed.json"):
        vms = json.loads(rec.read_text()).get("vms", {})
        items = vms.values() if isinstance(vms, dict) else vms
        have = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        links = sorted(f"{v['veth']}" for v in items if v.get("veth") and f" {v['veth']}@" in have)
        if links:
            return links[-1]  # the newest VM's: one of the plan's (profiling VMs come first and are gone)
    return ""


def case_flow_killed_and_resumed(folder: Path) -> Observed:
    """`sailor demo` SIGKILLed while it trains; once its lease expired the flow runs again with resume."""
    first = demo_job(folder, PLAIN_SCENARIO, "process")
    if not wait_training(first, folder, 5):
        return observe_flow(first, folder, 60)
    flow_fault(first, folder)
    first.proc.kill()
    killed = observe(first, 30, total=None, ck=None)
    time.sleep(7)  # past the lease (SAILOR_LEASE_S=6): the run is crashed, not alive
    params = {"run_name": "demo", "model": "gpt-tiny", "global_batch_size": 8, "objective": "max-throughput",
              "max_usd_per_hour": 2.0, "steps": FLOW_STEPS, "workers": 2, "provider": "local",
              "scenario": str(folder / "scenario.yaml"), "isolation": "process", "checkpoint_interval": FLOW_EVERY,
              "store_uri": str(folder / "store"), "workdir": str(folder / "wd"), "resume": True}
    job = Job(folder, [], env=_flow_env(folder), metrics=folder / "none.jsonl",
              script=[str(Path(__file__).resolve()), "--flow-driver", json.dumps(params)])
    job.fault_at, job.step_at_fault = first.fault_at, first.step_at_fault
    obs = observe_flow(job, folder, 300)
    obs.leftovers += killed.leftovers
    obs.note = f"killed (exit {killed.rc}); resumed: {obs.note}"
    return obs


def flow_driver(params_json: str) -> int:
    """Runs the `sailor` flow as `sailor demo` does (ephemeral Prefect, a guardian), with `params`."""
    from sailor_cli.demo import _prefect_env
    from sailor_cli.lifeline import hold

    params = json.loads(params_json)
    _prefect_env(Path(params["workdir"]))
    guardian = hold()
    from flows.sailor import run_id_for, sailor
    from profiles_store.store import open_store
    from tasks.history import RunHistory

    state = sailor(**params, return_state=True)
    run_id = run_id_for(params["run_name"], str(state.state_details.flow_run_id or ""))
    try:
        print(json.dumps(RunHistory(open_store(params["store_uri"])).show(run_id), indent=2, default=str))
    except Exception as e:  # noqa: BLE001 - the run never got recorded: say so in one line
        print(f"error: the flow ended {state.type.value.lower()} before it recorded run {run_id}: {e}",
              file=sys.stderr)
    if guardian is not None:
        guardian.terminate()
    return 0 if state.is_completed() else 1


# -- the matrix -------------------------------------------------------------------------------------
PHASES = ("CLI importing", "before workers start", "workers starting", "training", "checkpoint write", "replan",
          "teardown")


def train_cases() -> list[Case]:
    cases = [
        Case("worker SIGKILL (2 stages, tp 2)", "training", "healed", case_worker_killed("2stages-tp2"), quick=True),
        Case("worker SIGKILL of a TP rank", "training", "healed", case_worker_killed("2stages-tp2", which=0)),
        Case("worker SIGKILL (2 replicas)", "training", "healed", case_worker_killed("2replicas")),
        Case("worker frozen (SIGSTOP) for good", "training", "healed", case_worker_frozen("2stages-tp2", None)),
        Case("worker frozen 3 s (< --timeout)", "training", "healed", case_worker_frozen("2replicas", 3.0)),
        Case("preemption, notice 0.05 s (< a checkpoint)", "training", "healed", case_preempted("2stages-tp2", 0.05)),
        Case("preemption, notice 5 s", "training", "healed", case_preempted("2replicas", 5.0)),
    ]
    for sig in (signal.SIGINT, signal.SIGTERM):
        name = signal.Signals(sig).name
        for phase in PHASES:
            expect = f"done-or-{name}" if phase == "teardown" else name
            quick = (sig, phase) in ((signal.SIGINT, "training"), (signal.SIGTERM, "workers starting"))
            cases.append(Case(name, phase, expect, case_signal(sig, phase), quick=quick))
    cases.append(Case("Ctrl-C (SIGINT to the process group)", "training", "SIGINT",
                      case_signal(signal.SIGINT, "training", group=True)))
    cases += [
        Case("disk full: 3 MiB tmpfs (2 replicas)", "checkpoint write", "failed", case_disk_full("2replicas", 3),
             quick=True, needs=("root",), interval=STEPS, counts_lost=False),
        Case("disk full: 3 MiB tmpfs (2 stages, tp 2)", "checkpoint write", "failed",
             case_disk_full("2stages-tp2", 3), needs=("root",), interval=STEPS, counts_lost=False),
        Case("disk full: 16 MiB tmpfs (2nd checkpoint)", "checkpoint write", "failed",
             case_disk_full("2stages-tp2", 16), needs=("root",)),
    ]
    return cases


def store_cases() -> list[Case]:
    cases = [Case(f"object store {k} for 10 s", "training", "healed",
                  case_store_outage(k, 10.0, expect_failure=False), needs=("s3",), interval=2,
                  quick=(k == "503")) for k in ("503", "timeout", "reset")]
    cases.append(Case("object store 503 for 5 min", "training", "failed",
                      case_store_outage("503", 300.0, expect_failure=True), needs=("s3",), interval=2))
    return cases


def flow_cases() -> list[Case]:
    return [
        Case("agent SIGKILL (flow, 2 VMs)", "training", "healed", case_agent_killed, interval=FLOW_EVERY),
        Case("flow SIGKILL, run again with resume", "training", "healed", case_flow_killed_and_resumed,
             interval=FLOW_EVERY),
        Case("VM cut off 10 s (testbed link down)", "training", "healed", case_link_down(10.0),
             needs=("testbed",), interval=FLOW_EVERY),
        Case("VM cut off 30 s (> heartbeat timeout 20 s)", "training", "healed", case_link_down(30.0),
             needs=("testbed",), interval=FLOW_EVERY),
    ]


def all_cases() -> list[Case]:
    return train_cases() + store_cases() + flow_cases()


def missing(needs: tuple[str, ...]) -> str:
    """Why a case cannot run here ('' when it can)."""
    for n in needs:
        if n == "root" and os.geteuid() != 0:
            return "needs root (mount a tmpfs)"
        if n == "s3" and not _has_s3():
            return "no local S3 server (rclone) installed"
        if n == "testbed":
            from infra.testbed import testbed_support

            ok, why = testbed_support()
            if not ok:
                return f"no testbed here: {why}"
    return ""


def _has_s3() -> bool:
    from profiles_store.local_servers import _find_binary
    from sailor_core.errors import SailorError

    try:
        _find_binary("rclone")
    except SailorError:  # _find_binary's "not found": the S3 cases are skipped with that reason
        return False
    return True


# -- main -------------------------------------------------------------------------------------------
def run_case(case: Case, root: Path, index: int) -> tuple[str, str, Observed | None, float]:
    folder = root / f"case{index:02d}"
    folder.mkdir(parents=True)
    t0 = time.monotonic()
    try:
        obs = case.run(folder)
    except Exception as e:  # noqa: BLE001 - a broken case is reported, the bench goes on
        stop_all(folder)  # and what it started is stopped, not left to the next case
        return "error", f"{type(e).__name__}: {e}"[:240], None, time.monotonic() - t0
    outcome, why = classify(case.expect, obs, interval=case.interval)
    if not os.environ.get("BENCH_FAULTS_KEEP"):
        shutil.rmtree(folder, ignore_errors=True)
    return outcome, why, obs, time.monotonic() - t0


def row(case: Case, outcome: str, why: str, obs: Observed | None, wall: float) -> str:
    secs = f"{obs.seconds:6.1f}" if obs else "     -"
    lost = str(obs.steps_lost) if obs and obs.steps_lost is not None else "-"
    rc = "-" if obs is None or obs.rc is None else str(obs.rc)
    left = str(len(obs.leftovers)) if obs else "-"
    return (f"{case.fault[:44]:<44} {case.phase[:20]:<20} {outcome:<14} {secs} {lost:>4} {rc:>4} {left:>4} "
            f"{wall:6.1f}  {why}")


TABLE = REPO / "out" / "bench_faults.txt"  # the last run's table, kept for reports (out/ is not tracked)


def say(line: str) -> None:
    """Print a line of the table and append it to `TABLE`."""
    print(line, flush=True)
    with open(TABLE, "a") as f:
        f.write(line + "\n")


def _run_all(cases: list[Case], root: Path, counts: dict[str, int]) -> tuple[int, int]:
    """Runs the cases one after the other, printing a row each; (cases run, most steps lost)."""
    n, max_lost = 0, 0
    for i, case in enumerate(cases):
        why_not = missing(case.needs)
        if why_not:
            say(f"SKIP {case.name}: {why_not}")
            continue
        outcome, why, obs, wall = run_case(case, root, i)
        n += 1
        counts[outcome] = counts.get(outcome, 0) + 1
        if obs is not None and obs.steps_lost is not None and case.counts_lost:
            max_lost = max(max_lost, obs.steps_lost)
        say(row(case, outcome, why, obs, wall))
    return n, max_lost


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a fast subset (~1-2 min)")
    ap.add_argument("--only", default=None, help="only cases whose fault or phase contains this")
    ap.add_argument("--group", choices=("train", "store", "flow"), default=None, help="only this group of cases")
    ap.add_argument("--skip", default=None, help="leave out cases whose fault or phase contains this")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--flow-driver", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.flow_driver:
        return flow_driver(args.flow_driver)
    groups = {"train": train_cases, "store": store_cases, "flow": flow_cases}
    pool = groups[args.group]() if args.group else all_cases()
    cases = [c for c in pool if (c.quick or not args.quick)
             and (args.only is None or args.only in c.name) and (args.skip is None or args.skip not in c.name)]
    if args.list:
        for c in cases:
            print(f"{c.name}  (expect {c.expect}{', quick' if c.quick else ''})")
        return 0
    counts = dict.fromkeys(("healed", "failed_cleanly", "hung", "wrong_exit", "leaked"), 0)
    t_start = time.monotonic()
    TABLE.parent.mkdir(exist_ok=True)
    TABLE.write_text(f"# python bench/bench_faults.py {' '.join(argv if argv is not None else sys.argv[1:])}; "
                     f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
                     f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    say(f"{'fault':<44} {'phase':<20} {'outcome':<14} {'heal/fail s':>6} {'lost':>4} {'exit':>4} "
        f"{'left':>4} {'wall s':>6}  detail")
    keep = os.environ.get("BENCH_FAULTS_KEEP")  # a folder: keep every case's folder there to look at
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops the bench: clean up first
    with contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        try:
            n, max_lost = _run_all(cases, Path(tmp), counts)
        finally:
            stop_all(Path(tmp))
    others = {k: v for k, v in counts.items() if k not in ("healed", "failed_cleanly", "hung", "wrong_exit", "leaked")}
    say(f"wall time {time.monotonic() - t_start:.0f} s" + (f"; other outcomes: {others}" if others else ""))
    say(f"cases={n} healed={counts['healed']} failed_cleanly={counts['failed_cleanly']} hung={counts['hung']} "
          f"wrong_exit={counts['wrong_exit']} leaked={counts['leaked']} max_steps_lost={max_lost}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
