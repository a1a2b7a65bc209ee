"""Secrets and doors of a run on this machine (issue 44, items 10, 11 and 16).

- The run's secret (in each VM's `assignment.json`; with it any local user could stop or abort the
  run through the controller) was 0644 in 0755 folders. Now every file holding a secret is 0600 in
  folders of 0700, owned by the run's user: walked here during a live `sailor demo` on the testbed.
- The testbed's object store ran with fixed keys (`--auth-key sailor,sailor-secret`), visible in
  `ps`: any local user could read and write every run's checkpoints. Now each server gets its own
  random keys by environment; `ps` shows none; what listens on the testbed's bridge is the
  controller and the object store, nothing else of the run.
- The testbed home had a predictable name and was used whoever owned it: a home owned by `nobody`
  (mode 0777) let nobody swap root's run folder, which holds the script root runs. Now a home (or a
  folder above it) that another user owns or may write to is refused with one line.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.testbed import Testbed, TestbedError, testbed_support
from sailor_core.files import private_dir
from tests.paths import REPO

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder another user owns")


def _nobodys(path: Path) -> Path:
    path.mkdir()
    os.chown(path, NOBODY, NOBODY)
    path.chmod(0o777)
    return path


# --- item 16: the testbed home -----------------------------------------------------------------------------------
@as_root
def test_a_testbed_home_another_user_owns_is_refused_and_left_untouched(tmp_path):
    home = _nobodys(tmp_path / "home")
    with pytest.raises(TestbedError, match="testbed home.*user 65534.*to fix"):
        Testbed.create(run_id="r", zones=["local"], link_gbps=lambda a, b: 1.0, isolation="process", home=home)
    assert list(home.iterdir()) == []
    under = _nobodys(tmp_path / "open") / "home"  # ours, but inside a folder nobody may rename things in
    with pytest.raises(TestbedError, match="lies under .*open.*to fix"):
        Testbed.create(run_id="r", zones=["local"], link_gbps=lambda a, b: 1.0, isolation="process", home=under)


@as_root
def test_sailor_demo_with_a_testbed_home_another_user_owns_exits_with_one_line(tmp_path):
    home = _nobodys(tmp_path / "home")
    env = {**os.environ, "SAILOR_TESTBED_HOME": str(home), "PREFECT_HOME": str(tmp_path / "prefect"),
           "TMPDIR": str(tmp_path), "SAILOR_STORE": str(tmp_path / "store")}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "sailor_cli.main", "demo", "--steps", "2", "--workdir",
                        str(tmp_path / "work")], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode != 0 and len(lines) == 1 and "testbed home" in lines[0] and "to fix" in lines[0], \
        (p.returncode, p.stdout[-1000:], p.stderr[-2000:])
    assert list(home.iterdir()) == [] and time.monotonic() - t0 < 60  # refused before any run started


def test_a_new_private_folder_is_0700_and_an_existing_one_of_ours_is_tightened(tmp_path):
    new = private_dir(tmp_path / "a" / "b", what="x")
    assert stat.S_IMODE(new.stat().st_mode) == 0o700 and stat.S_IMODE(new.parent.stat().st_mode) == 0o700
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    private_dir(old, what="x")
    assert stat.S_IMODE(old.stat().st_mode) == 0o700
    link = tmp_path / "link"
    link.symlink_to(old)
    with pytest.raises(Exception, match="symbolic link"):
        private_dir(link, what="x")


# --- item 11: the object store's keys ----------------------------------------------------------------------------
def _ps() -> str:
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout


def test_the_testbed_object_store_has_random_keys_no_ps_shows_in_a_folder_of_its_own(tmp_path):
    from tasks.runstate import TestbedObjectStore

    a = TestbedObjectStore(tmp_path / "objects", "127.0.0.1")
    b = TestbedObjectStore(tmp_path / "objects", "127.0.0.1")
    try:
        keys = {a.server.access_key, a.server.secret_key, b.server.access_key, b.server.secret_key}
        assert len(keys) == 4 and "sailor-secret" not in keys
        listing = _ps()
        assert not [k for k in keys if k in listing], "a key of the object store is on a command line"
        for srv in (a.server, b.server):
            assert srv.proc is not None
            assert srv.secret_key not in Path(f"/proc/{srv.proc.pid}/cmdline").read_bytes().decode(errors="replace")
        state = a.state("r-1")
        state.write("probe.txt", b"ok")
        assert state.read("probe.txt") == b"ok"
        assert stat.S_IMODE((tmp_path / "objects").stat().st_mode) == 0o700
        from sailor_core.runtime.checkpoint import open_storage

        wrong = state.flow_uri.replace(a.server.secret_key, b.server.secret_key)  # b's key on a's server
        with pytest.raises(Exception):  # noqa: B017 - any refusal will do; what matters is that it refuses
            open_storage(wrong, retry_s=0).read("probe.txt")
    finally:
        a.close()
        b.close()


# --- items 10 and 11 during a live run ---------------------------------------------------------------------------
def _tree(root: int) -> set[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return out


def _listeners(pids: set[int]) -> dict[tuple[str, int], int]:
    """(address, port) -> pid of every TCP socket in LISTEN state (host namespace) that one of `pids` holds."""
    inode_pid = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inode_pid[target[8:-1]] = pid
        except OSError:
            continue
    out = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inode_pid:  # 0A: LISTEN
                hexaddr, hexport = f[1].split(":")
                if table == "tcp6":  # the IPv6 wildcard also takes IPv4 connections
                    addr = "0.0.0.0" if set(hexaddr) == {"0"} else f"v6:{hexaddr}"
                else:
                    addr = ".".join(str(int(hexaddr[i:i + 2], 16)) for i in (6, 4, 2, 0))
                out[(addr, int(hexport, 16))] = inode_pid[f[9]]
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # ended meanwhile
        return ""


def _secret_files(roots: list[Path], secrets: list[str]) -> list[Path]:
    return [p for root in roots for p in root.rglob("*")
            if p.is_file() and not p.is_symlink() and any(s.encode() in p.read_bytes() for s in secrets)]


def _exposed(path: Path, root: Path) -> list[str]:
    """What makes `path` (a file holding a secret) reachable by another user, from it up to `root`."""
    bad = []
    st = path.stat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        bad.append(f"{path} {stat.S_IMODE(st.st_mode):04o} uid {st.st_uid}")
    for folder in [q for q in path.parents if q.is_relative_to(root)]:
        st = folder.stat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            bad.append(f"{folder} {stat.S_IMODE(st.st_mode):04o} uid {st.st_uid}")
    return bad


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen[str]):  # noqa: ANN001, ANN202
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"the demo ended before {what}: {proc.returncode}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.skipif(not testbed_support()[0], reason=f"no testbed here: {testbed_support()[1]}")
def test_during_a_live_testbed_run_secrets_are_private_ps_shows_none_and_the_bridge_serves_only_the_vms(tmp_path):
    home, work = tmp_path / "testbed-home", tmp_path / "work"
    env = {**os.environ, "SAILOR_TESTBED_HOME": str(home), "PREFECT_HOME": str(tmp_path / "prefect"),
           "TMPDIR": str(tmp_path), "SAILOR_STORE": str(tmp_path / "store"), "PYTHONUNBUFFERED": "1"}
    demo = subprocess.Popen([sys.executable, "-m", "sailor_cli.main", "demo", "--isolation", "netns", "--steps",
                             "400", "--workdir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            text=True, cwd=REPO, env=env, start_new_session=True)
    try:
        assignments = _wait(lambda: sorted(home.glob("*/vms/*/assignment.json")), 600, "a VM's assignment", demo)
        secret = json.loads(assignments[0].read_text())["run_secret"]
        record = json.loads(next(home.glob("*/testbed.json")).read_text())
        # 10: every file holding the run's secret, and each folder above it, is the run's own (0600 in 0700)
        holding = _secret_files([home, work], [secret])
        assert any(p.name == "assignment.json" for p in holding), holding
        exposed = [x for p in holding for x in _exposed(p, home if p.is_relative_to(home) else work)]
        assert exposed == [], exposed
        tree = _tree(demo.pid)
        rclone = [p for p in tree if _comm(p) == "rclone"]
        assert len(rclone) == 1, "the run's object store"
        raw = Path(f"/proc/{rclone[0]}/environ").read_text().split("\0")
        environ = dict(kv.split("=", 1) for kv in raw if "=" in kv)
        assert "RCLONE_AUTH_KEY" in environ, "the object store's keys are not given by environment"
        access_key, secret_key = environ["RCLONE_AUTH_KEY"].strip('"').split(",", 1)
        holding = _secret_files([home, work], [secret_key])  # the store's key, where a file holds it
        assert [x for p in holding for x in _exposed(p, home if p.is_relative_to(home) else work)] == []
        # 11: no credential on any command line
        listing = _ps()
        assert secret not in listing and secret_key not in listing and access_key not in listing
        # 11: on the bridge the run serves its controller (the flow's process) and its object store, nothing else
        bridge = record["host_address"]
        served = {addr_port: pid for addr_port, pid in _listeners(_tree(demo.pid)).items()
                  if addr_port[0] in (bridge, "0.0.0.0")}
        assert {pid for pid in served.values()} <= {demo.pid, rclone[0]} and len(served) == 2, served
        assert all(addr == bridge for addr, _ in served), served
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGTERM)  # the demo alone: it stops its VMs and its Prefect server itself
        try:
            demo.wait(timeout=300)
        finally:
            if demo.poll() is None:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()
