"""One pipeline's step as our runtime runs it (pipeline_schedule.run_schedule), event by event, and a lower bound on it.

Contract: `run_1f1b(fwd_s, bwd_s, act_s, grad_s, n)` and `run_gpipe(...)` return (seconds until the
first stage ends its last backward, when each stage ends its last backward) for stage compute
fwd_s[s] / bwd_s[s] per microbatch and one-way message times act_s[b] (activation b -> b+1) and
grad_s[b] (gradient b+1 -> b). `lower_bound_1f1b` is never above `run_1f1b` for the same inputs
(tests/test_simulator_schedule.py checks it on thousands of random pipelines); the planner prunes
with its terms.

The model of one exchange (both torch backends the runtime uses, NCCL and gloo, rendezvous a send
with its receive: gloo's tcp pair holds a send until the peer says its receive is posted; an NCCL
send kernel moves data only once the receive kernel runs):

- every point-to-point operation is posted in a batch (`dist.batch_isend_irecv`) in the schedule's
  order; a message moves when both its send and its receive are posted and takes its one-way time
  (`boundary_p2p_s`: the runtime's slices and the receivers' all-gather);
- a batch with a receive is waited for whole (its sends too); a send-only batch is not (the runtime
  waits for those works at the end of the step, after every later message has already depended on
  them);
- every batch of our 1F1B talks to one neighbour, so each boundary is a sequence of meetings of a
  batch on either side, in program order: (send-only, receive) pairs in the warm-up and the drain,
  and mirror batches {send activation, receive gradient} / {send gradient, receive next
  activation} in the steady state, which end together at max(posts) + max(act, grad).

Speed: the steady state is a max-plus linear map from one 1F1B step of every stage to the next. Once
the stages' step starts move by one common lambda between two consecutive steps they do so for
every later step (linearity), so a long pipeline is run for `n0` microbatches and extended by
(n - n0) x lambda, exactly; if no such step shows up (`_TRY_STEPS`) it is run in full.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

_F, _B, _SEND, _RECV, _MIRROR = 0, 1, 2, 3, 4
_LEFT, _RIGHT = 0, 1
# The steady state is tried with (k x stages + 1) more microbatches than the warm-up needs, for each k
# here, before the pipeline is run in full: the last stage runs ahead of the first for up to a stage
# count of steps, and the transient after that is short (algorithmic choice; any value is exact,
# these only decide how much is run).
_TRY_STEPS = (1, 3)
_SHIFT_TOL = 1e-9  # relative: consecutive steps moving by one lambda (float rounding only)


@lru_cache(maxsize=4096)
def programs_1f1b(p: int, n: int) -> tuple[tuple[tuple[int, int, int, bool], ...], ...]:
    """Per stage, its ops in pipeline_schedule.run_schedule's order: (kind, side, meeting index on that side,
    starts a steady step). Kinds: forward, backward, send-only batch, receive-only batch, mirror batch."""
    progs = []
    for s in range(p):
        prev, nxt = s > 0, s < p - 1
        k = [0, 0]  # meetings so far on the left and right boundary
        ops: list[tuple[int, int, int, bool]] = []

        def meet(kind: int, side: int, ops: list[tuple[int, int, int, bool]] = ops, k: list[int] = k) -> None:
            ops.append((kind, side, k[side], False))
            k[side] += 1

        warm = min(p - s - 1, n)
        for _ in range(warm):
            if prev:
                meet(_RECV, _LEFT)
            ops.append((_F, 0, 0, False))
            if nxt:
                meet(_SEND, _RIGHT)
        steady = n - warm
        if steady and prev:
            meet(_RECV, _LEFT)
        for i in range(steady):
            ops.append((_F, 0, 0, True))
            if nxt:
                meet(_MIRROR, _RIGHT)
            ops.append((_B, 0, 0, False))
            if prev:
                meet(_MIRROR if i < steady - 1 else _SEND, _LEFT)
        for _ in range(steady, n):
            if nxt:
                meet(_RECV, _RIGHT)
            ops.append((_B, 0, 0, False))
            if prev:
                meet(_SEND, _LEFT)
        progs.append(tuple(ops))
    return tuple(progs)


# A 1F1B walk as straight-line steps over numbers (`_trace_1f1b`): add a stage's forward or backward to its
# clock, post its clock for a meeting, meet (the later of its clock and the peer's post, plus the exchange's
# time), or mark the start of a steady step.
_ADD_F, _ADD_B, _POST, _MEET, _MARK = 0, 1, 2, 3, 4
# A (p, n) walk is interpreted until it has been asked for this many times, then compiled to one Python
# function: compiling costs about 100-130 interpreted walks of the same (p, n) and the compiled walk runs
# 3-4x faster (measured for 5 to 26 stages); most (p, n) of one search are asked for a handful of times,
# the few long-pipeline extrapolations (2p and 4p microbatches) thousands of times.
_COMPILE_AFTER = 16
_TRACE_CALLS: dict[tuple[int, int], int] = {}


@lru_cache(maxsize=4096)
def _trace_1f1b(p: int, n: int) -> tuple[tuple[int, int, int, int], ...]:
    """The 1F1B walk of p stages and n microbatches as steps (op, stage, a, b) over the durations.

    Which batch waits for which is a property of the schedule, not of the durations, so the walk is
    done once per (p, n): every meeting becomes `clock = max(own clock, peer's post) + its time`, in
    an order where every post comes before the meeting that reads it. _MEET's a is the post it reads,
    b the exchange's time: A[bb] at b = bb, G[bb] at p - 1 + bb, X[bb] (mirror) at 2 (p - 1) + bb."""
    progs = programs_1f1b(p, n)
    post_l: list[dict[int, int]] = [{} for _ in range(max(p - 1, 0))]  # boundary b: stage b's posts
    post_r: list[dict[int, int]] = [{} for _ in range(max(p - 1, 0))]  # boundary b: stage b+1's posts
    pc = [0] * p
    posted = [False] * p  # whether stage s already posted for the meeting it waits at
    steps: list[tuple[int, int, int, int]] = []
    slots = 0
    left = p
    while left:
        moved = False
        for s in range(p):
            prog = progs[s]
            i, end = pc[s], len(prog)
            if i == end:
                continue
            while i < end:
                kind, side, k, mark = prog[i]
                if kind == _F:
                    if mark:
                        steps.append((_MARK, s, 0, 0))
                    steps.append((_ADD_F, s, 0, 0))
                elif kind == _B:
                    steps.append((_ADD_B, s, 0, 0))
                else:
                    bb = s if side == _RIGHT else s - 1
                    mine, theirs = (post_l[bb], post_r[bb]) if side == _RIGHT else (post_r[bb], post_l[bb])
                    if kind in (_SEND, _MIRROR) and not posted[s]:
                        mine[k] = slots
                        steps.append((_POST, s, slots, 0))
                        slots += 1
                        posted[s] = True
                    if kind != _SEND:
                        other = theirs.get(k)
                        if other is None:
                            break
                        dur = 2 * (p - 1) + bb if kind == _MIRROR else (bb if side == _LEFT else p - 1 + bb)
                        steps.append((_MEET, s, other, dur))
                    posted[s] = False
                i += 1
            if i != pc[s]:
                moved = True
            pc[s] = i
            if i == end:
                left -= 1
        if not moved:
            raise RuntimeError(f"1F1B schedule of {p} stages and {n} microbatches deadlocked")
    return tuple(steps)


def _run_trace(steps: Sequence[tuple[int, int, int, int]], p: int, F: Sequence[float], B: Sequence[float],
               dur: Sequence[float]) -> tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]:
    """(each stage's end, each stage's steady-step starts) of a `_trace_1f1b` walk, interpreted."""
    clock = [0.0] * p
    post: list[float] = []
    starts: list[list[float]] = [[] for _ in range(p)]
    for op, s, a, b in steps:
        if op == _MEET:
            c, o = clock[s], post[a]
            clock[s] = (c if c > o else o) + dur[b]
        elif op == _ADD_F:
            clock[s] += F[s]
        elif op == _ADD_B:
            clock[s] += B[s]
        elif op == _POST:
            post.append(clock[s])
        else:
            starts[s].append(clock[s])
    return tuple(clock), tuple(tuple(r) for r in starts)


@lru_cache(maxsize=512)
def _compiled_1f1b(p: int, n: int) -> Callable[..., tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]]:
    """The `_trace_1f1b` walk as one straight-line Python function of (F, B, dur): each stage's clock is
    a sum of durations since its last meeting, and each meeting one line."""
    clock = ["0.0"] * p
    starts: list[list[str]] = [[] for _ in range(p)]
    lines: list[str] = []
    for i, (op, s, a, b) in enumerate(_trace_1f1b(p, n)):
        if op == _ADD_F:
            clock[s] = f"{clock[s]} + F[{s}]"
        elif op == _ADD_B:
            clock[s] = f"{clock[s]} + B[{s}]"
        elif op == _POST:
            lines.append(f"    p{a} = {clock[s]}")
            clock[s] = f"p{a}"
        elif op == _MEET:
            lines.append(f"    a = {clock[s]}; b = p{a}; v{i} = (a if a > b else b) + D[{b}]")
            clock[s] = f"v{i}"
        else:
            lines.append(f"    m{i} = {clock[s]}")
            clock[s] = f"m{i}"
            starts[s].append(f"m{i}")
    ends = ", ".join(clock)
    rows = ", ".join("(" + "".join(f"{x}, " for x in row) + ")" for row in starts)
    src = "def run(F, B, D):\n" + "\n".join(lines) + f"\n    return ({ends},), ({rows},)\n"
    scope: dict[str, object] = {}
    exec(compile(src, f"<1f1b p={p} n={n}>", "exec"), scope)  # noqa: S102 - code generated above, no input
    return scope["run"]  # type: ignore[return-value]


def _walk_1f1b(
    fwd_s: Sequence[float], bwd_s: Sequence[float], act_s: Sequence[float], grad_s: Sequence[float], n: int,
) -> tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]:
    """(each stage's end, each stage's steady-step start times) of n microbatches: interpreted, or compiled
    once the same (p, n) has been asked for `_COMPILE_AFTER` times."""
    p = len(fwd_s)
    dur = [*act_s, *grad_s, *(max(a, g) for a, g in zip(act_s, grad_s, strict=True))]
    key = (p, n)
    calls = _TRACE_CALLS.get(key, 0)
    if calls >= _COMPILE_AFTER:
        return _compiled_1f1b(p, n)(fwd_s, bwd_s, dur)
    _TRACE_CALLS[key] = calls + 1
    return _run_trace(_trace_1f1b(p, n), p, fwd_s, bwd_s, dur)


def _common_shift(starts: Sequence[Sequence[float]], steps: int) -> float | None:
    """lambda if some two consecutive steady steps (both before the first stage's last) move every
    stage by the same lambda, else None."""
    for i in range(steps - 1):
        ds = [row[i + 1] - row[i] for row in starts]
        lo, hi = min(ds), max(ds)
        if hi - lo <= _SHIFT_TOL * max(1.0, abs(hi)):
            return hi
    return None


def run_1f1b(
    fwd_s: Sequence[float], bwd_s: Sequence[float], act_s: Sequence[float], grad_s: Sequence[float], n: int,
) -> tuple[float, list[float]]:
    """(pipeline seconds, when each stage ends its last backward) of pipeline_schedule.run_schedule's 1F1B."""
    p = len(fwd_s)
    for times in _TRY_STEPS:
        extra = times * p + 1
        n0 = p - 1 + extra
        if n <= n0:
            break
        ends, starts = _walk_1f1b(fwd_s, bwd_s, act_s, grad_s, n0)
        lam = _common_shift(starts, extra)
        if lam is not None:
            ext = (n - n0) * lam
            return ends[0] + ext, [e + ext for e in ends]
    ends, _ = _walk_1f1b(fwd_s, bwd_s, act_s, grad_s, n)
    return ends[0], list(ends)


def run_gpipe(
    fwd_s: Sequence[float], bwd_s: Sequence[float], act_s: Sequence[float], grad_s: Sequence[float], n: int,
) -> tuple[float, list[float]]:
    """(pipeline seconds, when each stage ends its last backward) of pipeline_schedule.run_schedule's GPipe: per
    microbatch a waited receive, the compute, a send not waited for. A receive is posted when the
    previous microbatch's compute is done, so a message moves at max(sent, receive posted):

        F_end(s, m) = max(F_end(s-1, m), F_end(s, m-1)) + act(s-1) + F_s
        B_end(s, m) = max(B_end(s+1, m), B_end(s, m-1)) + grad(s) + B_s,  B_end(s, -1) = F_end(s, n-1)
    """
    p = len(fwd_s)
    row = [0.0] * p  # F_end(s, m - 1)
    for _ in range(n):
        up = row[0] + fwd_s[0]
        row[0] = up
        for s in range(1, p):
            mine = row[s]
            up = (up if up > mine else mine) + act_s[s - 1] + fwd_s[s]
            row[s] = up
    for _ in range(n):  # backward, from the last stage down
        down = row[p - 1] + bwd_s[p - 1]
        row[p - 1] = down
        for s in range(p - 2, -1, -1):
            mine = row[s]
            down = (down if down > mine else mine) + grad_s[s] + bwd_s[s]
            row[s] = down
    return row[0], row


def lower_bound_1f1b(
    fwd_s: Sequence[float], bwd_s: Sequence[float], act_s: Sequence[float], grad_s: Sequence[float], n: int,
) -> float:
    """A lower bound on `run_1f1b`: for every stage b,

        T >= sum_{k<b} (F_k + act_k + grad_k + B_k) + n (F_b + B_b) + max(waits_b, idle_b)

    Microbatch 0 reaches b after the forwards and sends before it; b then computes n forwards and
    backwards, and after its last backward the gradient still crosses every boundary and stage below
    it. Beside its compute, b is held at least max(waits_b, idle_b) (`held_s`): each of its n batches
    with its left neighbour (a receive or a mirror) lasts at least that boundary's activation time
    after it is posted, one of them already counted in the reach, and each of its n waited batches
    with its right neighbour at least the gradient's time (waits_b); or, from the stages after it,
    the time b idles while microbatch 0, and later microbatch n - 1, go down the rest of the pipeline
    and back (idle_b)."""
    p = len(fwd_s)
    tail = [0.0] * p  # tail[b]: the stages after b and the sends between, both ways, for one microbatch
    for b in range(p - 2, -1, -1):
        tail[b] = tail[b + 1] + fwd_s[b + 1] + bwd_s[b + 1] + act_s[b] + grad_s[b]
    best = 0.0
    prefix = 0.0
    for b in range(p):
        waits = (n - 1) * act_s[b - 1] if b > 0 else 0.0
        if b < p - 1:
            waits += n * grad_s[b]
        held = held_s(waits, tail[b], fwd_s[b], bwd_s[b], p - 1 - b, n)
        best = max(best, prefix + n * (fwd_s[b] + bwd_s[b]) + held)
        if b < p - 1:
            prefix += fwd_s[b] + bwd_s[b] + act_s[b] + grad_s[b]
    return best


def held_s(waits: float, tail: float, fwd: float, bwd: float, after: int, n: int) -> float:
    """The least time a stage with `after` stages after it (and `tail` seconds of their compute and sends
    for one microbatch, both ways) is held beside its n forwards and backwards: its neighbours' messages
    (`waits`), or the idle 1F1B leaves it. Its first backward waits for microbatch 0 to go down the tail
    and back, while it runs w = min(after, n - 1) more forwards; its last backward waits the same for
    microbatch n - 1 after its last forward, while it runs w backwards. The two waits are apart when its
    last forward comes after its first backward (n - 1 > after), else the longer one counts."""
    w = min(after, n - 1)
    first, last = max(0.0, tail - w * fwd), max(0.0, tail - w * bwd)
    return max(waits, first + last if n - 1 > after else max(first, last))


# -- DeepSpeed's pipeline engine (the published runs' framework) ---------------------------------------
_DS_F, _DS_B, _DS_SEND, _DS_RECV = 0, 1, 2, 3


@lru_cache(maxsize=1024)
def programs_deepspeed(p: int, n: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each stage's instruction stream under DeepSpeed's TrainSchedule (1F1B), as (op, peer) pairs: op
    _DS_F / _DS_B (peer -1), or a blocking _DS_SEND / _DS_RECV with the neighbouring stage `peer`.

    The schedule runs 2 (n + p - 1) steps; at each a stage either forwards or backwards, by the parity
    of the step and of its stage id, and first exchanges with one neighbour: before a forward it sends
    the previous step's input gradient back and receives this microbatch's activation; before a backward
    it receives this microbatch's gradient and sends the previous step's output on. A send of the
    previous step's output therefore waits for the gradient the stage receives first."""
    def valid(mb: int) -> bool:
        return 0 <= mb < n

    def micro_batch(stage: int, step: int) -> tuple[int, bool]:
        if step % 2 == stage % 2:  # a forward step
            return (step - stage % 2) // 2 - stage // 2, True
        if step % 2 == 0:  # an even step of an odd stage: backward
            return step // 2 - p + (stage + 1) // 2, False
        return (step - 1) // 2 - p + 1 + stage // 2, False

    out = []
    for st in range(p):
        ops: list[tuple[int, int]] = []
        prev = -1
        for step in range(2 * (n + p - 1)):
            mb, fwd = micro_batch(st, step)
            if fwd and st > 0:
                if valid(prev):
                    ops.append((_DS_SEND, st - 1))
                if valid(mb):
                    ops.append((_DS_RECV, st - 1))
            elif not fwd and st < p - 1:
                if valid(mb):
                    ops.append((_DS_RECV, st + 1))
                if valid(prev):
                    ops.append((_DS_SEND, st + 1))
            if valid(mb):
                ops.append((_DS_F if fwd else _DS_B, -1))
            prev = mb
        out.append(tuple(ops))
    return tuple(out)


def run_deepspeed_1f1b(fwd_s: Sequence[float], bwd_s: Sequence[float], msg_s: Sequence[float], n: int,
                       ) -> tuple[float, list[float]]:
    """(pipeline seconds, when each stage ends its last backward) of DeepSpeed's TrainSchedule run
    instruction by instruction (`programs_deepspeed`). Its point-to-point calls block both sides: a
    send and the receive it meets start when both stages have reached them and end `msg_s[b]` later
    for boundary b (between stages b and b + 1); the two streams of a boundary meet in order, which the
    schedule's parity keeps free of deadlock. Unequal stages get exactly the overlap their fill and drain
    allow, which a closed form over the slowest stage's cycle does not."""
    p = len(fwd_s)
    progs = programs_deepspeed(p, n)
    pc, now, last_b = [0] * p, [0.0] * p, [0.0] * p
    left = sum(len(x) for x in progs)
    while left:
        moved = left
        for st in range(p):
            prog = progs[st]
            while pc[st] < len(prog):
                op, peer = prog[pc[st]]
                if op == _DS_F:
                    now[st] += fwd_s[st]
                elif op == _DS_B:
                    now[st] += bwd_s[st]
                    last_b[st] = now[st]
                else:
                    other = progs[peer]
                    if pc[peer] >= len(other) or other[pc[peer]] != (_DS_SEND + _DS_RECV - op, st):
                        break  # the peer has not reached the matching call yet
                    end = max(now[st], now[peer]) + msg_s[min(st, peer)]
                    now[st] = now[peer] = end
                    pc[peer] += 1
                    left -= 1
                pc[st] += 1
                left -= 1
        if left == moved:
            raise RuntimeError(f"DeepSpeed schedule stalled (p={p}, n={n}): a bug in programs_deepspeed")
    return max(now), last_b
