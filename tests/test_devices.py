"""bind_device (sailor_core/runtime/devices.py) without a testbed: a folder stands in for a VM's cpu cgroup.

The real cgroups are exercised by tests/test_testbed.py (root only): there a loop bound to dev0 of a
2-device VM gets one device's share.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sailor_core.errors import TestbedError
from sailor_core.runtime import devices, engine


@pytest.fixture(autouse=True)
def unbound(monkeypatch):
    monkeypatch.setitem(devices._BOUND, "share", None)
    monkeypatch.delenv(devices.CGROUP_ROOT_ENV, raising=False)


def fake_vm(root: Path, shares: list[float | None]) -> Path:
    for i, share in enumerate(shares):
        d = root / f"dev{i}"
        d.mkdir(parents=True)
        (d / "cgroup.procs").write_text("")
        (d / "cpu.cfs_period_us").write_text("100000")
        (d / "cpu.cfs_quota_us").write_text("-1" if share is None else str(int(share * 100_000)))
    return root


def test_outside_the_testbed_a_cpu_process_is_left_alone():
    devices.bind_device(3)
    assert devices.device_share() is None
    clock = devices.device_cpu_clock()
    assert abs(clock() - time.thread_time()) < 0.01


def test_on_the_testbed_a_process_joins_its_devices_cgroup_and_reads_its_clock_at_that_share(tmp_path, monkeypatch):
    root = fake_vm(tmp_path, [0.4, 0.4])
    monkeypatch.setenv(devices.CGROUP_ROOT_ENV, str(root))
    devices.bind_device(1)
    assert (root / "dev1" / "cgroup.procs").read_text() == str(os.getpid())
    assert (root / "dev0" / "cgroup.procs").read_text() == ""
    assert devices.device_share() == pytest.approx(0.4)
    clock = devices.device_cpu_clock()
    c0, t0 = clock(), time.thread_time()
    while time.thread_time() - t0 < 0.05:
        pass
    # a second of this core's CPU is 2.5 s of a device of 0.4 cores
    assert (clock() - c0) / (time.thread_time() - t0) == pytest.approx(2.5, rel=0.05)


def test_a_share_of_a_core_or_more_runs_a_thread_at_full_speed(tmp_path, monkeypatch):
    monkeypatch.setenv(devices.CGROUP_ROOT_ENV, str(fake_vm(tmp_path, [2.0, None])))
    devices.bind_device(0)
    assert devices.device_share() == pytest.approx(2.0)
    assert abs(devices.device_cpu_clock()() - time.thread_time()) < 0.01
    devices.bind_device(1)  # no quota on that device
    assert devices.device_share() is None


def test_a_device_the_vm_lacks_is_refused_with_what_it_has(tmp_path, monkeypatch):
    monkeypatch.setenv(devices.CGROUP_ROOT_ENV, str(fake_vm(tmp_path, [0.4, 0.4])))
    with pytest.raises(TestbedError, match="no device 2 .*dev0, dev1.*ranks 0..1"):
        devices.bind_device(2)


def test_a_gpu_type_selects_the_gpu_as_the_runtime_does(monkeypatch, tmp_path):
    chosen = []
    monkeypatch.setattr(engine, "select_device", lambda gpu_type, index: chosen.append((gpu_type, index)))
    monkeypatch.setenv(devices.CGROUP_ROOT_ENV, str(fake_vm(tmp_path, [0.4])))
    devices.bind_device(1, "A100-40")
    devices.bind_device(0, "cuda")
    assert chosen == [("A100-40", 1), ("cuda", 0)]
    assert (tmp_path / "dev0" / "cgroup.procs").read_text() == ""  # a GPU is no CPU share


def test_a_profilers_tp_group_fits_in_the_vms_devices(tmp_path, monkeypatch):
    from sailor_core.errors import SailorError
    from sailor_core.profiler.layers import ModelProfileSettings

    settings = ModelProfileSettings(model="gpt-tiny", device="cpu", mbs=(1,), tp=(1, 4))
    settings.validate()  # 4 cpu worker slots outside the testbed
    assert devices.device_count() is None
    monkeypatch.setenv(devices.CGROUP_ROOT_ENV, str(fake_vm(tmp_path, [0.4, 0.4])))
    assert devices.device_count() == 2
    with pytest.raises(SailorError, match=r"TP degree 4 is larger than this node \(2 "):
        settings.validate()
