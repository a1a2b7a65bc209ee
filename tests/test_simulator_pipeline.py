"""The simulator's closed-form pipeline time against an event-by-event replay of the runtime's 1F1B
schedule (engine._schedule): every batch of point-to-point operations as the runtime posts it, sends
starting when posted (one link per direction, first come first served), a waited batch ending when
its receives have arrived and its sends are delivered, deferred sends waited for at the step's end."""

from __future__ import annotations

import random

import pytest

from sailor_core.simulator import StageCompute, pipeline_time_s


def _programs(p: int, n: int) -> list[list[tuple]]:
    progs = []
    for s in range(p):
        prev, nxt = s > 0, s < p - 1
        prog: list[tuple] = []
        warm = min(p - s - 1, n)
        for m in range(warm):
            if prev:
                prog.append(("batch", [("recv", "a", m)], True))
            prog.append(("F", m))
            if nxt:
                prog.append(("batch", [("send", "a", m)], False))
        steady = n - warm
        if steady and prev:
            prog.append(("batch", [("recv", "a", warm)], True))
        for i in range(steady):
            prog.append(("F", warm + i))
            if nxt:
                prog.append(("batch", [("send", "a", warm + i), ("recv", "g", i)], True))
            prog.append(("B", i))
            ops = []
            if prev:
                ops.append(("send", "g", i))
                if i < steady - 1:
                    ops.append(("recv", "a", warm + i + 1))
            if ops:
                prog.append(("batch", ops, True))
        for m in range(steady, n):
            if nxt:
                prog.append(("batch", [("recv", "g", m)], True))
            prog.append(("B", m))
            if prev:
                prog.append(("batch", [("send", "g", m)], False))
        progs.append(prog)
    return progs


def replay_1f1b(fwd_s, bwd_s, t_act, t_grad, n) -> float:
    p = len(fwd_s)
    progs = _programs(p, n)
    arrive: dict[tuple, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    pc, clock = [0] * p, [0.0] * p
    deferred: list[list[float]] = [[] for _ in range(p)]
    posted: dict[tuple[int, int], list[float]] = {}
    while any(pc[s] < len(progs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pc[s] < len(progs[s]):
                op = progs[s][pc[s]]
                if op[0] in ("F", "B"):
                    clock[s] += fwd_s[s] if op[0] == "F" else bwd_s[s]
                    pc[s] += 1
                    moved = True
                    continue
                _, ops, wait = op
                if (s, pc[s]) not in posted:  # every operation of a batch is posted at once
                    ends = []
                    for kind, what, m in ops:
                        if kind == "send":
                            dst = s + 1 if what == "a" else s - 1
                            dur = t_act[min(s, dst)] if what == "a" else t_grad[min(s, dst)]
                            start = max(clock[s], link_free.get((s, dst), 0.0))
                            link_free[(s, dst)] = arrive[(what, s, m)] = start + dur
                            (ends if wait else deferred[s]).append(start + dur)
                    posted[(s, pc[s])] = ends
                    moved = True
                ends = list(posted[(s, pc[s])])
                missing = False
                for kind, what, m in ops:
                    if kind == "recv":
                        key = (what, s - 1 if what == "a" else s + 1, m)
                        if key not in arrive:
                            missing = True
                            break
                        ends.append(arrive[key])
                if missing:
                    break
                clock[s] = max([clock[s], *ends])
                pc[s] += 1
        assert moved, "the schedule deadlocked"
    return max(max([clock[s], *deferred[s]]) for s in range(p))


def _closed(fwd_s, bwd_s, t_act, t_grad, n) -> float:
    comp = [StageCompute(forward_s=f, backward_s=b) for f, b in zip(fwd_s, bwd_s, strict=True)]
    return pipeline_time_s(comp, list(zip(t_act, t_grad, strict=True)), n)[0]


def test_equal_stages_with_any_links() -> None:
    rng = random.Random(3)
    errs = []
    for _ in range(200):
        p, n = rng.randint(1, 5), rng.randint(1, 16)
        f, b = rng.uniform(0.1, 2), rng.uniform(0.1, 3)
        t = rng.uniform(0, 3)
        fs, bs, ta, tg = [f] * p, [b] * p, [t] * (p - 1), [t] * (p - 1)
        if n < p:
            continue  # no steady state
        ref = replay_1f1b(fs, bs, ta, tg, n)
        errs.append(abs(_closed(fs, bs, ta, tg, n) - ref) / ref)
        if t == 0 or p == 1:
            assert errs[-1] < 1e-9
    errs.sort()
    assert errs[len(errs) // 2] < 0.01
    assert errs[-1] < 0.12, errs[-5:]


def test_unequal_stages_and_links_mostly_within_a_few_percent() -> None:
    rng = random.Random(1)
    errs = []
    for _ in range(300):
        p, n = rng.randint(1, 5), rng.randint(1, 16)
        fs = [rng.uniform(0.1, 2) for _ in range(p)]
        bs = [rng.uniform(0.1, 3) for _ in range(p)]
        ta = [rng.uniform(0, 2) * rng.choice([0, 0.1, 1, 3]) for _ in range(p - 1)]
        tg = [t * rng.choice([1, 1, 0.5, 2]) for t in ta]
        ref = replay_1f1b(fs, bs, ta, tg, n)
        errs.append(abs(_closed(fs, bs, ta, tg, n) - ref) / ref)
    errs.sort()
    assert errs[len(errs) // 2] < 0.03
    assert errs[int(len(errs) * 0.9)] < 0.16
    assert errs[-1] < 0.45


def test_a_boundary_costs_its_stages_the_slower_direction_once_per_microbatch() -> None:
    # two equal stages, activation 1 s forward, gradient 2 s back, 8 microbatches: a steady cycle is
    # F + B + max(1, 2) = 5 s (the two directions travel at once), not F + B + 2 (1 + 2)
    comp = [StageCompute(forward_s=1.0, backward_s=2.0)] * 2
    total, comm, finish = pipeline_time_s(comp, [(1.0, 2.0)], 8)
    assert total == pytest.approx(replay_1f1b([1, 1], [2, 2], [1.0], [2.0], 8))
    assert total == pytest.approx(3 + 3 + 1 + 2 + 7 * 5)
    assert finish[0] == pytest.approx(total) and finish[1] == pytest.approx(total - 2 - 2)
    assert comm == pytest.approx(1 + 2 + 7 * 2)
