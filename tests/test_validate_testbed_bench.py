"""The testbed validation bench's pure parts: the order its plans train in, where its profile rounds fall
and how they combine (the bench itself needs root and a quarter of an hour: bench/validate_testbed.py)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest

from sailor_core.domain import LayerProfile
from tests.paths import REPO


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


def test_rounds_fall_before_between_and_after_the_plans(bench):
    assert bench.profile_points(9, 3) == {3, 8}  # before plan 0 (not listed), after plans 4 and 9
    assert bench.profile_points(9, 1) == set()
    assert bench.profile_points(4, 5) == {0, 1, 2, 3}
    assert bench.profile_points(0, 3) == set()


def test_plans_train_in_sweeps_every_other_one_backwards(bench):
    assert bench.sweep_order(["a", "b", "c"], 2) == ["a", "b", "c", "c", "b", "a"]
    assert bench.sweep_order(["a", "b"], 3) == ["a", "b", "b", "a", "a", "b"]
    assert bench.sweep_order(["a"], 0) == ["a"]
    assert bench.profile_points(18, 3) == {8, 17}  # after each sweep of 9 plans


def test_the_median_round_decides_each_point_so_one_slow_minute_does_not(bench):
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


def test_profiles_follow_the_host_speed_of_their_round_and_of_the_plan(bench, tmp_path, monkeypatch):
    # the same layer measured twice at two host speeds: at unit speed both say the same, and a plan
    # that ran at the second speed is simulated with the second round's times
    rounds = [bench.LayerRound(jobs=[], start=0.0, end=10.0), bench.LayerRound(jobs=[], start=20.0, end=30.0)]
    measured = {id(rounds[0]): [_lp(0, 1.0, 2.0)], id(rounds[1]): [_lp(0, 1.5, 3.0)]}
    monkeypatch.setattr(bench, "round_profiles", lambda model, r: measured[id(r)])
    samples = [(float(t), 1.0) for t in range(11)] + [(float(t), 1.5) for t in range(20, 31)]
    unit = bench.unit_speed_profiles("m", rounds, samples)
    assert [(p.forward_s, p.backward_s) for p in unit] == [(1.0, 2.0)]
    at = bench.at_speed(unit, 1.5)[0]
    assert (at.forward_s, at.backward_s, at.optimizer_s) == pytest.approx((1.5, 3.0, 0.15))
    # a round the clock did not see: no unit-speed profiles (the bench then uses them as measured)
    assert bench.unit_speed_profiles("m", rounds, samples[:11]) is None
