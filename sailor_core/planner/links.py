"""Link floors: the least a boundary's sends can cost between two GPU kinds, wherever they are placed.

Contract: memoised pure answers of the `Costs` protocol (they change what is computed, never a
result). Per boundary (keyed by its microbatch size and the message each TP sends across it),
`LinkFloors` gives the `LinkSends` over every pair of kinds, the `PairSends` of each pair of kinds
(its sends' floor: the least over the zones of both slots, so wherever the placement puts the two
stages) and the `PairTolls` (its egress's floor per microbatch). A pair of kinds with no network
profile between any of their zones has infinite sends: the assign step's DP never takes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

from sailor_core.planner.costs import Costs
from sailor_core.planner.estimate import BYTES_PER_GB, fwd_bwd, round_trip_usd_per_gb
from sailor_core.planner.slots import Slot
from sailor_core.planner.space import Problem

Kind = tuple[int, int]  # a stage's (slot index, tp)



# The least (activation forward, gradient back) seconds across one boundary from a stage of the first
# kind to one of the second, over every zone of each kind's slot.
PairSends = dict[tuple[Kind, Kind], tuple[float, float]]



# The least egress USD one microbatch pays across one boundary (its activation forward and its gradient
# back) from a stage of the first kind to one of the second, over every zone of each kind's slot: 0 where
# the two slots share a zone.
PairTolls = dict[tuple[Kind, Kind], float]  # empty: no egress across the boundary wherever its stages go



@dataclass(frozen=True)
class LinkSends:
    """The cheapest sends across one boundary over any pair of GPU kinds in one zone each."""

    one_way: float  # the least of max(forward, back): what a steady-state microbatch pays at least
    fill: float  # the least forward + back: what the first microbatch pays
    forward: float  # the least activation on its own
    back: float  # the least gradient on its own



class LinkFloors:
    """Per boundary, computed once per distinct message: the `LinkSends` over every pair of kinds, and
    the `PairSends` and `PairTolls` of each pair of kinds (its sends' and its egress's floor wherever the
    placement puts the two stages: the least over the slots' zones). A boundary is keyed by its
    microbatch size and the message each TP sends across it: a transformer's blocks all send the same
    activation, so most boundaries of a model share one answer. The answers depend on the slots' GPU
    types, node shapes and zones, not on their GPU counts: searches of one request over parts of its
    pool (each slot alone, what a plan leaves) share one `LinkFloors`."""

    def __init__(self, pb: Problem, costs: Costs) -> None:
        self._pb = pb
        self._costs = costs
        self._keys: dict[tuple[int, int], tuple[int, tuple[float, ...]]] = {}
        self._memo: dict[tuple[int, tuple[float, ...]], tuple[LinkSends, PairSends]] = {}
        self._tolls: dict[tuple[int, tuple[float, ...]], PairTolls] = {}

    def __call__(self, mbs: int, last: int) -> LinkSends:
        return self._of(mbs, last)[0]

    def pairs(self, mbs: int, last: int) -> PairSends:
        return self._of(mbs, last)[1]

    def tolls(self, mbs: int, last: int) -> PairTolls:
        """The `PairTolls` of the boundary after layer `last` (empty where no pair of kinds pays egress)."""
        key = self._key(mbs, last)
        v = self._tolls.get(key)
        if v is None:
            v = self._tolls[key] = self._least_egress(mbs, last)
        return v

    def _key(self, mbs: int, last: int) -> tuple[int, tuple[float, ...]]:
        k = self._keys.get((mbs, last))
        if k is None:
            c = self._costs
            tps = sorted({ta for a in self._pb.slots for ta in self._pb.tp_values
                          if ta <= a.gpus_per_node and c.profiled(a.gpu_type, mbs, ta)})
            k = self._keys[(mbs, last)] = (mbs, tuple(c.boundary_bytes(tp, last, mbs) for tp in tps))
        return k

    def _ends(self, mbs: int, last: int) -> list[tuple[Slot, int, str, float]]:
        """(slot, TP, zone, message bytes) of every profiled kind that fits a node, in each of its zones."""
        c = self._costs
        return [(a, ta, za, c.boundary_bytes(ta, last, mbs)) for a in self._pb.slots for ta in self._pb.tp_values
                if ta <= a.gpus_per_node and c.profiled(a.gpu_type, mbs, ta) for za, _ in a.zones]

    def _least_egress(self, mbs: int, last: int) -> PairTolls:
        c = self._costs
        tolls: PairTolls = {}
        for (a, ta, za, msg), (b, tb, zb, _) in product(self._ends(mbs, last), repeat=2):
            key = ((a.index, ta), (b.index, tb))
            tolls[key] = min(tolls.get(key, math.inf), msg / BYTES_PER_GB * round_trip_usd_per_gb(c, za, zb))
        return tolls if any(tolls.values()) else {}

    def _of(self, mbs: int, last: int) -> tuple[LinkSends, PairSends]:
        key = self._key(mbs, last)
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = self._cheapest(mbs, last)
        return v

    def _cheapest(self, mbs: int, last: int) -> tuple[LinkSends, PairSends]:
        c, pb = self._costs, self._pb
        one = both = lo_f = lo_b = math.inf
        pairs: PairSends = {}
        tps = {a.index: [t for t in pb.tp_values if t <= a.gpus_per_node and c.profiled(a.gpu_type, mbs, t)]
               for a in pb.slots}
        for a, b in product(pb.slots, repeat=2):
            # one pair of zones per class: the others time every send the same (`Costs.link_class`)
            reps: dict[int, tuple[str, str]] = {}
            for (za, _), (zb, _) in product(a.zones, b.zones):
                reps.setdefault(c.link_class(a, za, b, zb), (za, zb))
            for ta, tb in product(tps[a.index], tps[b.index]):
                msg = c.boundary_bytes(ta, last, mbs)
                least_f = least_b = math.inf
                for za, zb in reps.values():
                    # the estimate times a send with the pipelines that share a node's link (`costs.nic_share`:
                    # up to a node's TP groups); a link's fit may give each flow more speed with more of them
                    f, bk = math.inf, math.inf
                    for share in range(1, max(a.gpus_per_node // ta, b.gpus_per_node // tb, 1) + 1):
                        sf, sb = fwd_bwd(c.p2p_s(a, ta, za, b, tb, zb, msg, share))
                        f, bk = min(f, sf), min(bk, sb)
                    one, both = min(one, max(f, bk)), min(both, f + bk)
                    lo_f, lo_b = min(lo_f, f), min(lo_b, bk)
                    least_f, least_b = min(least_f, f), min(least_b, bk)
                pairs[((a.index, ta), (b.index, tb))] = (least_f, least_b)
        sends = LinkSends(*(x if math.isfinite(x) else 0.0 for x in (one, both, lo_f, lo_b)))
        return sends, pairs
