"""Which end states of the assign step's DP are worth estimating, at each number of pipelines D.

Contract: pure functions of the DP's end states (`assign.usage_dp`) and the bounds; no search state
(the caller's moving cutoff is read through a callable). `end_states` ranks the DP's end states by
how many copies (D) fit the pool; `fronts` yields, per D (largest first, while the bound lets it
through), the picks (`Picks`): of the first track, each key's optimum (or their Pareto set when a
limit couples time and money) plus the best by an estimate of goodput under spot risk; of both
tracks, the best with the send floor counted in the time key (`with_sends`); the best of each set of
GPU types no other pick uses; and every eligible end state in key order, where a pick that cannot be
placed or estimated makes way. `reconstruct` turns an end state into per-stage kinds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from sailor_core.planner.assign import BY_KEYS, WITH_SENDS, State, Usage, Value, copies
from sailor_core.planner.bounds import Floor, bound
from sailor_core.planner.request import Objective
from sailor_core.planner.risk import useful_fraction_of
from sailor_core.planner.scoring import SECONDS_PER_HOUR, Goal
from sailor_core.planner.space import Problem


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



class Picks(NamedTuple):
    """What `fronts` yields at one D: the end states worth estimating, those `with_sends` adds, and every
    eligible end state in key order (where a pick that cannot be placed or estimated makes way)."""

    d: int
    front: list[State]
    with_sends: list[State]
    ranked: Iterable[State]  # lazy: read only before `fronts` yields its next D
    by_types: list[State] = []  # the best by the keys of each set of GPU types no other pick uses



def end_states(states: dict[State, Value], caps: Sequence[int], max_gpus: int | None,
               fits: dict[Usage, int] | None = None) -> list[End]:
    """(D-capacity, primary, secondary, state, send floor) of each end state, most copies first then best value;
    `fits`: the copies the DP already knows per usage (`DP.fits`)."""
    fits = {} if fits is None else fits
    ends = []
    for key, (p1, p2, _, _, w) in states.items():
        d = fits.get(key[0])
        ends.append(End(copies(key[0], caps, max_gpus) if d is None else d, p1, p2, key, w))
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
    by_types = _TypesBest(pb)
    i = 0
    for d in reversed(d_list):
        j = i
        while i < len(ends) and ends[i][0] >= d:
            i += 1
        fresh = [Eligible(x[1], x[2], x[3], x[4]) for x in ends[j:i]]
        picks.extend(fresh)
        fresh = [e for e in fresh if e[2][1] == BY_KEYS]
        if fresh:
            keyed += fresh
            keyed.sort()  # two sorted runs: a merge (one insort per state was quadratic in the states)
            by_types.extend(fresh)
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
        yield Picks(d, front, [u for u in picks.states() if u not in front], (e[2] for e in keyed.copy()),
                    by_types.missing(front))



class _TypesBest:
    """The best end state by the keys of each set of GPU types, kept as `fronts` adds states D by D (one
    look per state, not one scan of every state per D). `missing(taken)`: those of the sets the states in
    `taken` do not use, in key order: the keys favour the fastest (or cheapest) GPUs, whose plans may
    still fail or lose once placed (a type linked to the others in one zone only), and a larger pool
    must not lose the best plan of the types a smaller one had (the DP's best path per usage is the
    same in both)."""

    def __init__(self, pb: Problem) -> None:
        self.pb = pb
        self.best: dict[frozenset[str], Eligible] = {}
        self.types_of: dict[Usage, frozenset[str]] = {}  # a memo of each usage's GPU types

    def types(self, u: Usage) -> frozenset[str]:
        t = self.types_of.get(u)
        if t is None:
            slots = self.pb.slots
            t = self.types_of[u] = frozenset(slots[g].gpu_type if g < len(slots) else str(g)
                                             for g, n in enumerate(u) if n)
        return t

    def extend(self, added: Iterable[Eligible]) -> None:
        best = self.best
        for e in added:
            t = self.types(e[2][0])
            old = best.get(t)
            if old is None or e < old:
                best[t] = e

    def missing(self, taken: Sequence[State]) -> list[State]:
        seen = {self.types(u[0]) for u in taken}
        return [e[2] for e in sorted(e for t, e in self.best.items() if t not in seen)]


class _SendPicks:
    """`with_sends` of the end states added so far, kept up to date as they are added (`fronts` adds
    them D by D): time first, ranked by time with sends, then the other key; money first, the least
    of each pick's keys."""

    def __init__(self, speed_first: bool) -> None:
        self.speed_first = speed_first
        self.ranked: list[tuple[float, float, State, Eligible]] = []  # time first: by time with sends
        self.cheap: tuple[float, float, State] | None = None  # money first: the two picks' keys
        self.fast: tuple[float, float, State] | None = None

    def extend(self, added: Iterable[Eligible]) -> None:
        if self.speed_first:
            before = len(self.ranked)
            self.ranked += ((e[0] + e[3], e[1], e[2], e) for e in added)
            if len(self.ranked) > before:
                self.ranked.sort()  # sorted runs merged, not one insort per state (quadratic in the states)
            return
        for e in added:
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
    picks.extend(eligible)
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
