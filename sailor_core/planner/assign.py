"""The assign step: at a bottleneck time tau, which (slot, TP) kind each stage takes, by dynamic programming.

Contract: pure functions (no search state; the caller's moving cutoff is read through a callable).
At tau each stage may take, in each slot, the smallest TPs whose time is <= tau (`stage_options`;
paper heuristic: a larger TP only when it pays). `usage_dp` runs over stages with the GPUs used
per slot (per pipeline) as the state and the objective's own key (summed stage time for
throughput; for the cost objectives price, with the egress each boundary's sends pay at least per
microbatch counted per hour at one microbatch per tau) then the other as the value, beside a track that keeps
the least time with sends per usage and class of the next sends (pruned, under max throughput, by
what the first track's ends already offer); both carry each path's send floor (each boundary's
least sends between the kinds taken, `bounds.LinkFloors.pairs`); `end_states` ranks its end
states by how many copies (D) fit the pool, and `fronts` yields, per D, the end states worth
estimating (of the first track: each key's optimum, or their Pareto set when a limit couples time
and money, plus the best by an estimate of goodput under spot risk; of both: the best with the
send floor counted in the time key, `with_sends`); `reconstruct` turns one into per-stage kinds.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from sailor_core.planner.bounds import Floor, PairSends, PairTolls, bound
from sailor_core.planner.request import Objective
from sailor_core.planner.risk import useful_fraction_of
from sailor_core.planner.scoring import SECONDS_PER_HOUR, Goal
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
# A DP state's value, inside this module only (the inner loop builds millions: a plain tuple): (primary,
# secondary, the state it came from, the (slot, tp) step taken, the send floor of its path: each
# boundary's least sends between the kinds taken, forward + back)
Value = tuple[float, float, State | None, tuple[int, int] | None, float]


class Option(NamedTuple):
    """One choice for one stage at a bottleneck: a slot and TP, with the objective's key and the other."""

    slot: int
    tp: int
    primary: float
    secondary: float


class End(NamedTuple):
    """An end state of the DP: how many copies (D) of its pipeline fit the pool, its keys, its send floor."""

    copies: int
    primary: float
    secondary: float
    state: State
    sends: float


class Eligible(NamedTuple):
    """An end state eligible at some D: its keys, the state and its send floor."""

    primary: float
    secondary: float
    state: State
    sends: float


class DP(NamedTuple):
    """`usage_dp`'s answer: every stage's layer of states (for `reconstruct`) and the last one's."""

    layers: list[dict[State, Value]]
    last: dict[State, Value]


class Picks(NamedTuple):
    """What `fronts` yields at one D: the end states worth estimating, those `with_sends` adds, and every
    eligible end state in key order (where a pick that cannot be placed or estimated makes way)."""

    d: int
    front: list[State]
    with_sends: list[State]
    ranked: list[State]
    by_types: list[State] = []  # the best by the keys of each set of GPU types no other pick uses


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
             tolls: Sequence[PairTolls] = (), toll_rate: float = 0.0
             ) -> DP | None:
    """(every stage's layer of the DP, its last layer): per state, the best value, the state and step
    that reached it and its path's send floor (`sends[b]`: boundary b's least sends between two
    kinds, `bounds.LinkFloors.pairs`); None if none fits.

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
    (`bounds.LinkFloors.tolls`), added to the price key at `toll_rate` (USD per hour per USD per
    microbatch: 3600 / tau, a microbatch crossing every tau at the bottleneck), so a path whose
    cheaper GPUs sit in other zones than its neighbours' pays the egress its sends cost every
    microbatch; without it the price key prefers them and the in-zone path is never estimated."""
    least = min(live) if live else 1
    toll = _Tolls(tolls, toll_rate)
    keyed = _keys_track(options, caps, sends, lambda u: _copies(u, caps, max_gpus) >= least, toll)
    if keyed is None or not sends:
        return None if keyed is None else DP(*keyed)
    extra = _sends_track(options, caps, sends, speed_first, _send_limits(keyed[1], caps, max_gpus, live, speed_first),
                         toll)
    layers = [{**a, **b} for a, b in zip(keyed[0], extra + [{}] * (len(keyed[0]) - len(extra)), strict=True)]
    return DP(layers, layers[-1])


def _keys_track(options: list[list[Option]], caps: Sequence[int], sends: Sequence[PairSends],
                alive: Callable[[Usage], bool] = lambda u: True, toll: _Tolls | None = None
                ) -> tuple[list[dict[State, Value]], dict[State, Value]] | None:
    """The `BY_KEYS` track of `usage_dp`: per usage the least (primary, secondary, send floor); paths
    to a usage `alive` rejects are dropped."""
    zero = (0,) * len(caps)
    layers: list[dict[State, Value]] = []
    states: dict[State, Value] = {(zero, BY_KEYS): (0.0, 0.0, None, None, 0.0)}
    seen: dict[Usage, bool] = {}
    for s, opts in enumerate(options):
        link = sends[s - 1] if s and sends else None
        nxt: dict[State, Value] = {}
        for key, (p1, p2, _, _, w), row, priced in _with_rows(states, link, opts, s, toll):
            u = key[0]
            for (g, tp, x1, x2), dw in zip(priced, row, strict=True):
                if u[g] + tp > caps[g] or dw == math.inf:  # no room, or no link between the kinds anywhere
                    continue
                q1, q2, qw = p1 + x1, p2 + x2, w + dw
                used = u[:g] + (u[g] + tp,) + u[g + 1 :]
                ok = seen.get(used)
                if ok is None:
                    ok = seen[used] = alive(used)
                if not ok:
                    continue
                v = (used, BY_KEYS)
                old = nxt.get(v)
                if old is None or q1 < old[0] - 1e-12 or (q1 <= old[0] + 1e-12 and (
                        q2 < old[1] - 1e-12 or (q2 <= old[1] + 1e-12 and qw < old[4] - 1e-12))):
                    nxt[v] = (q1, q2, key, (g, tp), qw)
        if not nxt:
            return None
        layers.append(nxt)
        states = nxt
    return layers, states


def _sends_track(options: list[list[Option]], caps: Sequence[int], sends: Sequence[PairSends], speed_first: bool,
                 limit: Callable[[Usage], tuple[float, float]] | None, toll: _Tolls | None = None
                 ) -> list[dict[State, Value]]:
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
    for s, opts in enumerate(options):
        link = sends[s - 1] if s else None
        ahead = sends[s] if s + 1 < len(options) and len(sends) > s else None
        classes = _row_classes(ahead, opts, options[s + 1]) if ahead is not None else [0] * len(opts)
        nxt: dict[State, Value] = {}
        for key, (p1, p2, _, _, w), row, priced in _with_rows(states, link, opts, s, toll):
            u = key[0]
            for (g, tp, x1, x2), dw, c in zip(priced, row, classes, strict=True):
                if u[g] + tp > caps[g] or dw == math.inf:  # no room, or no link between the kinds anywhere
                    continue
                q1, q2, qw = p1 + x1, p2 + x2, w + dw
                used = u[:g] + (u[g] + tp,) + u[g + 1 :]
                if limit is not None:
                    top = cap_of.get(used)
                    if top is None:
                        top = cap_of[used] = limit(used)
                    if speed_first:
                        if q1 + qw + rest1[s] > top[0]:
                            continue
                    elif q1 + rest1[s] > top[0] and q2 + qw + rest2[s] > top[1]:
                        continue
                v = (used, c)
                old = nxt.get(v)
                if old is None or _sends_first(q1, q2, qw, old, speed_first):
                    nxt[v] = (q1, q2, key, (g, tp), qw)
        if not nxt:
            break
        layers.append(nxt)
        states = nxt
    return layers


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
                 live: Sequence[int] | None, speed_first: bool) -> Callable[[Usage], tuple[float, float]]:
    """limit(usage) for `_sends_track`: what a path must stay within to enter `with_sends`'s picks at
    some D it may be estimated at: D in `live` (all D when None) and at most the copies its usage
    fits (which only shrink as a path goes on). Max throughput: the `WITH_SENDS`-th least time with
    sends among the first track's end states that fit D. Cost objectives (two picks): the least
    price, for the cheapest; the least time with sends, for the fastest with sends. The first track
    keeps each usage's cheapest path, so no path beats its least price. The largest such D is the
    hardest (infinity where too few end states fit it, minus infinity where no D is left)."""
    k = WITH_SENDS if speed_first else 1
    Key = Callable[[tuple[float, float, float]], float]  # of (primary, secondary, send floor)
    keys: list[Key] = [lambda e: e[0] + e[2]] if speed_first else [lambda e: e[0], lambda e: e[1] + e[2]]
    ends = sorted(((_copies(key[0], caps, max_gpus), (p1, p2, w)) for key, (p1, p2, _, _, w) in keyed.items()),
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
        d = _copies(u, caps, max_gpus)
        if ds is not None:
            j = bisect.bisect_right(ds, d)
            if j == 0:
                return none
            d = ds[j - 1]
        i = bisect.bisect_left(marks, d)
        return tops[i] if i < len(marks) else every

    return limit


def _copies(u: Usage, caps: Sequence[int], max_gpus: int | None) -> int:
    """How many copies (D) of a pipeline with slot usage `u` fit the pool (and `max_gpus`)."""
    d = min((caps[g] // u[g] for g in range(len(caps)) if u[g]), default=0)
    return min(d, max_gpus // max(1, sum(u))) if max_gpus is not None else d


def _sends_first(q1: float, q2: float, w: float, old: Value, speed_first: bool) -> bool:
    """Whether (q1, q2, w) beats `old` by time with sends, then the other key."""
    if speed_first:
        a, b, c, d = q1 + w, q2, old[0] + old[4], old[1]
    else:
        a, b, c, d = q2 + w, q1, old[1] + old[4], old[0]
    return a < c - 1e-12 or (a <= c + 1e-12 and b < d - 1e-12)


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


def _with_rows(states: dict[State, Value], link: PairSends | None, opts: list[Option], s: int = 0,
               toll: _Tolls | None = None) -> Iterator[tuple[State, Value, list[float], list[Option]]]:
    """Each state with its value, the send floor of each option after it (`_send_row`) and the options
    with the egress their sends pay per hour added to the price key (`_Tolls.priced`: `opts` itself
    without tolls), both worked out once per last kind."""
    rows: dict[tuple[int, int] | None, tuple[list[float], list[Option]]] = {}
    for key, value in states.items():
        last = value[3]
        pair = rows.get(last)
        if pair is None:
            pair = rows[last] = (_send_row(link, last, opts), toll.priced(s, last, opts) if toll is not None else opts)
        yield key, value, pair[0], pair[1]


def _send_row(link: PairSends | None, last: tuple[int, int] | None, opts: list[Option]) -> list[float]:
    """The send floor (forward + back) of each option after a stage of kind `last` (0 for the first stage)."""
    if link is None or last is None:
        return [0.0] * len(opts)
    return [sum(link[(last, (g, tp))]) for g, tp, _, _ in opts]


def end_states(states: dict[State, Value], caps: Sequence[int], max_gpus: int | None) -> list[End]:
    """(D-capacity, primary, secondary, state, send floor) of each end state, most copies first then best value."""
    ends = []
    for key, (p1, p2, _, _, w) in states.items():
        ends.append(End(_copies(key[0], caps, max_gpus), p1, p2, key, w))
    ends.sort(key=lambda e: (-e[0], e[1], e[2], e[3]))
    return ends


def reconstruct(layers: list[dict[State, Value]], end: State) -> tuple[tuple[int, int], ...]:
    """The per-stage (slot, tp) kinds that reached the end state `end`, from the DP's back-pointers."""
    kinds: list[tuple[int, int]] = []
    u: State | None = end
    for i, layer in enumerate(reversed(layers)):
        if u is None:
            raise RuntimeError(f"usage DP: the back-pointers end {len(layers) - i} stages early")
        _, _, prev, kind, _ = layer[u]
        if kind is None:
            raise RuntimeError(f"usage DP: state {u} of stage {len(layers) - 1 - i} has no (slot, tp) kind")
        kinds.append(kind)
        u = prev
    return tuple(reversed(kinds))


def fronts(pb: Problem, goal: Goal, ends: list[End], tau: float, n: int, d_list: Sequence[int], lb: Floor,
           cutoff: Callable[[], float]) -> Iterator[Picks]:
    """Yields (D, the end states worth estimating at D, those `with_sends` adds beyond them), largest
    D first, each D only while the bound (against `cutoff()` read at that moment: estimates of earlier
    D move it) does not rule it out."""
    risk = pb.risk
    risky = pb.objective is Objective.MAX_GOODPUT and risk is not None and not risk.riskless
    keyed: list[Eligible] = []  # the first track's; the sends track serves `with_sends` alone
    picks = _SendPicks(goal.speed_first)
    types_of: dict[Usage, frozenset[str]] = {}
    i = 0
    for d in reversed(d_list):
        while i < len(ends) and ends[i][0] >= d:
            e = Eligible(ends[i][1], ends[i][2], ends[i][3], ends[i][4])
            picks.add(e)
            if e[2][1] == BY_KEYS:
                bisect.insort(keyed, e)
            i += 1
        if not keyed:
            continue
        if bound(goal, tau, lb, n, [d]) >= cutoff():
            continue
        front = pareto_front(keyed, goal.coupled)
        if risky:
            # Price and time alone always prefer spot; at this D the risk of each state's spot VMs
            # decides: add the states best by an estimate of the goodput score.
            m = -(-n // d)
            ranked = sorted(keyed, key=lambda e: (approx_goodput(pb, e[0], e[1], e[2][0], d, m, tau), e))
            front += [e[2] for e in _distinct(ranked)[:2]]
        yield Picks(d, front, [u for u in picks.states() if u not in front], [e[2] for e in keyed],
                    _by_types(pb, keyed, front, types_of))


def _by_types(pb: Problem, keyed: Sequence[Eligible], taken: Sequence[State],
              types_of: dict[Usage, frozenset[str]]) -> list[State]:
    """The best end state by the keys (`keyed` is in key order) of each set of GPU types that the states
    in `taken` do not use: the keys favour the fastest (or cheapest) GPUs, whose plans may still fail or
    lose once placed (a type linked to the others in one zone only), and a larger pool must not lose
    the best plan of the types a smaller one had (the DP's best path per usage is the same in both).
    `types_of`: a memo of each usage's GPU types."""
    def types(u: Usage) -> frozenset[str]:
        t = types_of.get(u)
        if t is None:
            t = types_of[u] = frozenset(pb.slots[g].gpu_type if g < len(pb.slots) else str(g)
                                        for g, n in enumerate(u) if n)
        return t

    seen = {types(u[0]) for u in taken}
    out = []
    for e in keyed:
        t = types(e[2][0])
        if t not in seen:
            seen.add(t)
            out.append(e[2])
    return out


class _SendPicks:
    """`with_sends` of the end states added so far, kept up to date as they are added (`fronts` adds
    them D by D): time first, ranked by time with sends, then the other key; money first, the least
    of each pick's keys."""

    def __init__(self, speed_first: bool) -> None:
        self.speed_first = speed_first
        self.ranked: list[tuple[float, float, State, Eligible]] = []  # time first: by time with sends
        self.cheap: tuple[float, float, State] | None = None  # money first: the two picks' keys
        self.fast: tuple[float, float, State] | None = None

    def add(self, e: Eligible) -> None:
        if self.speed_first:
            bisect.insort(self.ranked, (e[0] + e[3], e[1], e[2], e))
            return
        cheap, fast = (e[0], e[1] + e[3], e[2]), (e[1] + e[3], e[0], e[2])
        self.cheap = cheap if self.cheap is None or cheap < self.cheap else self.cheap
        self.fast = fast if self.fast is None or fast < self.fast else self.fast

    def states(self) -> list[State]:
        if self.speed_first:
            return [e[2] for e in _distinct((r[3] for r in self.ranked), WITH_SENDS)]
        return [] if self.cheap is None or self.fast is None else [self.cheap[2], self.fast[2]]


def with_sends(eligible: Sequence[Eligible], speed_first: bool) -> list[State]:
    """The end states best once each boundary's send floor counts in the time key: the DP's keys see
    compute and price only, so among usages equal on both (the same GPU at the same price in two
    regions) the front's pick is arbitrary and may send every pipeline across regions where one
    region holds it whole (issue 29: GPT-Neo-2.7 on 5 zones x 128 A100-40 missed a plan 9 % faster).
    Time first: the `WITH_SENDS` least times with sends; money first: the cheapest then least time
    with sends, and the least time with sends. The DP's two tracks often end in the same path: an end
    state equal to a better one in its usage and every key counts once."""
    picks = _SendPicks(speed_first)
    for e in eligible:
        picks.add(e)
    return picks.states()


def _distinct(ranked: Iterable[Eligible], limit: int | None = None) -> list[Eligible]:
    """`ranked` without the end states whose usage and values repeat an earlier one's (the first
    `limit` of them)."""
    seen: set[tuple[float, float, Usage, float]] = set()
    out: list[Eligible] = []
    for e in ranked:
        if limit is not None and len(out) >= limit:
            break
        k = (e[0], e[1], e[2][0], e[3])
        if k not in seen:
            seen.add(k)
            out.append(e)
    return out


def pareto_front(eligible: Sequence[Eligible], coupled: bool) -> list[State]:
    """The end states on the (primary, secondary) Pareto front of `eligible` (sorted by primary):
    up to 32 spread along it when a limit couples time and money, else its two ends."""
    front = []
    low2 = math.inf
    for _p1, p2, u, _w in eligible:
        if p2 < low2 - 1e-12:
            front.append(u)
            low2 = p2
    if coupled and len(front) > 32:
        front = [front[round(j * (len(front) - 1) / 31)] for j in range(32)]
    elif not coupled:
        front = [front[0], front[-1]]
    return front


def approx_goodput(pb: Problem, usd_per_hour: float, fill_s: float, use: Usage, d: int, m: int, tau: float) -> float:
    """Goodput score of a DP end state at D, before placement: time fill + (m - 1) tau, each
    slot's VMs at the rate of its first zone."""
    risk = pb.risk
    assert risk is not None
    t = fill_s + (m - 1) * tau
    slots = pb.slots
    lam = sum(-(-d * g_use // slots[g].gpus_per_node) * risk.rate(slots[g].zones[0][0], slots[g].gpu_type,
                                                                slots[g].market)
              for g, g_use in enumerate(use) if g_use)
    return d * usd_per_hour * t / SECONDS_PER_HOUR / useful_fraction_of(lam, t, risk)
