"""Lower bounds on a score: what lets the search skip a split, a bottleneck or a sketch unestimated.

Contract: every bound here is admissible (never above the `scoring.score` of anything it rules
out, checked against the exact 1F1B schedule in tests/test_simulator_schedule.py). `Floor` holds
the lower-bound terms of one (microbatch size, split); `floor_of` builds it from the stage table
and the cheapest sends (`LinkFloors`, memoised per boundary); `bound` reads it for a bottleneck
time tau (the exact schedule's bound, `simulator.schedule.lower_bound_1f1b`, with the best stage
times, some stage at tau and the cheapest messages; cost: that time x the cheapest GPUs);
`SketchFloors.score` bounds one sketch without its network terms. The memos are caches of pure
answers: they change what is computed, never a result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product

from sailor_core.planner.costs import Costs
from sailor_core.planner.estimate import fwd_bwd
from sailor_core.planner.scoring import Goal
from sailor_core.planner.shapes import Bounds, StageTable
from sailor_core.planner.space import Problem
from sailor_core.simulator.schedule import lower_bound_1f1b


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
    best = math.inf
    for d in d_list:
        m = -(-n // d)
        # some stage computes at least tau per microbatch (which one is not known: the least of
        # them), and every stage at least its cheapest time
        least_wait, floor = lb.at(m)
        t = lb.opt + max(m * tau + least_wait, floor)
        best = min(best, goal.floor(t, d, lb.rate, budget=False))
    return best


@dataclass(frozen=True)
class LinkSends:
    """The cheapest sends across one boundary over any pair of GPU kinds in one zone each."""

    one_way: float  # the least of max(forward, back): what a steady-state microbatch pays at least
    fill: float  # the least forward + back: what the first microbatch pays
    forward: float  # the least activation on its own
    back: float  # the least gradient on its own


class LinkFloors:
    """`LinkSends` per (microbatch size, last layer before the boundary), computed once each."""

    def __init__(self, pb: Problem, costs: Costs) -> None:
        self._pb = pb
        self._costs = costs
        self._memo: dict[tuple[int, int], LinkSends] = {}

    def __call__(self, mbs: int, last: int) -> LinkSends:
        v = self._memo.get((mbs, last))
        if v is None:
            v = self._memo[(mbs, last)] = self._cheapest(mbs, last)
        return v

    def _cheapest(self, mbs: int, last: int) -> LinkSends:
        c = self._costs
        # both ends range over every profiled (slot, tp) that fits a node, in each of the slot's zones;
        # the sender's message is the activation after `last` at its TP
        kinds = [(a, ta) for a in self._pb.slots for ta in self._pb.tp_values
                 if ta <= a.gpus_per_node and c.profiled(a.gpu_type, mbs, ta)]
        ends = [(a, ta, za, msg) for a, ta in kinds for msg in (c.boundary_bytes(ta, last, mbs),) for za, _ in a.zones]
        one = both = lo_f = lo_b = math.inf
        for (a, ta, za, msg), (b, tb, zb, _) in product(ends, repeat=2):
            f, bk = fwd_bwd(c.p2p_s(a, ta, za, b, tb, zb, msg))
            one, both = min(one, max(f, bk)), min(both, f + bk)
            lo_f, lo_b = min(lo_f, f), min(lo_b, bk)
        return LinkSends(*(x if math.isfinite(x) else 0.0 for x in (one, both, lo_f, lo_b)))


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
                 grad=tuple([x.back for x in sends] + [0.0]), opt=opt_lb, rate=sum(min_rate))


class SketchFloors:
    """Score lower bounds of whole sketches without their network terms (they only add time and
    egress); the terms that do not depend on D are kept per (mbs, bounds, kinds)."""

    def __init__(self, pb: Problem, costs: Costs, goal: Goal) -> None:
        self._pb = pb
        self._costs = costs
        self._goal = goal
        self._terms: dict[tuple[object, ...], tuple[tuple[float, ...], float, float, float]] = {}

    def _fixed(self, mbs: int, bounds: Bounds, kinds: tuple[tuple[int, int], ...]
               ) -> tuple[tuple[float, ...], float, float, float]:
        """(stage times, stage 0's backward, the slowest optimizer step, USD/hour per pipeline)."""
        fixed = self._terms.get((mbs, bounds, kinds))
        if fixed is None:
            slots, c = self._pb.slots, self._costs
            ts = [c.compute(slots[si].gpu_type, mbs, tp, a, b).total_s
                  for (a, b), (si, tp) in zip(bounds, kinds, strict=True)]
            (a0, b0), (s0, tp0) = bounds[0], kinds[0]
            fixed = (tuple(ts), c.compute(slots[s0].gpu_type, mbs, tp0, a0, b0).backward_s,
                     max(c.optimizer_s(slots[si].gpu_type, mbs, tp, a, b)
                         for (a, b), (si, tp) in zip(bounds, kinds, strict=True)),
                     float(sum(tp * slots[si].usd_per_gpu_hour for si, tp in kinds)))
            if len(self._terms) > 200_000:
                self._terms.clear()
            self._terms[(mbs, bounds, kinds)] = fixed
        return fixed

    def score(self, mbs: int, bounds: Bounds, kinds: tuple[tuple[int, int], ...], d: int, n: int,
              cutoff: float) -> float:
        """A score floor of the sketch at D; its gradient ring only when it can matter (below `cutoff`)."""
        times, bwd0, opt_s, usd_per_hour = self._fixed(mbs, bounds, kinds)
        m = -(-n // d)
        # simulator.schedule.lower_bound_1f1b without the sends: stage b starts after the stages
        # before it have run microbatch 0 both ways and computes m microbatches
        half = [x / 2 for x in times]
        t = opt_s + lower_bound_1f1b(half, half, [0.0] * (len(times) - 1), [0.0] * (len(times) - 1), m)
        # The gradient ring only adds time: skip it when the sketch loses without it.
        score = self._goal.floor(t, d, usd_per_hour, budget=True)
        if d > 1 and score < cutoff:
            # Stage 0's gradient ring starts no earlier than its last backward (the buckets overlap
            # that backward at most) and the optimizer step follows: both bound the iteration from
            # below. Its ring on one zone is the fastest it can be (a cross-zone ring is slower).
            slots = self._pb.slots
            (a0, b0), (s0, tp0) = bounds[0], kinds[0]
            ar, ar_last, first_bwd = self._costs.dp_sync_terms(slots[s0], tp0, ((slots[s0].zones[0][0], d),), mbs,
                                                               a0, b0)
            # dp_sync_end_s - finish >= both of these
            score = self._goal.floor(t + max(ar_last, ar - bwd0 + first_bwd), d, usd_per_hour, budget=True)
        return score
