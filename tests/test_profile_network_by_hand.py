"""`sailor profile network --from ZONE[:TYPE] --to ZONE[:TYPE]`: a link measured by hand on rented VMs,
then used by `sailor plan`.

The local provider rents the VMs (plain processes here, `--isolation process`: no root, no testbed lock),
each installs the run's wheel and runs `sailor profile link`; the link lands in the store both ways, and
a plan over the two zones that was refused for want of that link is made with it afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from profiles_store.tables import LINK_ALLREDUCE, NETWORK_LINKS

REPO = Path(__file__).resolve().parent.parent

SCENARIO = """
device_types:
  A100-40: {cpu_per_device: 0.25}
regions:
  ra:
    za:
      - {device_type: A100-40, devices_per_vm: 1, market: on-demand, count: 1, usd_per_gpu_hour: 1.0}
  rb:
    zb:
      - {device_type: A100-40, devices_per_vm: 1, market: on-demand, count: 1, usd_per_gpu_hour: 1.0}
links: {same_zone_gbps: 1.0, same_region_gbps: 0.4, cross_region_gbps: 0.1}
cpu_budget_cores: 2
"""
POOL = """
zones:
  za: {region: ra, gpus: {A100-40: {count: 1, usd_per_gpu_hour: 1.0}}}
  zb: {region: rb, gpus: {A100-40: {count: 1, usd_per_gpu_hour: 1.0}}}
"""


def sailor(tmp: Path, *argv: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFECT_HOME": str(tmp / "prefect")}
    return subprocess.run([sys.executable, "-m", "sailor_cli.main", *argv], capture_output=True, text=True, cwd=tmp,
                          env=env, timeout=timeout)


def plan_json(tmp: Path, store: Path) -> dict:
    p = sailor(tmp, "plan", "--pool", str(tmp / "pool.yaml"), "--model", "OPT-350", "--global-batch-size", "16",
               "--store", str(store), "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def zones_of(plan: dict) -> set[str]:
    return {r["zone"] for s in plan["stages"] for r in s["replicas"]}


def test_a_link_measured_by_hand_is_stored_both_ways_and_plans_use_it(tmp_path: Path) -> None:
    from infra.local import LocalProvider
    from profiles_store.store import open_store

    (tmp_path / "sc.yaml").write_text(SCENARIO)
    (tmp_path / "pool.yaml").write_text(POOL)
    store = tmp_path / "store"
    before = plan_json(tmp_path, store)
    assert zones_of(before["plan"]) == {"zb"}  # one GPU: the two zones may not talk yet
    assert "A100-40 in za <-> A100-40 in zb" in json.dumps(before)  # the plans needing the link were left out

    p = sailor(tmp_path, "profile", "network", "--from", "za", "--to", "zb:A100-40", "--scenario",
               str(tmp_path / "sc.yaml"), "--isolation", "process", "--store", str(store), "--workdir",
               str(tmp_path / "wd"), "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["rows"] == ["za:A100-40 <-> zb:A100-40"]
    links = {(lk.sender_zone, lk.receiver_zone): lk for lk in open_store(str(store)).read(NETWORK_LINKS)}
    assert list(links[("za", "zb")].fit.coeffs) == out["fit_coeffs"] == list(links[("zb", "za")].fit.coeffs)
    # nothing of the run is left: its VMs are terminated, each kept its command's output in the run's logs
    vms = LocalProvider(tmp_path / "wd" / "runs" / out["run_id"] / "local").list_vms(out["run_id"])
    assert sorted(v.vm_id for v in vms) == sorted(out["vms"]) and all(v.state == "terminated" for v in vms)
    logs = tmp_path / "wd" / "runs" / out["run_id"] / "state" / "logs" / "jobs"
    assert any("link za:A100-40 <-> zb:A100-40" in f.read_text() for f in logs.iterdir())

    after = plan_json(tmp_path, store)
    assert "za -> A100-40 x1 in zb" not in json.dumps(after)
    assert zones_of(after["plan"]) == {"za", "zb"}, after["explanation"]  # a pipeline over both zones now
    # the plan reads the measured figures: the same link 100x slower (its sends and its all-reduce) costs the
    # plan its second zone
    st = open_store(str(store))
    slow = [replace(lk, fit=replace(lk.fit, coeffs=tuple(c / 100 for c in lk.fit.coeffs),
                                    max_bytes_per_s=lk.fit.max_bytes_per_s / 100))
            for key, lk in links.items() if key in (("za", "zb"), ("zb", "za"))]
    st.write(NETWORK_LINKS, slow)
    ars = {(x.zone_a, x.zone_b): x for x in st.read(LINK_ALLREDUCE)}
    assert set(ars) == {("za", "zb"), ("zb", "za")}  # the two VMs' all-reduce over the link, both ways
    st.write(LINK_ALLREDUCE, [replace(x, fit=replace(x.fit, coeffs=tuple(c / 100 for c in x.fit.coeffs),
                                                    max_bytes_per_s=x.fit.max_bytes_per_s / 100))
                             for x in ars.values()])
    slowed = plan_json(tmp_path, store)
    assert slowed["estimate"]["iteration_time_s"] > after["estimate"]["iteration_time_s"]


def test_an_end_the_provider_does_not_offer_is_a_one_line_error_and_rents_nothing(tmp_path: Path) -> None:
    (tmp_path / "sc.yaml").write_text(SCENARIO)
    p = sailor(tmp_path, "profile", "network", "--from", "za:V100-16", "--to", "zb", "--scenario",
               str(tmp_path / "sc.yaml"), "--isolation", "process", "--store", str(tmp_path / "store"), "--workdir",
               str(tmp_path / "wd"))
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "no V100-16 there" in lines[0] and "to fix: one of za:A100-40" in lines[0]
    p = sailor(tmp_path, "profile", "network", "--from", "za", "--store", str(tmp_path / "store"))
    assert p.returncode == 2 and "--from and --to go together" in p.stderr


def test_ctrl_c_while_the_link_is_measured_leaves_no_vm_behind(tmp_path: Path) -> None:
    import signal
    import time

    from infra.local import LocalProvider
    from profiles_store.store import open_store

    (tmp_path / "sc.yaml").write_text(SCENARIO)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    p = subprocess.Popen([sys.executable, "-m", "sailor_cli.main", "profile", "network", "--from", "za", "--to", "zb",
                          "--scenario", str(tmp_path / "sc.yaml"), "--isolation", "process", "--store",
                          str(tmp_path / "store"), "--workdir", str(tmp_path / "wd")], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not _link_ends(tmp_path / "wd"):  # the VMs are rented and run their ends of the link
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130, err[-2000:]
    (run_dir,) = (tmp_path / "wd" / "runs").iterdir()
    vms = LocalProvider(run_dir / "local").list_vms(run_dir.name)
    assert len(vms) == 2 and all(v.state == "terminated" for v in vms), vms
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid).find(str(tmp_path / "wd")) >= 0]
    assert not left, [_cmdline(pid) for pid in left]  # no agent, no `sailor profile link` end
    assert "za" not in {lk.sender_zone for lk in open_store(str(tmp_path / "store")).read(NETWORK_LINKS)}


def _link_ends(wd: Path) -> list[str]:
    return [pid for pid in os.listdir("/proc") if pid.isdigit() and str(wd) in (c := _cmdline(pid))
            and " profile link " in c]


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
