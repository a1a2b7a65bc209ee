"""Lower bounds on a score: what lets the search skip a split, a bottleneck or a sketch unestimated.

Contract: every bound here is admissible (never above the `scoring.score` of anything it rules
out, checked against the exact 1F1B schedule in tests/test_simulator_schedule.py). `Floor` holds
the lower-bound terms of one (microbatch size, split); `floor_of` builds it from the stage table
and the cheapest sends (`LinkFloors`, memoised per boundary); `bound` reads it for a bottleneck
time tau (the exact schedule's bound, `simulator.schedule.lower_bound_1f1b`, with the best stage
times, some stage at tau and the cheapest messages; cost: that time x the cheapest GPUs);
`SketchFloors.score` bounds one sketch: its own stage times, each boundary's sends at the floor of
its two kinds (`LinkFloors.pairs`: the least over the zones of their slots, so wherever the
placement puts the stages) and stage 0's gradient ring on the fastest zone of its slot. The same
pair floors give the assign step's DP its send term, and the pairs' least egress per microbatch
(`LinkFloors.tolls`) its egress term under the cost objectives (assign.usage_dp). The memos are
caches of pure answers: they change what is computed, never a result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product

from sailor_core.planner.costs import Costs
from sailor_core.planner.estimate import BYTES_PER_GB, fwd_bwd, round_trip_usd_per_gb
from sailor_core.planner.scoring import Goal
from sailor_core.planner.shapes import Bounds, StageTable
from sailor_core.planner.space import Problem
from sailor_core.simulator.schedule import lower_bound_1f1b

Kind = tuple[int, int]  # a stage's (slot index, tp)
# The least (activation forward, gradient back) seconds across one boundary from a stage of the first
# kind to one of the second, over every zone of each kind's slot.
PairSends = dict[tuple[Kind, Kind], tuple[float, float]]
# The least egress USD one microbatch pays across one boundary (its activation forward and its gradient
# back) from a stage of the first kind to one of the second, over every zone of each kind's slot: 0 where
# the two slots share a zone.
PairTolls = dict[tuple[Kind, Kind], float]  # empty: no egress across the boundary wherever its stages go


@dataclass(frozen=True)
class Floor:
    """Lower-bound terms of one (mbs, partition), stage by stage, for `schedule.lower_bound_1f1b`:
    stage b is reached no earlier than `reach[b]` (the cheapest stages and sends before it, both
    ways), computes m microbatches of at least `best[b]` and waits at least (m - 1) `act[b]` and
    m `grad[b]` for its neighbours; `opt` is the least optimizer step that ends the iteration."""

    reach: tuple[float, ...]
    best: tuple[float, ...]
    act: tuple[float, ...]  # the cheapest activation into stage b (0 for the first)
    grad: tuple[float, ...]  # the cheapest gradient into stage b (0 for the last)
    opt: float
    rate: float  # USD/hour of the cheapest GPUs per pipeline
    pairs: tuple[PairSends, ...] = field(default=(), compare=False)  # per boundary: its sends floor per kind pair
    memo: dict[int, tuple[float, float]] = field(default_factory=dict, compare=False, repr=False)

    def at(self, m: int) -> tuple[float, float]:
        """(the least wait of any stage, the largest bound of a stage at its cheapest time) at m
        microbatches: the parts of the bound that do not depend on tau."""
        v = self.memo.get(m)
        if v is None:
            waits = [(m - 1) * a + m * g + r for a, g, r in zip(self.act, self.grad, self.reach, strict=True)]
            v = (min(waits), max(m * t + w for t, w in zip(self.best, waits, strict=True)))
            self.memo[m] = v
        return v


def bound(goal: Goal, tau: float, lb: Floor, n: int, d_list: Sequence[int]) -> float:
    """A lower bound on the score of anything with compute bottleneck >= tau, at any D of d_list."""
    return min(bounds_at(goal, tau, lb, n, d_list), default=math.inf)


def bounds_at(goal: Goal, tau: float, lb: Floor, n: int, d_list: Sequence[int]) -> list[float]:
    """`bound` at each D of d_list on its own."""
    out = []
    for d in d_list:
        m = -(-n // d)
        # some stage computes at least tau per microbatch (which one is not known: the least of
        # them), and every stage at least its cheapest time
        least_wait, floor = lb.at(m)
        t = lb.opt + max(m * tau + least_wait, floor)
        out.append(goal.floor(t, d, lb.rate, budget=False))
    return out


@dataclass(frozen=True)
class LinkSends:
    """The cheapest sends across one boundary over any pair of GPU kinds in one zone each."""

    one_way: float  # the least of max(forward, back): what a steady-state microbatch pays at least
    fill: float  # the least forward + back: what the first microbatch pays
    forward: float  # the least activation on its own
    back: float  # the least gradient on its own


class LinkFloors:
    """Per (microbatch size, last layer before the boundary), computed once each: the `LinkSends`
    over every pair of kinds, and the `PairSends` and `PairTolls` of each pair of kinds (its sends'
    and its egress's floor wherever the placement puts the two stages: the least over the slots' zones)."""

    def __init__(self, pb: Problem, costs: Costs) -> None:
        self._pb = pb
        self._costs = costs
        self._memo: dict[tuple[int, int], tuple[LinkSends, PairSends]] = {}
        self._tolls: dict[tuple[int, int], PairTolls] = {}

    def __call__(self, mbs: int, last: int) -> LinkSends:
        return self._of(mbs, last)[0]

    def pairs(self, mbs: int, last: int) -> PairSends:
        return self._of(mbs, last)[1]

    def tolls(self, mbs: int, last: int) -> PairTolls:
        """The `PairTolls` of the boundary after layer `last` (empty where no pair of kinds pays egress)."""
        v = self._tolls.get((mbs, last))
        if v is None:
            v = self._tolls[(mbs, last)] = self._least_egress(mbs, last)
        return v

    def _least_egress(self, mbs: int, last: int) -> PairTolls:
        c = self._costs
        ends = [(a.index, ta, za, c.boundary_bytes(ta, last, mbs))
                for a in self._pb.slots for ta in self._pb.tp_values
                if ta <= a.gpus_per_node and c.profiled(a.gpu_type, mbs, ta) for za, _ in a.zones]
        tolls: PairTolls = {}
        for (a, ta, za, msg), (b, tb, zb, _) in product(ends, repeat=2):
            key = ((a, ta), (b, tb))
            tolls[key] = min(tolls.get(key, math.inf), msg / BYTES_PER_GB * round_trip_usd_per_gb(c, za, zb))
        return tolls if any(tolls.values()) else {}

    def _of(self, mbs: int, last: int) -> tuple[LinkSends, PairSends]:
        v = self._memo.get((mbs, last))
        if v is None:
            v = self._memo[(mbs, last)] = self._cheapest(mbs, last)
        return v

    def _cheapest(self, mbs: int, last: int) -> tuple[LinkSends, PairSends]:
        c = self._costs
        # both ends range over every profiled (slot, tp) that fits a node, in each of the slot's zones;
        # the sender's message is the activation after `last` at its TP
        kinds = [(a, ta) for a in self._pb.slots for ta in self._pb.tp_values
                 if ta <= a.gpus_per_node and c.profiled(a.gpu_type, mbs, ta)]
        ends = [(a, ta, za, msg) for a, ta in kinds for msg in (c.boundary_bytes(ta, last, mbs),) for za, _ in a.zones]
        one = both = lo_f = lo_b = math.inf
        pairs: PairSends = {}
        for (a, ta, za, msg), (b, tb, zb, _) in product(ends, repeat=2):
            # the estimate times a send with the pipelines that share a node's link (`costs.nic_share`:
            # up to a node's TP groups); a link's fit may give each flow more speed with more of them
            f, bk = math.inf, math.inf
            for share in range(1, max(a.gpus_per_node // ta, b.gpus_per_node // tb, 1) + 1):
                sf, sb = fwd_bwd(c.p2p_s(a, ta, za, b, tb, zb, msg, share))
                f, bk = min(f, sf), min(bk, sb)
            one, both = min(one, max(f, bk)), min(both, f + bk)
            lo_f, lo_b = min(lo_f, f), min(lo_b, bk)
            key = ((a.index, ta), (b.index, tb))
            least_f, least_b = pairs.get(key, (math.inf, math.inf))
            pairs[key] = (min(least_f, f), min(least_b, bk))
        sends = LinkSends(*(x if math.isfinite(x) else 0.0 for x in (one, both, lo_f, lo_b)))
        return sends, pairs


def floor_of(pb: Problem, costs: Costs, links: LinkFloors, mbs: int, bounds: Bounds, table: StageTable) -> Floor:
    """The lower-bound terms of a split from its stage table: the cheapest compute per stage, every
    boundary's cheapest message each way, the least optimizer step and the cheapest GPUs' price."""
    p = len(bounds)
    slots = pb.slots
    best_t = [min(t for row in table[s] for _, t in row) for s in range(p)]
    min_rate = [min(tp * slots[g].usd_per_gpu_hour for g, row in enumerate(table[s]) for tp, _ in row)
                for s in range(p)]
    sends = [links(mbs, bounds[b][1]) for b in range(p - 1)]
    reach = [0.0]
    for b in range(p - 1):
        reach.append(reach[-1] + best_t[b] + sends[b].fill)
    opt_lb = max(
        min(costs.optimizer_s(slots[g].gpu_type, mbs, tp, *bounds[s]) for g, row in enumerate(table[s])
            for tp, _ in row)
        for s in range(p)
    )
    return Floor(reach=tuple(reach), best=tuple(best_t), act=tuple([0.0] + [x.forward for x in sends]),
                 grad=tuple([x.back for x in sends] + [0.0]), opt=opt_lb, rate=sum(min_rate),
                 pairs=tuple(links.pairs(mbs, bounds[b][1]) for b in range(p - 1)))


class SketchFloors:
    """Score lower bounds of whole sketches with their sends at the floor of their kinds (`LinkFloors.pairs`:
    the least over the slots' zones, wherever the placement puts them) and their gradient ring at its
    fastest; the terms that do not depend on D are kept per (mbs, bounds, kinds)."""

    def __init__(self, pb: Problem, costs: Costs, goal: Goal, links: LinkFloors) -> None:
        self._pb = pb
        self._costs = costs
        self._goal = goal
        self._links = links
        self._terms: dict[tuple[object, ...], SketchTerms] = {}

    def _fixed(self, mbs: int, bounds: Bounds, kinds: tuple[Kind, ...]) -> SketchTerms:
        """The D-free terms of a sketch's bound (`SketchTerms`)."""
        fixed = self._terms.get((mbs, bounds, kinds))
        if fixed is None:
            slots, c = self._pb.slots, self._costs
            ts = [c.compute(slots[si].gpu_type, mbs, tp, a, b).total_s
                  for (a, b), (si, tp) in zip(bounds, kinds, strict=True)]
            sends = [self._links.pairs(mbs, bounds[s][1])[(kinds[s], kinds[s + 1])] for s in range(len(kinds) - 1)]
            anyk = [self._links(mbs, bounds[s][1]) for s in range(len(kinds) - 1)]
            (a0, b0), (s0, tp0) = bounds[0], kinds[0]
            fixed = SketchTerms(
                half=tuple(x / 2 for x in ts), act=tuple(f for f, _ in sends), grad=tuple(g for _, g in sends),
                bwd0=c.compute(slots[s0].gpu_type, mbs, tp0, a0, b0).backward_s,
                opt_s=max(c.optimizer_s(slots[si].gpu_type, mbs, tp, a, b)
                          for (a, b), (si, tp) in zip(bounds, kinds, strict=True)),
                usd_per_hour=float(sum(tp * slots[si].usd_per_gpu_hour for si, tp in kinds)),
                act_any=tuple(x.forward for x in anyk), grad_any=tuple(x.back for x in anyk))
            if len(self._terms) > 200_000:
                self._terms.clear()
            self._terms[(mbs, bounds, kinds)] = fixed
        return fixed

    def score(self, mbs: int, bounds: Bounds, kinds: tuple[Kind, ...], d: int, n: int, cutoff: float, *,
              sends: bool = True) -> float:
        """A score floor of the sketch at D; its gradient ring only when it can matter (below `cutoff`);
        without `sends`, each boundary's sends at the cheapest between any two kinds, not the sketch's
        own (a looser floor: see `Search._assign`)."""
        f = self._fixed(mbs, bounds, kinds)
        m = -(-n // d)
        # simulator.schedule.lower_bound_1f1b with the kinds' cheapest sends: stage b starts after the
        # stages and sends before it have run microbatch 0 both ways, computes m microbatches and waits
        # for its neighbours' messages (the estimate's sends, on the zones placed, are never cheaper)
        act, grad = (f.act, f.grad) if sends else (f.act_any, f.grad_any)
        t = f.opt_s + lower_bound_1f1b(f.half, f.half, act, grad, m)
        # The gradient ring only adds time: skip it when the sketch loses without it.
        score = self._goal.floor(t, d, f.usd_per_hour, budget=True)
        if d > 1 and score < cutoff:
            # Stage 0's gradient ring starts no earlier than its last backward (the buckets overlap
            # that backward at most) and the optimizer step follows: both bound the iteration from
            # below. Its ring on one zone is the fastest it can be (a cross-zone ring is slower).
            score = self._goal.floor(t + self._ring_floor(mbs, bounds[0], kinds[0], d, f.bwd0), d, f.usd_per_hour,
                                     budget=True)
        return score


    def _ring_floor(self, mbs: int, bounds0: tuple[int, int], kind0: Kind, d: int, bwd0: float) -> float:
        """The least time stage 0's gradient ring adds after its last backward (`dp_sync_end_s` - finish):
        the ring on one zone of its slot, the fastest of them (zones differ in their measured links)."""
        slot = self._pb.slots[kind0[0]]
        least = math.inf
        for zone, _ in slot.zones:
            ar, ar_last, first_bwd = self._costs.dp_sync_terms(slot, kind0[1], ((zone, d),), mbs, *bounds0)
            least = min(least, max(ar_last, ar - bwd0 + first_bwd))
        return least


@dataclass(frozen=True)
class SketchTerms:
    """The D-free terms of one sketch's bound: half of each stage's compute (the bound sees only
    forward + backward), each boundary's cheapest activation and gradient between the sketch's kinds,
    stage 0's backward, the slowest optimizer step, the USD/hour of one pipeline, and each boundary's
    cheapest activation and gradient between any two kinds (`LinkSends`)."""

    half: tuple[float, ...]
    act: tuple[float, ...]
    grad: tuple[float, ...]
    bwd0: float
    opt_s: float
    usd_per_hour: float
    act_any: tuple[float, ...]  # each boundary's cheapest activation between any two kinds
    grad_any: tuple[float, ...]
