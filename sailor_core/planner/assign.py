"""The assign step: at a bottleneck time tau, which (slot, TP) kind each stage takes, by dynamic programming.

Contract: pure functions (no search state; the caller's moving cutoff is read through a callable).
At tau each stage may take, in each slot, the smallest TPs whose time is <= tau (`stage_options`;
paper heuristic: a larger TP only when it pays). `usage_dp` runs over stages with the GPUs used
per slot (per pipeline) as the state and the objective's own key (summed stage time for
throughput; for the cost objectives price, with the egress each boundary's sends pay at least per
microbatch counted per hour at one microbatch per tau) then the other as the value, beside a track that keeps
the least time with sends per usage and class of the next sends (pruned, under max throughput, by
what the first track's ends already offer); both carry each path's send floor (each boundary's
least sends between the kinds taken, `links.LinkFloors.pairs`). Which of its end states are worth
estimating is picks.py's question.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from sailor_core.errors import SailorError
from sailor_core.planner.links import PairSends, PairTolls
from sailor_core.planner.shapes import StageTable
from sailor_core.planner.space import Problem

Usage = tuple[int, ...]  # GPUs per pipeline used in each slot
# A DP state: the usage and its track: BY_KEYS, or (with sends) the class of the next boundary's
# sends from the last kind (`usage_dp`)
State = tuple[Usage, int]
BY_KEYS = -1
# End states estimated per D by the time-with-sends key under max throughput (`with_sends`): the send
# floor is per slot (the least over its zones), so the best by it is not always the best once placed
# (a world of tests/test_planner_optimality.py: 2.3 % short with the best alone). Only those their
# sketch bound with sends lets through are estimated.
WITH_SENDS = 4
# The with-sends track keeps a stage's states whole up to SENDS_TRACK_STATES, and past it the
# SENDS_TRACK_WIDTH best by time with sends of each number of copies their usage fits (`_thinned`): it only
# feeds `with_sends`'s WITH_SENDS picks per D, and on 3 zones x 3 types x 168 GPUs it held 10-33k states a
# stage at 10-14 stages, 20 s of a 29 s search (over 120 s without a budget).
SENDS_TRACK_STATES = 2048
SENDS_TRACK_WIDTH = 128
# A DP state's value, read by the DP and `picks` only (the inner loop builds millions: a plain tuple):
# (primary, secondary, the state it came from, the (slot, tp) step taken, the send floor of its path:
# each boundary's least sends between the kinds taken, forward + back)
Value = tuple[float, float, State | None, tuple[int, int] | None, float]


class Option(NamedTuple):
    """One choice for one stage at a bottleneck: a slot and TP, with the objective's key and the other."""

    slot: int
    tp: int
    primary: float
    secondary: float


class DP(NamedTuple):
    """`usage_dp`'s answer: every stage's layer of states (for `reconstruct`), the last one's, and the
    copies (D) each usage the DP reached fits (`copies`, kept as the DP goes: `end_states` reads them)."""

    layers: list[dict[State, Value]]
    last: dict[State, Value]
    fits: dict[Usage, int] | None = None


# How many states the DP expands between two looks at the caller's deadline (`usage_dp`'s `stop`)
STOP_EVERY = 4096


class Stopped(SailorError):
    """The caller's deadline passed inside the DP (`usage_dp`'s `stop`)."""


def stage_options(pb: Problem, table: StageTable, tau: float, speed_first: bool) -> list[list[Option]] | None:
    """options[s] = [(slot, tp, primary, secondary)] of the TPs that meet tau; None when a stage has none.

    Each stage, each slot: the smallest TP that meets tau (and the next ones, `Problem.tp_options` in
    all). The primary key is the stage time for throughput, the price for cost objectives; the
    secondary the other."""
    slots = pb.slots
    options = []
    for row in table:
        opts = []
        for g, cand in enumerate(row):
            # The smallest TP that meets tau, and the next larger one: tau sees compute only,
            # a larger TP can still pay through shorter sends per cycle or a shorter fill.
            fit = [(tp, t) for tp, t in cand if t <= tau][: pb.tp_options]
            for tp, t in fit:
                price = tp * slots[g].usd_per_gpu_hour
                opts.append(Option(g, tp, t if speed_first else price, price if speed_first else t))
        if not opts:
            return None
        options.append(opts)
    return options


def usage_dp(options: list[list[Option]], caps: Sequence[int], sends: Sequence[PairSends] = (),
             speed_first: bool = True, max_gpus: int | None = None, live: Sequence[int] | None = None,
             tolls: Sequence[PairTolls] = (), toll_rate: float = 0.0, stop: Callable[[], bool] | None = None,
             price_ceiling: float = math.inf) -> DP | None:
    """(every stage's layer of the DP, its last layer): per state, the best value, the state and step
    that reached it and its path's send floor (`sends[b]`: boundary b's least sends between two
    kinds, `links.LinkFloors.pairs`); None if none fits.

    Two tracks. A `BY_KEYS` state is the per-pipeline slot usage (within the slots' capacity); its
    best path is the least (primary, secondary), the send floor breaking exact ties: the objective's
    keys, which `fronts` takes its Pareto picks from. With sends, a second track keeps, per usage
    and class of the next boundary's sends from the kind just taken (`_row_classes`), the least time
    with sends (the summed time plus the send floor; for cost objectives price breaks ties,
    `with_sends` ranks the same way): two paths are merged only when their futures cost the same, so
    a path whose kinds send more cheaply to what comes next is not dropped for one faster so far (one
    path per usage lost a cross-region plan 1.7 % better). Its states serve `with_sends` alone, so it
    runs after the first track and drops a state once even its best finish (`_finish_floor`) cannot
    enter `with_sends`'s picks at any D its usage leaves open: the first track's end states already
    hold enough better ones there (`_send_limits`).
    `live`: the copies (D) the caller may still estimate (its bound below its cutoff); a path whose
    usage fits fewer copies than the least of them ends in no state it yields, and both tracks drop it.
    `tolls` (cost objectives): each boundary's least egress USD per microbatch between two kinds
    (`links.LinkFloors.tolls`), added to the price key at `toll_rate` (USD per hour per USD per
    microbatch: 3600 / tau, a microbatch crossing every tau at the bottleneck), so a path whose
    cheaper GPUs sit in other zones than its neighbours' pays the egress its sends cost every
    microbatch; without it the price key prefers them and the in-zone path is never estimated.
    `stop`: read every `STOP_EVERY` states; when it answers True (the caller's deadline) the DP gives up
    and answers None (a pool of many zones and types reaches millions of states at a high tau).
    `price_ceiling` (cost objectives): the most a pipeline's price key may reach and still beat the
    caller's cutoff; the first track drops a path whose price key, with the least the later stages add
    (`_finish_floor`), is above it."""
    least = min(live) if live else 1
    toll = _Tolls(tolls, toll_rate)
    fits: dict[Usage, int] = {}
    try:
        keyed = _keys_track(options, caps, sends, least, toll, max_gpus, fits, stop, price_ceiling)
        if keyed is None or not sends:
            return None if keyed is None else DP(*keyed, fits)
        limits = _send_limits(keyed[1], caps, max_gpus, live, speed_first, fits)
        extra = _sends_track(options, caps, sends, speed_first, limits, toll, stop)
    except Stopped:
        return None
    layers = [{**a, **b} for a, b in zip(keyed[0], extra + [{}] * (len(keyed[0]) - len(extra)), strict=True)]
    return DP(layers, layers[-1], fits)


# One move of the DP from a state whose last kind is known: (slot, tp, primary, secondary, send floor, class of
# the next sends, the (slot, tp) kind), the options whose kinds have no link to the last one left out.
Move = tuple[int, int, float, float, float, int, tuple[int, int]]


def _moves(link: PairSends | None, last: tuple[int, int] | None, opts: list[Option], s: int, toll: _Tolls | None,
           classes: Sequence[int]) -> list[Move]:
    """The moves after a stage of kind `last`: each option with its send floor (`_send_row`), its price key
    with the egress its sends pay per hour (`_Tolls.priced`) and its class of next sends; an option with
    no link to `last` in any zone pair is no move."""
    priced = toll.priced(s, last, opts) if toll is not None else opts
    return [(g, tp, x1, x2, dw, c, (g, tp)) for (g, tp, x1, x2), dw, c in zip(priced, _send_row(link, last, opts),
                                                                               classes, strict=True)
            if dw != math.inf]


def _keys_track(options: list[list[Option]], caps: Sequence[int], sends: Sequence[PairSends], least: int = 1,
                toll: _Tolls | None = None, max_gpus: int | None = None, fits: dict[Usage, int] | None = None,
                stop: Callable[[], bool] | None = None,
                ceiling: float = math.inf) -> tuple[list[dict[State, Value]], dict[State, Value]] | None:
    """The `BY_KEYS` track of `usage_dp`: per usage the least (primary, secondary, send floor); paths
    to a usage that fits fewer than `least` copies are dropped. `fits` gathers each usage's copies
    (`copies`), kept as paths grow: a slot's count only grows, so a usage fits
    min(what its parent fits, the grown slot's capacity // its count, max_gpus // its GPUs).
    A path whose primary key, with the least the later stages add, is above `ceiling` is dropped."""
    zero = (0,) * len(caps)
    layers: list[dict[State, Value]] = []
    states: dict[State, Value] = {(zero, BY_KEYS): (0.0, 0.0, None, None, 0.0)}
    fits = {} if fits is None else fits
    rest = _finish_floor(options, (), 2) if ceiling < math.inf else [0.0] * len(options)
    eps = 1e-12
    looked = 0
    n_max = max(caps, default=0) + 1  # more copies than any usage fits: the empty usage's
    for s, opts in enumerate(options):
        link = sends[s - 1] if s and sends else None
        zeros = [0] * len(opts)
        by_last: dict[tuple[int, int] | None, list[Move]] = {}
        nxt: dict[State, Value] = {}
        for key, (p1, p2, _, last, w) in states.items():
            looked += 1
            if stop is not None and looked % STOP_EVERY == 0 and stop():
                raise Stopped
            moves = by_last.get(last)
            if moves is None:
                moves = by_last[last] = _moves(link, last, opts, s, toll, zeros)
            u = key[0]
            fit_u = fits.get(u, n_max) if s else n_max
            for g, tp, x1, x2, dw, _c, kind in moves:
                n = u[g] + tp
                if n > caps[g]:
                    continue
                used = u[:g] + (n,) + u[g + 1:]
                known = fits.get(used)
                if known is None:
                    d = min(fit_u, caps[g] // n)
                    if max_gpus is not None:
                        d = min(d, max_gpus // sum(used))
                    fits[used] = d
                else:
                    d = known
                if d < least:
                    continue
                q1 = p1 + x1
                if q1 + rest[s] > ceiling:
                    continue
                v = (used, BY_KEYS)
                old = nxt.get(v)
                if old is not None:
                    o1 = old[0]
                    if q1 > o1 + eps:
                        continue
                    if q1 >= o1 - eps:
                        q2, o2 = p2 + x2, old[1]
                        if q2 > o2 + eps or (q2 >= o2 - eps and w + dw >= old[4] - eps):
                            continue
                nxt[v] = (q1, p2 + x2, key, kind, w + dw)
        if not nxt:
            return None
        layers.append(nxt)
        states = nxt
    return layers, states


def _sends_track(options: list[list[Option]], caps: Sequence[int], sends: Sequence[PairSends], speed_first: bool,
                 limit: Callable[[Usage], tuple[float, float]] | None, toll: _Tolls | None = None,
                 stop: Callable[[], bool] | None = None) -> list[dict[State, Value]]:
    """The with-sends track of `usage_dp`, one layer per stage (fewer when `limit` drops every state):
    per (usage, class of the next sends) the least time with sends. `limit(usage)` = (top_a, top_b): a
    state is dropped when, with the least the stages after it can add (`_finish_floor`), both its
    time with sends is above top_a and its price above top_b (max throughput: time with sends above
    top_a, top_b being minus infinity); cost objectives: price above top_a and time with sends above
    top_b."""
    zero = (0,) * len(caps)
    layers: list[dict[State, Value]] = []
    states: dict[State, Value] = {(zero, 0): (0.0, 0.0, None, None, 0.0)}
    rest1 = _finish_floor(options, sends if speed_first else (), 2)  # of the primary (with sends for time)
    rest2 = _finish_floor(options, () if speed_first else sends, 3)  # of the secondary (with sends for time)
    cap_of: dict[Usage, tuple[float, float]] = {}
    eps = 1e-12
    looked = 0
    for s, opts in enumerate(options):
        link = sends[s - 1] if s else None
        ahead = sends[s] if s + 1 < len(options) and len(sends) > s else None
        classes = _row_classes(ahead, opts, options[s + 1]) if ahead is not None else [0] * len(opts)
        by_last: dict[tuple[int, int] | None, list[Move]] = {}
        r1, r2 = rest1[s], rest2[s]
        nxt: dict[State, Value] = {}
        for key, (p1, p2, _, last, w) in states.items():
            looked += 1
            if stop is not None and looked % STOP_EVERY == 0 and stop():
                raise Stopped
            moves = by_last.get(last)
            if moves is None:
                moves = by_last[last] = _moves(link, last, opts, s, toll, classes)
            u = key[0]
            for g, tp, x1, x2, dw, c, kind in moves:
                n = u[g] + tp
                if n > caps[g]:
                    continue
                q1, q2, qw = p1 + x1, p2 + x2, w + dw
                used = u[:g] + (n,) + u[g + 1:]
                if limit is not None:
                    top = cap_of.get(used)
                    if top is None:
                        top = cap_of[used] = limit(used)
                    if speed_first:
                        if q1 + qw + r1 > top[0]:
                            continue
                    elif q1 + r1 > top[0] and q2 + qw + r2 > top[1]:
                        continue
                v = (used, c)
                old = nxt.get(v)
                if old is not None:  # by time with sends, then the other key
                    if speed_first:
                        a, b, oa, ob = q1 + qw, q2, old[0] + old[4], old[1]
                    else:
                        a, b, oa, ob = q2 + qw, q1, old[1] + old[4], old[0]
                    if not (a < oa - eps or (a <= oa + eps and b < ob - eps)):
                        continue
                nxt[v] = (q1, q2, key, kind, qw)
        if not nxt:
            break
        if len(nxt) > SENDS_TRACK_STATES:
            nxt = _thinned(nxt, caps, speed_first)
        layers.append(nxt)
        states = nxt
    return layers


def _thinned(states: dict[State, Value], caps: Sequence[int], speed_first: bool) -> dict[State, Value]:
    """The `SENDS_TRACK_WIDTH` best states of each number of copies their usage fits (an upper bound on
    the D of every path through them), by time with sends then the other key, as `_sends_track` ranks."""
    by_copies: dict[int, list[tuple[float, float, State]]] = {}
    for key, (p1, p2, _, _, w) in states.items():
        rank = (p1 + w, p2) if speed_first else (p2 + w, p1)
        by_copies.setdefault(copies(key[0], caps, None), []).append((*rank, key))
    keep = {k for group in by_copies.values() for _, _, k in sorted(group)[:SENDS_TRACK_WIDTH]}
    return {k: v for k, v in states.items() if k in keep}


def _finish_floor(options: list[list[Option]], sends: Sequence[PairSends], col: int) -> list[float]:
    """rest[s]: the least the stages after s can add to an option's column `col` (2: primary, 3:
    secondary), plus the least sends across their boundaries when `sends` is given."""
    rest = [0.0] * len(options)
    for s in range(len(options) - 2, -1, -1):
        link = sends[s] if len(sends) > s else None
        cross = 0.0 if link is None else min(sum(link[((g, tp), (h, th))]) for g, tp, _, _ in options[s]
                                              for h, th, _, _ in options[s + 1])
        rest[s] = rest[s + 1] + min(o[col] for o in options[s + 1]) + cross
    return rest


def _send_limits(keyed: dict[State, Value], caps: Sequence[int], max_gpus: int | None,
                 live: Sequence[int] | None, speed_first: bool, fits: dict[Usage, int] | None = None
                 ) -> Callable[[Usage], tuple[float, float]]:
    """limit(usage) for `_sends_track`: what a path must stay within to enter `with_sends`'s picks at
    some D it may be estimated at: D in `live` (all D when None) and at most the copies its usage
    fits (which only shrink as a path goes on). Max throughput: the `WITH_SENDS`-th least time with
    sends among the first track's end states that fit D. Cost objectives (two picks): the least
    price, for the cheapest; the least time with sends, for the fastest with sends. The first track
    keeps each usage's cheapest path, so no path beats its least price. The largest such D is the
    hardest (infinity where too few end states fit it, minus infinity where no D is left). `fits`: the
    copies of the usages the first track reached (`_keys_track`), where known."""
    fits = {} if fits is None else fits

    def fit(u: Usage) -> int:
        d = fits.get(u)
        return copies(u, caps, max_gpus) if d is None else d

    k = WITH_SENDS if speed_first else 1
    Key = Callable[[tuple[float, float, float]], float]  # of (primary, secondary, send floor)
    keys: list[Key] = [lambda e: e[0] + e[2]] if speed_first else [lambda e: e[0], lambda e: e[1] + e[2]]
    ends = sorted(((fit(key[0]), (p1, p2, w)) for key, (p1, p2, _, _, w) in keyed.items()),
                  key=lambda x: -x[0])
    marks: list[int] = []  # ascending copies; tops[i]: the k-th best of each key among ends fitting >= marks[i]
    tops: list[tuple[float, float]] = []
    best: list[list[float]] = [[] for _ in keys]
    for d, e in ends:
        for b, f in zip(best, keys, strict=True):
            bisect.insort(b, f(e))
            del b[k:]
        if len(best[0]) == k:
            top = (best[0][-1] + 1e-9, best[-1][-1] + 1e-9 if not speed_first else -math.inf)
            if marks and marks[0] == d:
                tops[0] = top
            else:
                marks.insert(0, d)
                tops.insert(0, top)
    ds = sorted(live) if live else None
    none, every = (-math.inf, -math.inf), (math.inf, math.inf)

    def limit(u: Usage) -> tuple[float, float]:
        d = fit(u)
        if ds is not None:
            j = bisect.bisect_right(ds, d)
            if j == 0:
                return none
            d = ds[j - 1]
        i = bisect.bisect_left(marks, d)
        return tops[i] if i < len(marks) else every

    return limit


def copies(u: Usage, caps: Sequence[int], max_gpus: int | None) -> int:
    """How many copies (D) of a pipeline with slot usage `u` fit the pool (and `max_gpus`)."""
    d = min((caps[g] // u[g] for g in range(len(caps)) if u[g]), default=0)
    return min(d, max_gpus // max(1, sum(u))) if max_gpus is not None else d


def _row_classes(link: PairSends, opts: list[Option], ahead: list[Option]) -> list[int]:
    """For each option of a stage, the class of its sends to the next stage's options over `link`:
    options with equal rows share a class (one class when the next sends do not depend on the kind)."""
    seen: dict[tuple[float, ...], int] = {}
    return [seen.setdefault(tuple(sum(link[((g, tp), (h, th))]) for h, th, _, _ in ahead), len(seen))
            for g, tp, _, _ in opts]


class _Tolls:
    """The egress term of the DP's price key (`priced`): what each option of stage s pays per hour for
    its boundary with a stage of kind `last`."""

    def __init__(self, tolls: Sequence[PairTolls], rate: float) -> None:
        self.tolls = tolls if rate > 0 else ()
        self.rate = rate

    def priced(self, s: int, last: tuple[int, int] | None, opts: list[Option]) -> list[Option]:
        """The options of stage s after a stage of kind `last`, each with its boundary's egress per hour
        added to its price key (`opts` itself where the boundary pays none)."""
        if last is None or not self.tolls or not s or not self.tolls[s - 1]:
            return opts
        t = self.tolls[s - 1]
        return [Option(g, tp, x1 + t[(last, (g, tp))] * self.rate, x2) for g, tp, x1, x2 in opts]


def _send_row(link: PairSends | None, last: tuple[int, int] | None, opts: list[Option]) -> list[float]:
    """The send floor (forward + back) of each option after a stage of kind `last` (0 for the first stage)."""
    if link is None or last is None:
        return [0.0] * len(opts)
    return [sum(link[(last, (g, tp))]) for g, tp, _, _ in opts]


