"""Profiler: fits, the repeat-until-stable rule, settings validation, and activation memory measured
in-process against the model spec (no worker processes; see test_profiler_workers.py for those)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sailor_core.domain import BandwidthFit
from sailor_core.errors import SailorError
from sailor_core.models.config import get_config, model_spec
from sailor_core.profiler.fit import fit_alpha_beta, fit_bandwidth, fit_line, max_abs, relative_errors
from sailor_core.profiler.layers import ModelProfileSettings, layer_worker
from sailor_core.profiler.network import NetworkSettings, best_fit
from sailor_core.profiler.timing import Measurement, RepeatPolicy, StopRule, measure

SIZES = [65536 * 2**i for i in range(15)]  # 64 KiB .. 1 GiB, the range
FAST = RepeatPolicy(warmup=1, min_reps=3, max_reps=5, rel_err=0.5, time_cap_s=0.2)


# -- fits ----------------------------------------------------------------------------------------


def test_quadratic_bandwidth_is_recovered_exactly():
    a, b, c = -0.02, 0.4, 3.0  # GB/s, the store's form in u = log2(x / 1e6)
    u = np.log2(np.array(SIZES) / 1e6)
    times = np.array(SIZES) / ((a * u * u + b * u + c) * 1e9)
    fit = fit_bandwidth(SIZES, times)
    assert fit.coeffs == pytest.approx((a, b, c), rel=1e-6)
    assert fit.latency_s == 0.0
    assert fit.max_bytes_per_s == pytest.approx(float(np.max(np.array(SIZES) / times)))
    assert max_abs(relative_errors(fit.transfer_time_s, SIZES, times)) < 1e-6


@pytest.mark.parametrize("latency_s", [5e-6, 30e-6])
def test_latency_bound_link_fits_within_15_percent(latency_s):
    # An alpha-beta link is not quadratic in log-size; the minimax fit must still stay within 15%.
    times = [latency_s + x / 5e9 for x in SIZES]
    fit = fit_bandwidth(SIZES, times)
    assert max_abs(relative_errors(fit.transfer_time_s, SIZES, times)) < 0.15


def test_minimax_fit_beats_plain_least_squares_on_worst_error():
    times = [40e-6 + x / 3e9 for x in SIZES]
    x = np.array(SIZES, dtype=float)
    u = np.log2(x / 1e6)
    bw = x / np.array(times) / 1e9
    ls = np.polyfit(u, bw, 2, w=1 / bw)
    ls_err = np.max(np.abs(x / (np.polyval(ls, u) * 1e9) / np.array(times) - 1))
    fit = fit_bandwidth(SIZES, times)
    assert max_abs(relative_errors(fit.transfer_time_s, SIZES, times)) < ls_err


def test_alpha_beta_recovers_latency_and_bandwidth():
    times = [20e-6 + x / 2e9 for x in SIZES]
    ab = fit_alpha_beta(SIZES, times)
    assert ab.latency_s == pytest.approx(20e-6, rel=1e-6)
    assert ab.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)


# A shaped link (tc htb) lets a burst through at the line rate, then holds its rate: the testbed's
# 12.5 MB/s links measured 21.8 MB/s at 64 KiB and 12.1 MB/s at 4 MiB (a burst of about 29 KB).
SHAPED = [65536 * 2**i for i in range(7)]  # 64 KiB .. 4 MiB, what `sailor profile link` sweeps on CPU


def _bucket_s(x: float, burst: float = 29e3, rate: float = 12.5e6, line: float = 400e6) -> float:
    return max(x / line, 0.2e-3 + (x - burst) / rate)


def test_token_bucket_link_is_fitted_as_its_burst_and_rate():
    times = [_bucket_s(x) for x in SHAPED]
    fit = fit_line(SHAPED, times)
    assert fit.coeffs[2] * 1e9 == pytest.approx(12.5e6, rel=1e-6)  # the rate
    assert fit.latency_s == pytest.approx(0.2e-3 - 29e3 / 12.5e6, rel=1e-6)  # minus the burst's worth
    assert max_abs(relative_errors(fit.transfer_time_s, SHAPED, times)) < 1e-6
    # beyond the measured sizes the rate holds, and the message a pipeline sends (256 KiB) is hand-checked
    assert fit.transfer_time_s(64 << 20) == pytest.approx((64 << 20) / 12.5e6 + 0.2e-3 - 29e3 / 12.5e6)
    # 0.2 ms + (262144 - 29000) B at 12.5 MB/s
    assert fit.transfer_time_s(256 << 10) * 1e3 == pytest.approx(18.85, abs=0.01)
    # the store's quadratic in log-size misses it by more than 5 % (13 % once pinned to the rate beyond
    # the measured sizes, as the profiler does), so the profiler keeps the line
    quad = fit_bandwidth(SHAPED, times)
    assert max_abs(relative_errors(quad.transfer_time_s, SHAPED, times)) > 0.05
    assert best_fit(SHAPED, times) == fit


def test_inside_the_burst_a_transfer_takes_the_peak_bandwidth():
    # the burst ends at 29 KB + 0.2 ms x rate: a message inside it leaves at the measured peak
    times = [_bucket_s(x, burst=300e3) for x in SHAPED]
    fit = fit_line(SHAPED, times)
    assert max_abs(relative_errors(fit.transfer_time_s, SHAPED, times)) < 1e-6
    assert fit.bandwidth_bytes_per_s(4096) == fit.max_bytes_per_s == pytest.approx(400e6)
    assert fit.transfer_time_s(4096) == pytest.approx(4096 / 400e6)


def test_a_bending_curve_keeps_the_quadratic():
    a, b, c = -0.02, 0.4, 3.0
    u = np.log2(np.array(SIZES) / 1e6)
    times = list(np.array(SIZES) / ((a * u * u + b * u + c) * 1e9))
    assert best_fit(SIZES, times).coeffs == pytest.approx((a, b, c), rel=1e-6)


def test_a_fit_with_a_latency_never_reads_above_its_peak_nor_below_zero():
    fit = BandwidthFit(coeffs=(0.0, 0.0, 0.0125), max_bytes_per_s=21e6, latency_s=-2.3e-3)
    for x in (1, 4096, 29e3, 64 << 10, 1 << 20, 1 << 30):
        assert 0 < fit.bandwidth_bytes_per_s(x) <= 21e6
        assert fit.transfer_time_s(x) > 0
    plain = BandwidthFit(coeffs=(0.0, 0.0, 0.0125), max_bytes_per_s=21e6, latency_s=1e-3)
    assert plain.transfer_time_s(1 << 20) == pytest.approx(1e-3 + (1 << 20) / 12.5e6)


def test_fit_needs_three_sizes():
    with pytest.raises(SailorError, match="at least 3 distinct message sizes"):
        fit_bandwidth([1e6, 2e6], [1e-3, 2e-3])


# -- repeat until stable ---------------------------------------------------------------------------


def test_warmup_is_excluded_and_constant_samples_stop_at_min_reps():
    samples = iter([5.0, 4.0] + [1.0] * 100)
    m = measure(lambda: next(samples), RepeatPolicy(warmup=2, min_reps=5, max_reps=50, rel_err=0.01, time_cap_s=60))
    assert m.reps == 5 and m.samples == (1.0,) * 5 and m.stable


def test_noisy_samples_stop_at_max_reps_unstable():
    rng = np.random.default_rng(0)
    m = measure(
        lambda: float(rng.lognormal(0, 1)), RepeatPolicy(warmup=0, min_reps=3, max_reps=20, rel_err=1e-4, time_cap_s=60)
    )
    assert m.reps == 20 and not m.stable


def test_time_cap_stops_repetitions():
    clock = iter(range(1000))
    rule = StopRule(
        RepeatPolicy(warmup=0, min_reps=2, max_reps=100, rel_err=1e-9, time_cap_s=5), clock=lambda: next(clock)
    )
    n = 0
    while True:
        rule.add(float(n % 2 + 1))
        n += 1
        if rule.done():
            break
    assert 2 <= n < 10


def test_quantiles():
    m = Measurement.of([4.0, 1.0, 3.0, 2.0], rel_err=0.1)
    assert m.quantile_s(0.0) == 1.0 and m.median_s == 2.5 and m.quantile_s(1.0) == 4.0
    assert m.quantile_s(0.5) == pytest.approx(2.5)


def test_named_statistics_and_a_clear_error_for_an_unknown_one():
    m = Measurement.of([4.0, 1.0, 3.0, 2.0, 10.0], rel_err=0.1)
    assert m.stat_s("mean") == pytest.approx(4.0) and m.stat_s("median") == 3.0
    assert m.stat_s("p0") == 1.0 and m.stat_s("p25") == 2.0 and m.stat_s("p100") == 10.0
    for bad in ("average", "p", "p101", "q10"):
        with pytest.raises(SailorError, match="mean, median or a percentile"):
            m.stat_s(bad)
    with pytest.raises(SailorError, match="unknown statistic 'avg'"):
        ModelProfileSettings(model="gpt-tiny", statistic="avg").validate()
    with pytest.raises(SailorError, match="unknown statistic 'p200'"):
        NetworkSettings(statistic="p200").validate()


# -- settings -------------------------------------------------------------------------------------


def test_unknown_model_is_a_clear_error():
    with pytest.raises(SailorError, match="unknown model 'nope'.*gpt-tiny"):
        ModelProfileSettings(model="nope").validate()


def test_tp_larger_than_the_node_is_a_clear_error():
    with pytest.raises(SailorError, match="TP degree 8 is larger than this node.*to fix"):
        ModelProfileSettings(model="gpt-tiny", tp=(1, 8)).validate()


def test_tp_that_does_not_split_heads_is_refused():
    with pytest.raises(SailorError, match="num_heads=4 is not divisible by tp=3"):
        ModelProfileSettings(model="gpt-tiny", tp=(3,)).validate()


def test_cuda_without_a_gpu_is_refused():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SailorError, match="no CUDA GPU"):
        ModelProfileSettings(model="gpt-tiny", device="cuda").validate()


def test_network_sizes_and_validation():
    s = NetworkSettings(min_bytes=64 * 1024, max_bytes=1 << 30)
    assert s.sizes()[0] == 65536 and s.sizes()[-1] == 1 << 30 and len(s.sizes()) == 15
    assert NetworkSettings().resolved_max_bytes() == 64 << 20  # CPU default
    with pytest.raises(SailorError, match="too few"):
        NetworkSettings(min_bytes=1 << 20, max_bytes=2 << 20).sizes()
    with pytest.raises(SailorError, match="at least 2 workers"):
        NetworkSettings(workers=1).validate()


def test_collapsed_blocks_measure_a_few_and_all_blocks_measures_every_one():
    cfg = get_config("gpt-small")
    assert ModelProfileSettings(model="gpt-small").measured_layers(cfg) == [0, 1, 2, cfg.num_layers - 1]
    assert ModelProfileSettings(model="gpt-small", all_blocks=True).measured_layers(cfg) == list(range(cfg.num_layers))


# -- activation memory: what torch saves for backward vs the model spec ----------------------------


@pytest.mark.parametrize("model", ["gpt-tiny", "gpt-small"])
def test_saved_activation_bytes_match_the_spec_within_10_percent(model):
    """The layer worker (tp=1, in this process) hooks torch's saved tensors; every layer, at two
    microbatch sizes, must agree with the analytic spec the planner and simulator use."""
    pytest.importorskip("torch")
    msgs: list[dict] = []
    settings = ModelProfileSettings(model=model, mbs=(1, 2), policy=FAST, blocks=1)
    layer_worker(0, 1, "", msgs.append, settings)
    points = [m["point"] for m in msgs if m["kind"] == "point"]
    spec = model_spec(get_config(model), (1,))
    assert {(p.mbs, p.layer) for p in points} == {
        (m, i) for m in (1, 2) for i in settings.measured_layers(get_config(model))
    }
    for p in points:
        expected = spec.layer(p.layer, 1).act_memory_bytes * p.mbs
        assert p.saved_bytes == pytest.approx(expected, rel=0.10), (p.mbs, p.layer, p.saved_bytes, expected)
        assert p.forward.median_s > 0 and p.backward.median_s > 0 and math.isfinite(p.forward.median_s)
    overhead = [m for m in msgs if m["kind"] == "overhead"]
    assert overhead and overhead[0]["bytes"] > 50e6  # torch alone holds more than that
    opt = [m for m in msgs if m["kind"] == "optimizer"]
    assert opt and opt[0]["seconds"] > 0
