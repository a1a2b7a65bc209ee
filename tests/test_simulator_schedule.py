"""The planner's pruning bounds are admissible for the exact 1F1B schedule: never above the
simulated pipeline time, on thousands of random pipelines (unequal stages, links and counts)."""

from __future__ import annotations

import random

from sailor_core.planner.bounds import Floor, bound
from sailor_core.planner.request import Constraints, Objective
from sailor_core.planner.scoring import Goal
from sailor_core.simulator import StageCompute, pipeline_time_s
from sailor_core.simulator.schedule import lower_bound_1f1b, run_1f1b


def _random(rng: random.Random):
    p, n = rng.randint(1, 8), rng.randint(1, 64)
    fs = [rng.uniform(0.01, 2) * rng.choice([1, 0.1, 10]) for _ in range(p)]
    bs = [f * rng.uniform(0.5, 3) for f in fs]
    ta = [rng.uniform(0, 2) * rng.choice([0, 0.01, 1, 5]) for _ in range(p - 1)]
    tg = [t * rng.choice([1, 0.3, 3]) for t in ta]
    return fs, bs, ta, tg, n


def test_the_schedule_bound_is_never_above_the_exact_time() -> None:
    rng = random.Random(5)
    tight = 0
    for _ in range(5000):
        fs, bs, ta, tg, n = _random(rng)
        exact = run_1f1b(fs, bs, ta, tg, n)[0]
        lb = lower_bound_1f1b(fs, bs, ta, tg, n)
        assert lb <= exact * (1 + 1e-12), (fs, bs, ta, tg, n, lb, exact)
        tight += lb >= 0.9 * exact
    assert tight > 2500  # and it is a useful bound: within 10 % most of the time


def _goal() -> Goal:
    """Max throughput without limits: the bound is a time, comparable with the exact schedule's."""
    return Goal(Objective.MAX_THROUGHPUT, Constraints(), tolerance=0.005, tokens_per_iteration=64)


def test_the_sweeps_bound_is_never_above_the_exact_time_of_anything_it_prunes() -> None:
    # The sweep knows per stage the cheapest compute and messages over every option, and that the
    # bottleneck is at least tau; any pipeline of stages at least that slow runs no faster.
    rng = random.Random(9)
    goal = _goal()
    for _ in range(3000):
        fs, bs, ta, tg, _ = _random(rng)
        p = len(fs)
        best = [(f + b) * rng.uniform(0.3, 1.0) for f, b in zip(fs, bs, strict=True)]
        a_lo = [t * rng.uniform(0, 1) for t in ta]
        g_lo = [t * rng.uniform(0, 1) for t in tg]
        fill = [min(a + g, a_lo[b] + g_lo[b] + rng.uniform(0, 1) * (a + g - a_lo[b] - g_lo[b]))
                for b, (a, g) in enumerate(zip(ta, tg, strict=True))]
        reach = [0.0]
        for b in range(p - 1):
            reach.append(reach[-1] + best[b] + fill[b])
        opt = rng.uniform(0, 1)
        lb = Floor(reach=tuple(reach), best=tuple(best), act=tuple([0.0] + a_lo), grad=tuple(g_lo + [0.0]),
                    opt=opt, rate=1.0)
        tau = max(f + b for f, b in zip(fs, bs, strict=True)) * rng.uniform(0.5, 1.0)
        dp = rng.choice([1, 2, 4, 8])
        m = -(-64 // dp)
        comp = [StageCompute(forward_s=f, backward_s=b) for f, b in zip(fs, bs, strict=True)]
        exact = pipeline_time_s(comp, list(zip(ta, tg, strict=True)), m)[0] + opt
        assert bound(goal, tau, lb, 64, [dp]) <= exact * (1 + 1e-12)
