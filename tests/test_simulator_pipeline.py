"""The simulator's pipeline time against an independent event-by-event replay of the runtime's
schedules (pipeline_schedule.run_schedule): every batch of point-to-point operations as the runtime posts it, a
message moving once both its send and its receive are posted (NCCL and gloo rendezvous), a batch with
a receive waited for whole, send-only batches waited for at the step's end."""

from __future__ import annotations

import random

import pytest

from sailor_core.simulator import StageCompute, pipeline_time_s


def _programs(p: int, n: int, schedule: str) -> list[list[tuple]]:
    """Per stage, pipeline_schedule.run_schedule's ops: ("F"|"B", m) or ("batch", [(send|recv, a|g, m)], waited)."""
    progs = []
    for s in range(p):
        prev, nxt = s > 0, s < p - 1
        prog: list[tuple] = []

        def batch(ops: list[tuple], prog: list[tuple] = prog) -> None:
            if ops:
                prog.append(("batch", ops, any(k == "recv" for k, _, _ in ops)))

        if schedule == "gpipe":
            for m in range(n):
                batch([("recv", "a", m)] if prev else [])
                prog.append(("F", m))
                batch([("send", "a", m)] if nxt else [])
            for m in range(n):
                batch([("recv", "g", m)] if nxt else [])
                prog.append(("B", m))
                batch([("send", "g", m)] if prev else [])
            progs.append(prog)
            continue
        warm = min(p - s - 1, n)
        for m in range(warm):
            batch([("recv", "a", m)] if prev else [])
            prog.append(("F", m))
            batch([("send", "a", m)] if nxt else [])
        steady = n - warm
        if steady:
            batch([("recv", "a", warm)] if prev else [])
        for i in range(steady):
            prog.append(("F", warm + i))
            batch([("send", "a", warm + i), ("recv", "g", i)] if nxt else [])
            prog.append(("B", i))
            ops = []
            if prev:
                ops.append(("send", "g", i))
                if i < steady - 1:
                    ops.append(("recv", "a", warm + i + 1))
            batch(ops)
        for m in range(steady, n):
            batch([("recv", "g", m)] if nxt else [])
            prog.append(("B", m))
            batch([("send", "g", m)] if prev else [])
        progs.append(prog)
    return progs


def replay(fwd_s, bwd_s, t_act, t_grad, n, schedule="1f1b") -> tuple[float, list[float]]:
    """(the step's end, each stage's last backward end), walking every stage's ops in order."""
    p = len(fwd_s)
    progs = _programs(p, n, schedule)
    sent: dict[tuple, float] = {}  # (a|g, from stage, m) -> when its send was posted
    wanted: dict[tuple, float] = {}  # the same key -> when its receive was posted
    pc, clock, last_b = [0] * p, [0.0] * p, [0.0] * p
    posted: set[tuple[int, int]] = set()
    deferred: list[list[tuple]] = [[] for _ in range(p)]

    def arrival(key: tuple) -> float | None:
        if key not in sent or key not in wanted:
            return None
        what, src, _ = key
        dur = t_act[src] if what == "a" else t_grad[src - 1]
        return max(sent[key], wanted[key]) + dur

    while any(pc[s] < len(progs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pc[s] < len(progs[s]):
                op = progs[s][pc[s]]
                if op[0] in ("F", "B"):
                    clock[s] += fwd_s[s] if op[0] == "F" else bwd_s[s]
                    if op[0] == "B":
                        last_b[s] = clock[s]
                    pc[s] += 1
                    moved = True
                    continue
                _, ops, wait = op
                keys = []
                for kind, what, m in ops:
                    src = (s if kind == "send" else s - 1) if what == "a" else (s if kind == "send" else s + 1)
                    keys.append((what, src, m))
                if (s, pc[s]) not in posted:  # every operation of a batch is posted at once
                    posted.add((s, pc[s]))
                    for (kind, _, _), key in zip(ops, keys, strict=True):
                        (sent if kind == "send" else wanted)[key] = clock[s]
                    moved = True
                if not wait:
                    deferred[s] += keys
                    pc[s] += 1
                    continue
                ends = [arrival(k) for k in keys]
                if any(e is None for e in ends):
                    break
                clock[s] = max([clock[s], *ends])
                pc[s] += 1
        assert moved, "the schedule deadlocked"
    end = max(max([clock[s], *(arrival(k) for k in deferred[s])]) for s in range(p))
    return end, last_b


def _sim(fwd_s, bwd_s, t_act, t_grad, n, schedule="1f1b"):
    comp = [StageCompute(forward_s=f, backward_s=b) for f, b in zip(fwd_s, bwd_s, strict=True)]
    return pipeline_time_s(comp, list(zip(t_act, t_grad, strict=True)), n, schedule)


def _random_pipeline(rng: random.Random, max_n: int = 40):
    p, n = rng.randint(1, 6), rng.randint(1, max_n)
    fs = [rng.uniform(0.1, 2) * rng.choice([1, 1, 0.2, 5]) for _ in range(p)]
    bs = [f * rng.uniform(1, 3) for f in fs]
    ta = [rng.uniform(0, 2) * rng.choice([0, 0.1, 1, 3]) for _ in range(p - 1)]
    tg = [t * rng.choice([1, 1, 0.5, 2]) for t in ta]
    return fs, bs, ta, tg, n


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_simulated_schedule_is_the_runtimes_on_random_unequal_pipelines(schedule: str) -> None:
    rng = random.Random(7 if schedule == "1f1b" else 8)
    for _ in range(400):
        fs, bs, ta, tg, n = _random_pipeline(rng)
        ref, ref_last = replay(fs, bs, ta, tg, n, schedule)
        total, _, finish = _sim(fs, bs, ta, tg, n, schedule)
        assert total == pytest.approx(ref, rel=0.01), (fs, bs, ta, tg, n)
        assert total == pytest.approx(ref, rel=1e-9)  # exact, up to float rounding
        assert finish == pytest.approx(ref_last, rel=1e-9)


def test_long_pipelines_are_extended_exactly_from_their_steady_state() -> None:
    rng = random.Random(11)
    for _ in range(60):
        fs, bs, ta, tg, _ = _random_pipeline(rng)
        n = rng.randint(60, 200)
        assert _sim(fs, bs, ta, tg, n)[0] == pytest.approx(replay(fs, bs, ta, tg, n)[0], rel=1e-9)


def test_unequal_stages_overlap_their_fill_which_the_closed_form_did_not_credit() -> None:
    # a slow first stage hides a fast second one: stage 0 never waits, the step is 2 n (F0 + B0)...
    total, comm, finish = _sim([10.0, 1.0], [10.0, 1.0], [0.0], [0.0], 50)
    assert total == pytest.approx(50 * 20)
    # ... where sum (F + B) + (n - 1) max (F + B) said 1002
    assert comm == 0.0 and finish[1] < total


def test_a_boundary_costs_its_stages_the_slower_direction_once_per_microbatch() -> None:
    # two equal stages, activation 1 s forward, gradient 2 s back, 8 microbatches: the mirror batches
    # move both directions at once, a steady cycle is F + B + max(1, 2) = 5 s, not F + B + 1 + 2
    total, comm, finish = _sim([1, 1], [2, 2], [1.0], [2.0], 8)
    assert total == pytest.approx(replay([1, 1], [2, 2], [1.0], [2.0], 8)[0])
    assert total == pytest.approx(3 + 3 + 1 + 2 + 7 * 5)
    assert finish[0] == pytest.approx(total) and finish[1] == pytest.approx(total - 2 - 2)
    assert comm == pytest.approx(1 + 2 + 7 * 2)
