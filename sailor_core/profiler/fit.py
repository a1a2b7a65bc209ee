"""Fits of measured transfer times against message size (pure numpy, no torch).

Contract:
- `fit_bandwidth(sizes, times)` returns the store's form, a `BandwidthFit` whose bandwidth is
  bw_GBps(x) = a*u^2 + b*u + c with u = log2(x / 1e6) (the Sailor artifact's network fits, see
  ../shared/reference_data/README.md section 3), `max_bytes_per_s` the largest measured bandwidth
  and `latency_s` 0 (the quadratic carries the latency as low bandwidth at small sizes; the
  simulator reads the bandwidth alone). Fitted for the smallest worst-case relative time error,
  so a prediction off by 10% at 64 KiB counts as much as one off by 10% at 1 GiB.
- `fit_alpha_beta(sizes, times)` returns the alpha-beta (Hockney) model t = alpha + x / beta,
  again by relative least squares, alpha >= 0.
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
