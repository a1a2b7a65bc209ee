"""The testbed validation bench's parts that need no testbed: the order its plans train in, the rounds of
layer profiles around each run and that a run's estimate comes from them only, when a run is repeated
for drift, and the CFS quotas of devices whose share is not 1 ms over a whole number of µs (the bench
itself needs root and a quarter of an hour: bench/validate_testbed.py). One test writes real cgroups
and needs root."""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from infra.testbed import CGROUP_CPU, MIN_PERIOD_US, MIN_QUOTA_US, cfs_period_us, set_cpu_share
from infra.testbed import testbed_support as support_check
from sailor_core.domain import LayerProfile, ParallelPlan, PipelineBatch, Replica, Stage
from sailor_core.simulator import simulate
from tests.paths import REPO
from tests.planner_fixtures import tiny_book


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("validate_testbed", REPO / "bench" / "validate_testbed.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _lp(layer: int, f: float, b: float, mbs: int = 4, tp: int = 1, gpu: str = "cpu-slow") -> LayerProfile:
    return LayerProfile(model="m", gpu_type=gpu, mbs=mbs, tp=tp, layer=layer, forward_s=f, backward_s=b,
                        optimizer_s=f / 10)


def test_plans_train_in_sweeps_every_other_one_backwards(bench):
    assert bench.sweep_order(["a", "b", "c"], 2) == ["a", "b", "c", "c", "b", "a"]
    assert bench.sweep_order(["a", "b"], 3) == ["a", "b", "b", "a", "a", "b"]
    assert bench.sweep_order(["a"], 0) == ["a"]


def test_the_median_of_rounds_per_point_and_of_two_rounds_their_mean(bench):
    rounds = [[_lp(0, 1.0, 2.0), _lp(1, 1.0, 2.0)],
              [_lp(0, 1.3, 2.6), _lp(1, 0.9, 1.8)],   # a slow minute for layer 0, a fast one for layer 1
              [_lp(0, 1.1, 2.1), _lp(1, 1.05, 2.2)]]
    got = {p.layer: p for p in bench.median_profiles(rounds)}
    assert (got[0].forward_s, got[0].backward_s) == (1.1, 2.1)
    assert (got[1].forward_s, got[1].backward_s) == (1.0, 2.0)
    assert got[0].optimizer_s == pytest.approx(0.11)
    # points one round lacks are the median of the rounds that have them; other keys stay apart
    two = bench.median_profiles([[_lp(0, 1.0, 2.0), _lp(0, 5.0, 5.0, tp=2)], [_lp(0, 2.0, 4.0)]])
    assert sorted((p.tp, p.forward_s) for p in two) == [(1, 1.5), (2, 5.0)]


def test_the_host_clock_is_read_inside_the_windows_only_and_not_from_too_few_samples(bench):
    samples = [(float(t), 1.0 if t < 50 else 2.0) for t in range(100)]
    assert bench.speed_over(samples, [(0, 20)]) == 1.0
    assert bench.speed_over(samples, [(10, 19), (60, 69)]) == 1.5  # both windows, ten samples each
    assert bench.speed_over(samples, [(0, 5)]) is None  # six samples: too few to tell
    assert bench.speed_over([], [(0, 100)]) is None


# ------------------------------------------------------------------------------------------
# runs between rounds


class _Round:
    """A fake round of layer profiles: when it ran, and what it measured (a number per plan it covered)."""

    def __init__(self, start: float, end: float, names: list[str], speed: float) -> None:
        self.start, self.end, self.names, self.speed = start, end, names, speed


class _Bench:
    """A fake testbed: a clock that moves 10 s per training run and 2 s per round, a host whose speed
    the test sets, and a log of what each call saw."""

    def __init__(self, speeds: dict[int, float] | None = None) -> None:
        self.t = 0.0
        self.rounds: list[_Round] = []
        self.trained: list[str] = []
        self.speeds = speeds or {}  # round number -> host speed during it (1.0 otherwise)

    def now(self) -> float:
        return self.t

    def train_run(self, name: str) -> list[tuple[float, float]]:
        self.trained.append(name)
        self.t += 10.0
        return [(1.0, self.t - 1.0), (1.0, self.t)]  # two kept steps at the end of the run

    def take_round(self, names) -> _Round:
        r = _Round(self.t, self.t + 2.0, list(names), self.speeds.get(len(self.rounds), 1.0))
        self.t += 2.0
        self.rounds.append(r)
        return r


def _estimate(bench):
    def estimate_run(name: str, before: _Round, after: _Round):
        assert name in before.names and name in after.names  # both rounds profiled what the plan reads
        return bench.Estimate(iteration_s=(before.speed + after.speed) / 2, before_s=before.speed, after_s=after.speed)
    return estimate_run


def _drifted(bench, bound: float = 10.0):
    return lambda run: "rounds apart" if run.sim.rounds_apart_pct > bound else ""


def test_every_run_is_estimated_from_the_rounds_just_before_and_just_after_it_never_from_its_window(bench):
    fake = _Bench()
    queue = ["a", "b", "c", "c", "b", "a"]
    runs = bench.measure_runs(queue, train_run=fake.train_run, take_round=fake.take_round,
                              estimate_run=_estimate(bench), drifted=_drifted(bench), repeats=4, now=fake.now)
    assert [r.name for r in runs] == queue == fake.trained
    assert len(fake.rounds) == len(queue) + 1  # one before the first run, one after each
    for k, r in enumerate(runs):
        assert r.before is fake.rounds[k] and r.after is fake.rounds[k + 1]
        assert r.before.end <= r.start < r.end <= r.after.start  # both rounds lie outside the run
        lo, hi = r.steps_window
        assert r.start <= lo and hi <= r.end
        if k + 1 < len(runs):
            assert runs[k + 1].before is r.after  # the round after one run is the round before the next
    # each round covers the plans on either side of it
    assert [x.names for x in fake.rounds] == [["a"], ["a", "b"], ["b", "c"], ["c", "c"], ["c", "b"], ["b", "a"], ["a"]]


def test_a_run_whose_rounds_disagree_is_run_again_between_fresh_rounds_while_repeats_last(bench):
    slow = {1: 1.5, 2: 1.5, 3: 1.5}  # from the round after a's first run on, the host is 50 % slower
    fake = _Bench(speeds=slow)
    runs = bench.measure_runs(["a", "b"], train_run=fake.train_run, take_round=fake.take_round,
                              estimate_run=_estimate(bench), drifted=_drifted(bench), repeats=1, now=fake.now)
    # a's run lies between round 0 (1.0) and round 1 (1.5): thrown away, run again between rounds 1 and 2
    assert fake.trained == ["a", "a", "b"]
    assert [(r.name, r.discarded, r.drift) for r in runs] == [("a", 1, ""), ("b", 0, "")]
    assert runs[0].before is fake.rounds[1] and runs[0].after is fake.rounds[2]
    assert runs[0].sim.iteration_s == 1.5  # rounds 1 (1.5) and 2 (1.5): not the thrown-away run's round 0
    # with no repeat left, the run is kept and its drift noted
    fake = _Bench(speeds=slow)
    runs = bench.measure_runs(["a", "b"], train_run=fake.train_run, take_round=fake.take_round,
                              estimate_run=_estimate(bench), drifted=_drifted(bench), repeats=0, now=fake.now)
    assert fake.trained == ["a", "b"] and [r.drift for r in runs] == ["rounds apart", ""]
    assert bench.measure_runs([], train_run=fake.train_run, take_round=fake.take_round,
                              estimate_run=_estimate(bench), drifted=_drifted(bench), repeats=0) == []
    # past the time budget no run is repeated, whatever repeats are left: the bench ends
    fake = _Bench(speeds=slow)
    runs = bench.measure_runs(["a", "b"], train_run=fake.train_run, take_round=fake.take_round,
                              estimate_run=_estimate(bench), drifted=_drifted(bench), repeats=4, now=fake.now,
                              repeat_until=fake.t + 5.0)
    assert fake.trained == ["a", "b"] and [r.drift for r in runs] == ["rounds apart", ""]


def _plan() -> ParallelPlan:
    fast, slow = Replica(gpu_type="fast", zone="r1-a"), Replica(gpu_type="slow", zone="r1-b")
    return ParallelPlan(model="tiny", global_batch_size=8,
                        stages=(Stage(first_layer=0, last_layer=2, replicas=(fast,)),
                                Stage(first_layer=3, last_layer=5, replicas=(slow,))),
                        pipelines=(PipelineBatch(microbatch_size=2, num_microbatches=4),))


def test_the_estimate_reads_the_two_rounds_and_the_book_and_nothing_else(bench):
    book, plan = tiny_book(0), _plan()
    assert bench.plan_points(plan) == {("fast", 1, 2), ("slow", 1, 2)}
    rows = [p for k in (("fast", 2, 1), ("slow", 2, 1)) for p in book.layer_profiles[k]]
    slower = [replace(p, forward_s=p.forward_s * 1.2, backward_s=p.backward_s * 1.2) for p in rows]
    est = bench.estimate(plan, book, rows, slower)
    assert est.before_s == pytest.approx(simulate(plan, book).iteration_time_s)  # the book's own profiles
    assert est.after_s > est.before_s * 1.05 and est.rounds_apart_pct == pytest.approx(
        (est.after_s - est.before_s) / est.before_s * 100)
    mean = [replace(p, forward_s=p.forward_s * 1.1, backward_s=p.backward_s * 1.1, optimizer_s=p.optimizer_s)
            for p in rows]
    assert est.iteration_s == pytest.approx(simulate(plan, bench.book_with(book, mean)).iteration_time_s)
    # the same rounds give the same estimate, whatever the book held for those points before
    other = bench.book_with(book, [replace(p, forward_s=9.0) for p in rows])
    assert bench.estimate(plan, other, rows, slower) == est
    with pytest.raises(ValueError, match="round after the run lacks"):
        bench.estimate(plan, book, rows, [p for p in slower if p.gpu_type == "fast"])


def test_drift_is_the_rounds_disagreeing_or_the_clock_moving_off_its_rounds(bench):
    rnd = [_Round(0.0, 20.0, [], 1.0), _Round(40.0, 60.0, [], 1.0)]
    steps = [(1.0, float(t)) for t in range(25, 36)]
    run = bench.Run("a", steps, 20.0, 40.0, rnd[0], rnd[1], bench.Estimate(1.0, 1.0, 1.05))
    calm = [(t / 10, 2.0) for t in range(600)]
    assert bench.clock_apart_pct(calm, run) == 0.0
    assert bench.drift(run, calm, 10.0) == ""
    slow_steps = [(t, 2.5 if 24 <= t <= 36 else 2.0) for t, _ in calm]  # the host 25 % slower during the steps
    assert bench.clock_apart_pct(slow_steps, run) == pytest.approx(25.0)
    assert "host clock 25 % off" in bench.drift(run, slow_steps, 10.0)
    assert bench.drift(run, slow_steps, 30.0) == ""
    apart = replace(run, sim=bench.Estimate(1.0, 1.0, 1.2))
    assert bench.drift(apart, calm, 10.0).startswith("rounds 20 % apart")
    assert bench.clock_apart_pct([], run) is None  # no clock: the rounds alone decide


def test_without_root_the_bench_says_it_skipped_and_exits_0(bench, monkeypatch, capsys):
    monkeypatch.setattr(bench, "testbed_support", lambda: (False, "not root"))
    assert bench.main(["--steps", "2", "--warmup", "1"]) == 0
    assert capsys.readouterr().out.startswith("skipped: needs root: not root")


# ------------------------------------------------------------------------------------------
# CFS quotas of any share (issue 26: 0.45- and 0.15-core devices crashed the bench with EINVAL)

SHARES = [0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.33, 0.4, 0.45, 0.6, 0.7, 0.9, 1.0, 1.3]


def _ratio(pq: tuple[int, int]) -> float:
    return pq[1] / pq[0]


def test_a_devices_quota_never_exceeds_its_vms_whatever_the_share_and_the_periods():
    # the kernel refuses a child cgroup's quota/period above its parent's; the VM's is set first, its
    # devices' after, each with the testbed's 10 ms or the bench's shortest periods, in either order
    for share, devices in itertools.product(SHARES, (1, 2, 3, 4)):
        vm_cores = share * devices
        for vm_short, dev_short in itertools.product((MIN_PERIOD_US, MIN_QUOTA_US), repeat=2):
            vm = cfs_period_us(vm_cores, vm_short)
            dev = cfs_period_us(vm_cores / devices, dev_short, child=True)
            assert _ratio(dev) <= _ratio(vm), (share, devices, vm, dev)
            assert vm[1] >= MIN_QUOTA_US and dev[1] >= MIN_QUOTA_US
            assert abs(_ratio(vm) - vm_cores) <= 1 / vm[0] and abs(_ratio(dev) - share) <= 1 / dev[0]
    assert cfs_period_us(0.15, MIN_QUOTA_US) == (6667, 1001)  # 1000.05 µs rounded up for the VM
    assert cfs_period_us(0.15, MIN_QUOTA_US, child=True) == (6667, 1000)  # and down for its device
    assert cfs_period_us(0.45) == cfs_period_us(0.45, child=True) == (10_000, 4500)  # exact: no rounding
    assert cfs_period_us(0.2, MIN_QUOTA_US) == cfs_period_us(0.2, MIN_QUOTA_US, child=True) == (5000, 1000)


@pytest.mark.skipif(not support_check()[0], reason="writes cgroups: needs root and the cgroup v1 cpu controller")
def test_the_kernel_takes_the_quotas_of_045_and_015_core_devices_as_the_testbed_and_the_bench_set_them():
    root = CGROUP_CPU / f"sailor-quota-test-{os.getpid()}"
    made: list[Path] = []
    try:
        for n, (share, devices) in enumerate(((0.15, 1), (0.45, 1), (0.45, 2), (0.15, 2), (0.3, 3))):
            vm = root / f"vm{n}"
            vm.mkdir(parents=True)
            made.append(vm)
            set_cpu_share(vm, share * devices)  # as the testbed builds a VM: 10 ms periods
            for i in range(devices):
                (vm / f"dev{i}").mkdir()
                made.append(vm / f"dev{i}")
                set_cpu_share(vm / f"dev{i}", share, child=True)
            set_cpu_share(vm, share * devices, MIN_QUOTA_US)  # then the bench's shortest periods
            for i in range(devices):
                set_cpu_share(vm / f"dev{i}", share, MIN_QUOTA_US, child=True)
            got = int((vm / "dev0" / "cpu.cfs_quota_us").read_text()) / int((vm / "dev0" / "cpu.cfs_period_us")
                                                                            .read_text())
            assert got == pytest.approx(share, rel=1e-3)
    finally:
        for cg in reversed([root, *made]):
            if cg.exists():
                (cg / "cpu.cfs_quota_us").write_text("-1")
        for cg in reversed(made):
            cg.rmdir()
        if root.exists():
            root.rmdir()


def test_the_table_and_the_last_line_the_checks_parse(bench, capsys):
    rnd = _Round(0.0, 5.0, [], 1.0)
    runs = [bench.Run("p", [(1.0, 10.0), (1.2, 11.2)], 5.0, 12.0, rnd, rnd, bench.Estimate(1.0, 0.95, 1.05)),
            bench.Run("p", [(1.4, 30.0)], 20.0, 31.0, rnd, rnd, bench.Estimate(1.4, 1.4, 1.4), discarded=1,
                      drift="rounds 12 % apart")]
    bench.compare({"p": _plan()}, runs, [], 10.0)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["plan", "stages", "dp", "measured", "s", "sim"]
    # measured: the median of every kept step (1.2); simulated: the mean of the runs' estimates (1.2)
    assert lines[1].split()[:6] == ["p", "2", "1", "1.200", "1.200", "+0.0"]
    assert "kept with rounds 12 % apart" in lines[1]
    assert lines[-2] == "runs: 2 kept, 1 repeated for drift over 10 %, 1 kept beyond it (no repeat left)"
    assert lines[-1] == "mean_abs_error_pct=0.0 worst_abs_error_pct=0.0 plans=1"
