"""Fits of measured transfer times against message size (pure numpy, no torch).

Contract:
- `fit_bandwidth(sizes, times)` returns the store's form, a `BandwidthFit` whose bandwidth is
  bw_GBps(x) = a*u^2 + b*u + c with u = log2(x / 1e6) (the Sailor artifact's network fits, see
  ../shared/reference_data/README.md section 3), `max_bytes_per_s` the largest measured bandwidth
  and `latency_s` 0 (the quadratic carries the latency as low bandwidth at small sizes; the
  simulator reads the bandwidth alone). Fitted for the smallest worst-case relative time error,
  so a prediction off by 10% at 64 KiB counts as much as one off by 10% at 1 GiB.
- `fit_line(sizes, times)` returns the store's form of a token bucket, t = max(x / peak,
  alpha + x / beta) (`BandwidthFit` with a = b = 0, `latency_s` alpha, `max_bytes_per_s` peak), again
  for the smallest worst relative error. Alpha is negative for a shaped link that lets a burst
  through at line rate and then holds its rate, (x - burst) / rate, which no quadratic in log-size
  follows within 10 %; positive for a fixed cost per message (alpha-beta).
- `fit_alpha_beta(sizes, times)` returns the alpha-beta (Hockney) model t = alpha + x / beta,
  by relative least squares, alpha >= 0.
- `relative_errors(fit, sizes, times)` compares a fit's predicted times with the measured ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sailor_core.domain import BandwidthFit
from sailor_core.errors import SailorError

BYTES_PER_GB = 1e9  # the store's bandwidth unit is GB/s (1e9 B/s), as in the artifact
MB = 1e6  # u = log2(x / 1 MB)


@dataclass(frozen=True, kw_only=True)
class AlphaBeta:
    """Hockney model of a transfer: t(x) = latency_s + x / bandwidth_bytes_per_s."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def transfer_time_s(self, message_bytes: float) -> float:
        return self.latency_s + message_bytes / self.bandwidth_bytes_per_s


def _check_points(sizes: Sequence[float], times: Sequence[float], need: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if x.shape != t.shape or x.ndim != 1:
        raise SailorError(f"fit needs as many sizes as times, got {x.shape} and {t.shape}")
    if len(np.unique(x)) < need:
        raise SailorError(
            f"fit needs at least {need} distinct message sizes, got {len(np.unique(x))}; "
            f"to fix: widen the size range (smaller --min-bytes or larger --max-bytes)"
        )
    if not (np.all(x > 0) and np.all(t > 0) and np.all(np.isfinite(t))):
        raise SailorError("fit needs positive sizes and positive finite times")
    return x, t


def fit_bandwidth(sizes: Sequence[float], times: Sequence[float], lawson_iters: int = 60) -> BandwidthFit:
    """The store's quadratic bw_GBps(u), u = log2(x / 1e6), fitted for the worst relative time error.

    A profile is judged by how well it predicts each transfer (the simulator computes x / bw(x)),
    so the quadratic minimises max_i |t_pred_i - t_i| / t_i over the measured sizes: Lawson's
    iteratively reweighted least squares, which converges to that minimax (Chebyshev) fit, started
    from the relative least-squares fit (weights 1/bw). `latency_s` stays 0: the simulator reads the
    bandwidth only, so the quadratic has to carry the latency-bound small sizes itself.
    """
    x, t = _check_points(sizes, times, need=3)
    u = np.log2(x / MB)
    bw_gbps = x / t / BYTES_PER_GB
    coeffs = _minimax_quadratic(u, bw_gbps, lawson_iters)
    return BandwidthFit(coeffs=coeffs, max_bytes_per_s=float(np.max(x / t)), latency_s=0.0)


def fit_line(sizes: Sequence[float], times: Sequence[float], lawson_iters: int = 60) -> BandwidthFit:
    """A shaped link as a token bucket, for the smallest worst relative time error over the measured sizes:
    t(x) = max(x / peak, alpha + x / beta), where peak is the largest measured bandwidth (a message
    inside the burst leaves at it) and the line alpha + x / beta (alpha < 0 for a burst) holds beyond the
    burst. The line is the minimax line of the sizes from some k on (Lawson's reweighted least squares on
    (alpha + x / beta) / t - 1, linear in alpha and 1 / beta); every k is tried and the model that
    predicts all sizes best is kept. As a `BandwidthFit`: the constant quadratic beta, `latency_s`
    alpha and `max_bytes_per_s` peak, which `BandwidthFit.bandwidth_bytes_per_s` reads as this max."""
    x, t = _check_points(sizes, times, need=2)
    order = np.argsort(x)
    x, t = x[order], t[order]
    peak = float(np.max(x / t))
    best: tuple[float, float, float] | None = None  # (worst error over all sizes, alpha, 1 / beta)
    for k in range(len(x) - 1):
        line = _minimax_line(x[k:], t[k:], lawson_iters)
        if line is None:
            continue
        alpha, g = line
        pred = np.maximum(x / peak, alpha + g * x)
        worst = float(np.max(np.abs(pred / t - 1.0)))
        if best is None or worst < best[0]:
            best = (worst, alpha, g)
    if best is None:
        raise SailorError("a line fit gave a non-positive bandwidth; the measurements are too noisy to fit")
    _, alpha, g = best
    return BandwidthFit(coeffs=(0.0, 0.0, 1.0 / g / BYTES_PER_GB), max_bytes_per_s=peak, latency_s=alpha)


def _minimax_line(x: np.ndarray, t: np.ndarray, iters: int) -> tuple[float, float] | None:
    """(alpha, g) minimising max |(alpha + g x) / t - 1| with g > 0, or None when no round gives g > 0."""
    design = np.stack([1.0 / t, x / t], axis=1)
    weights = np.full(len(x), 1.0 / len(x))
    best: tuple[float, float, float] | None = None
    for _ in range(max(1, iters)):
        sw = np.sqrt(np.maximum(weights, 1e-12))
        sol, *_ = np.linalg.lstsq(design * sw[:, None], sw, rcond=None)
        rel = np.abs(design @ sol - 1.0)
        worst = float(np.max(rel))
        if sol[1] > 0 and (best is None or worst < best[0]):
            best = (worst, float(sol[0]), float(sol[1]))
        total = float(np.sum(weights * rel))
        if worst == 0 or total <= 0 or not np.isfinite(total):
            break
        weights = weights * rel / total
    return None if best is None else (best[1], best[2])


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> AlphaBeta:
    x, t = _check_points(sizes, times, need=2)
    # Relative residuals: (alpha + g*x - t) / t, linear in (alpha, g) with g = 1/beta.
    design = np.stack([1.0 / t, x / t], axis=1)
    (alpha, g), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:  # a negative latency is unphysical: refit the bandwidth alone
        alpha = 0.0
        g = float(np.sum(x / t) / np.sum((x / t) ** 2))
    if g <= 0:
        raise SailorError("alpha-beta fit gave a non-positive bandwidth; the measurements are too noisy to fit")
    return AlphaBeta(latency_s=float(alpha), bandwidth_bytes_per_s=float(1.0 / g))


def relative_errors(predict: Callable[[float], float], sizes: Sequence[float], times: Sequence[float]) -> list[float]:
    """(predicted - measured) / measured per size; `predict` maps bytes to seconds."""
    return [(predict(float(x)) - float(t)) / float(t) for x, t in zip(sizes, times, strict=True)]


def max_abs(errors: Sequence[float]) -> float:
    return max((abs(e) for e in errors), default=math.nan)


def _minimax_quadratic(u: np.ndarray, y: np.ndarray, iters: int) -> tuple[float, float, float]:
    """Quadratic p in u minimising max |y / p - 1| (the relative error of the time x / p), by Lawson's
    iteratively reweighted least squares started from the relative least-squares fit."""
    weights = np.full(len(u), 1.0 / len(u))
    scale = y.copy()  # |p - y| / p ~ |p - y| / y near the solution; refreshed with p each round
    best: tuple[float, np.ndarray] | None = None
    for _ in range(max(1, iters)):
        # Weights never reach zero: a point fitted exactly once must still hold its place later.
        sw = np.sqrt(np.maximum(weights, 1e-12)) / scale
        vander = np.stack([u * u, u, np.ones_like(u)], axis=1)
        coeffs, *_ = np.linalg.lstsq(vander * sw[:, None], y * sw, rcond=None)
        p = vander @ coeffs
        if np.any(p <= 0):
            rel = np.abs(p - y) / y  # a non-positive bandwidth: steer back with the bandwidth error
        else:
            rel = np.abs(y / p - 1.0)
            scale = p
        worst = float(np.max(rel))
        if best is None or worst < best[0]:
            best = (worst, coeffs)
        if worst == 0:
            break
        weights = weights * rel
        total = float(np.sum(weights))
        if total <= 0 or not np.isfinite(total):
            break
        weights = weights / total
    assert best is not None
    a, b, c = best[1]
    return float(a), float(b), float(c)
