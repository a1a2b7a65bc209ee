"""Lower bounds on a score: what lets the search skip a split, a bottleneck or a sketch unestimated.

Contract: every bound here is admissible (never above the `scoring.score` of anything it rules out,
checked against the exact 1F1B schedule in tests/test_simulator_schedule.py and against brute force
in tests/test_planner_kernel.py). `Floor` holds the lower-bound terms of one (microbatch size, split);
`floor_of` builds it from the stage table, the cheapest sends (`links.LinkFloors`), the TPs the GPU
share of D pipelines allows and the pool's fluid bound (`fluid_s`: its GPU-seconds, by weak
duality); `bound` reads it for a bottleneck time tau (`simulator.schedule.lower_bound_1f1b`'s terms,
some stage at tau and the others at their cheapest, the ring of layer 0's gradient bucket; cost:
that time x the cheapest GPUs). `SketchFloors.score` bounds one sketch: its own stage times, each
boundary's sends at the floor of its two kinds (the least over the zones of their slots, so wherever
the placement puts the stages) and stage 0's gradient ring on the fastest zone of its slot
(`RingTails`). `DepthFloors` bounds a whole (microbatch size, stage count) before any split is
listed: what a search stopped by its time budget left unsearched. The memos are caches of pure
answers: they change what is computed, never a result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sailor_core.planner.costs import Costs
from sailor_core.planner.links import Kind, LinkFloors, PairSends
from sailor_core.planner.scoring import SECONDS_PER_HOUR, Goal
from sailor_core.planner.shapes import Bounds, StageTable, d_values
from sailor_core.planner.space import Problem
from sailor_core.simulator.schedule import held_s, lower_bound_1f1b


@dataclass(frozen=True)
class Floor:
    """Lower-bound terms of one (mbs, partition), stage by stage, for `schedule.lower_bound_1f1b`.

    D pipelines share the pool's GPUs: each gets at most `share(D)` (of each slot, cap // D: D copies of
    one usage fit the slot, within `gpus` in all), so a stage may take a TP no larger than
    its own least TP plus what the other stages' least TPs leave (`times`). With those, stage b is
    reached no earlier than the cheapest stages and sends before it (both ways), computes m
    microbatches of at least its cheapest time, waits at least (m - 1) `act[b]` and m `grad[b]` for its
    neighbours, or idles while microbatches go down the stages and sends after it and back; `opt` is
    the least optimizer step that ends the iteration, `ring` the least stage 0's gradient ring adds after
    its last backward (its last bucket, which holds layer 0: `RingTails.last_bucket`)."""

    options: tuple[tuple[tuple[int, float], ...], ...]  # per stage: (TP, least seconds at it in any slot)
    fill: tuple[float, ...]  # per boundary: the cheapest forward + back
    act: tuple[float, ...]  # the cheapest activation into stage b (0 for the first)
    grad: tuple[float, ...]  # the cheapest gradient into stage b (0 for the last)
    opt: float
    rate: float  # USD/hour of the cheapest GPUs per pipeline
    gpus: int  # what the pool offers all pipelines
    caps: tuple[int, ...] = ()  # GPUs per slot (empty: only `gpus` is known)
    fluid: float = 0.0  # the least seconds the pool's GPUs take for every microbatch of every stage (`fluid_s`)
    work_usd: float = 0.0  # the least USD every microbatch's compute costs: each stage at its least GPU-s x price
    pairs: tuple[PairSends, ...] = field(default=(), compare=False)  # per boundary: its sends floor per kind pair
    # the least time stage 0's gradient ring adds after its last backward, at D replicas (None: 0)
    ring: Callable[[int], float] | None = field(default=None, compare=False, repr=False)
    memo: dict[object, object] = field(default_factory=dict, compare=False, repr=False)

    def share(self, d: int) -> int:
        """The most GPUs one of D identical pipelines can use: of each slot cap // d (D copies of its usage
        fit there), at most `gpus` // d in all."""
        if not self.caps:
            return self.gpus // d
        return min(self.gpus // d, sum(c // d for c in self.caps))

    @property
    def best(self) -> tuple[float, ...]:
        """Each stage's cheapest seconds per microbatch, whatever its TP."""
        return tuple(min(t for _, t in opts) for opts in self.options)

    def times(self, d: int) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]] | None:
        """(each stage's least seconds within D pipelines' GPU share, the reach of each stage, the tail
        after it); None when the share is below the pipeline's least GPUs."""
        extra = self.share(d) - sum(opts[0][0] for opts in self.options)
        if extra < 0:
            return None
        key = ("times", extra)
        v = self.memo.get(key)
        if v is None:
            best = tuple(min(t for tp, t in opts if tp <= opts[0][0] + extra) for opts in self.options)
            p = len(best)
            reach, tail = [0.0] * p, [0.0] * p
            for b in range(1, p):
                reach[b] = reach[b - 1] + best[b - 1] + self.fill[b - 1]
            for b in range(p - 2, -1, -1):
                tail[b] = tail[b + 1] + best[b + 1] + self.fill[b]
            v = self.memo[key] = (best, tuple(reach), tuple(tail))
        return v  # type: ignore[return-value]

    def slowest_at_least(self, d: int) -> float:
        """The least bottleneck D pipelines can have within the pool's GPUs: the first threshold at which
        every stage's smallest TP within it fits one pipeline in gpus // D; infinite when none does."""
        need = self.memo.get("need")
        if need is None:
            need = self.memo["need"] = _need(self.options)
        share = self.share(d)
        for tau, gpus in need:  # type: ignore[attr-defined]
            if gpus <= share:
                return float(tau)
        return math.inf

    def least_at(self, m: int, tau: float, d: int) -> float:
        """The least pipeline time of D pipelines of m microbatches whose slowest stage computes at least
        tau, every stage at least its cheapest time within the GPU share (`schedule.lower_bound_1f1b`'s
        terms): some stage computes m x tau after its reach and beside its waits (which stage is not
        known: the least over them), and each stage at its cheapest time adds its reach and the longer of
        its waits and its idle (a stage's split of its time between forward and backward is not known:
        halves hold the least idle, `schedule.held_s`)."""
        key = ("at", d, m)
        v = self.memo.get(key)
        if v is None:
            terms = self.times(d)
            if terms is None:
                v = (math.inf, math.inf)
            else:
                best, reach, tail = terms
                p = len(best)
                waits = [(m - 1) * a + m * g for a, g in zip(self.act, self.grad, strict=True)]
                some = min(reach[b] + waits[b] for b in range(p))
                every = max(reach[b] + m * best[b] + held_s(waits[b], tail[b], best[b] / 2, best[b] / 2, p - 1 - b, m)
                            for b in range(p))
                v = (some, every)
            self.memo[key] = v
        some, every = v  # type: ignore[misc]
        return max(m * tau + some, every)


def bound(goal: Goal, tau: float, lb: Floor, n: int, d_list: Sequence[int]) -> float:
    """A lower bound on the score of anything with compute bottleneck >= tau, at any D of d_list."""
    return min(bounds_at(goal, tau, lb, n, d_list), default=math.inf)


def bounds_at(goal: Goal, tau: float, lb: Floor, n: int, d_list: Sequence[int]) -> list[float]:
    """`bound` at each D of d_list on its own."""
    out = []
    for d in d_list:
        m = -(-n // d)
        # D pipelines share the pool's GPUs: the fewer each gets, the slower its TPs and its slowest stage
        slowest = max(tau, lb.slowest_at_least(d))
        if not math.isfinite(slowest):
            out.append(math.inf)
            continue
        # stage 0 ends the pipeline (1F1B), then the ring of its gradient's last bucket (the one that holds
        # layer 0) and the optimizer step
        t = lb.opt + max(lb.least_at(m, slowest, d), lb.fluid) + (lb.ring(d) if lb.ring is not None and d > 1 else 0.0)
        out.append(goal.floor(t, d, lb.rate, budget=False, work_usd=lb.work_usd))
    return out


def floor_of(pb: Problem, costs: Costs, links: LinkFloors, mbs: int, bounds: Bounds, table: StageTable,
             rings: RingTails | None = None) -> Floor:
    """The lower-bound terms of a split from its stage table: each stage's least time per TP, every
    boundary's cheapest message each way, the least optimizer step, the cheapest GPUs' price and the
    least ring stage 0 adds."""
    p = len(bounds)
    slots = pb.slots
    options = []
    for s in range(p):
        least: dict[int, float] = {}
        for row in table[s]:
            for tp, t in row:
                least[tp] = min(least.get(tp, math.inf), t)
        options.append(tuple(sorted(least.items())))
    min_rate = [min(tp * slots[g].usd_per_gpu_hour for g, row in enumerate(table[s]) for tp, _ in row)
                for s in range(p)]
    sends = [links(mbs, bounds[b][1]) for b in range(p - 1)]
    opt_lb = max(
        min(costs.optimizer_s(slots[g].gpu_type, mbs, tp, *bounds[s]) for g, row in enumerate(table[s])
            for tp, _ in row)
        for s in range(p)
    )
    caps = sum(sl.capacity for sl in slots)
    tails = rings or RingTails(pb, costs)

    def ring(d: int) -> float:
        return tails.last_bucket(mbs, d)

    gpu_s = [[min((t * tp for tp, t in row), default=math.inf) for row in table[s]] for s in range(p)]
    n = pb.global_batch_size // mbs
    fluid = fluid_s(gpu_s, [sl.capacity for sl in slots], pb.max_gpus, n)
    # whatever the plan, each microbatch runs every stage on some kind, which its GPUs pay for meanwhile
    work = n * sum(min((x * slots[g].usd_per_gpu_hour for g, x in enumerate(row)), default=math.inf)
                   for row in gpu_s) / SECONDS_PER_HOUR
    return Floor(options=tuple(options), fill=tuple(x.fill for x in sends), gpus=min(caps, pb.max_gpus or caps),
                 caps=tuple(sl.capacity for sl in slots),
                 fluid=fluid,
                 ring=ring, act=tuple([0.0] + [x.forward for x in sends]),
                 grad=tuple([x.back for x in sends] + [0.0]), opt=opt_lb, rate=sum(min_rate), work_usd=work,
                 pairs=tuple(links.pairs(mbs, bounds[b][1]) for b in range(p - 1)))


def fluid_s(gpu_s: Sequence[Sequence[float]], caps: Sequence[int], max_gpus: int | None, n: int) -> float:
    """A lower bound on the seconds the pool takes to compute n microbatches through every unit (a stage,
    or a layer), whatever the plan: unit u costs gpu_s[u][g] GPU-seconds per microbatch on slot g (its
    least time x TP), slot g offers caps[g] GPUs. Fluid relaxation (GPUs shared by the second, no
    bubbles, messages or memory): with T seconds slot g offers T caps[g] GPU-seconds, so for any prices
    y_g >= 0 with sum_g y_g caps[g] = 1, T >= n sum_u min_g y_g gpu_s[u][g] (weak duality). Prices
    y_g proportional to 1 / (slot g's GPU-seconds for every unit) make it the pool's aggregate rate
    when the slots' speed ratios are the same on every unit."""
    caps = [min(c, max_gpus) if max_gpus is not None else c for c in caps]
    # a slot's GPU-seconds over the units it can run (a unit that fits nowhere on it costs it nothing here:
    # the prices must stay finite for the duality to hold)
    whole = [sum(row[g] for row in gpu_s if math.isfinite(row[g])) for g in range(len(caps))]
    weights = [c / w if c > 0 and w > 0 else 0.0 for c, w in zip(caps, whole, strict=True)]
    total = sum(weights)
    if total <= 0:
        return 0.0
    prices = [(1.0 / w) / total if c > 0 and w > 0 else 0.0 for c, w in zip(caps, whole, strict=True)]
    return n * sum(min((y * c for y, c in zip(prices, row, strict=True) if y > 0), default=math.inf) for row in gpu_s)


def _need(options: Sequence[Sequence[tuple[int, float]]]) -> tuple[tuple[float, int], ...]:
    """(threshold, GPUs) for each stage time: the least GPUs one pipeline needs when each stage takes
    its smallest TP whose time is within the threshold (GPUs never grow as thresholds do)."""
    taus = sorted({t for opts in options for _, t in opts})
    out: list[tuple[float, int]] = []
    for tau in taus:
        need = 0
        for opts in options:
            least = min((tp for tp, t in opts if t <= tau), default=0)
            if not least:
                break
            need += least
        else:
            if not out or need < out[-1][1]:
                out.append((tau, need))
    return tuple(out)


class DepthFloors:
    """Lower bounds of whole stage counts, before any split is listed: a pipeline of P stages whose D
    copies share the pool's G GPUs computes each microbatch in at least the sum over layers of their
    fastest time (any slot, any TP) and, per stage, at least the larger of that sum / P and the layers'
    least GPU-seconds / (G // D) (a stage's TP group holds its share of the GPU-seconds); 1F1B then
    takes at least (m - 1) x that bottleneck + the sum. Memory and messages are left out (a bound)."""

    def __init__(self, pb: Problem, costs: Costs, goal: Goal) -> None:
        self._pb = pb
        self._costs = costs
        self._goal = goal
        self._layers: dict[int, tuple[float, float, float, float, float]] = {}
        caps = sum(s.capacity for s in pb.slots)
        self._gpus = min(caps, pb.max_gpus or caps)

    def _per_mbs(self, mbs: int) -> tuple[float, float, float, float, float]:
        """(the layers' fastest seconds, their least GPU-seconds, the cheapest USD per GPU-hour, the pool's
        fluid bound `fluid_s` over layers, the least USD per microbatch: each layer at its least GPU-seconds
        x price) at mbs."""
        v = self._layers.get(mbs)
        if v is None:
            pb, c = self._pb, self._costs
            kinds = [(s, tp) for s in pb.slots if s.capacity for tp in pb.tp_values
                     if tp <= s.gpus_per_node and c.profiled(s.gpu_type, mbs, tp)]
            fast = gsec = usd = 0.0
            per_slot = []
            for layer in range(pb.num_layers):
                times = [(c.compute(s.gpu_type, mbs, tp, layer, layer).total_s, tp, s.index) for s, tp in kinds]
                fast += min((t for t, _, _ in times), default=math.inf)
                gsec += min((t * tp for t, tp, _ in times), default=math.inf)
                usd += min((t * tp * pb.slots[g].usd_per_gpu_hour for t, tp, g in times), default=math.inf)
                per_slot.append([min((t * tp for t, tp, g in times if g == s.index), default=math.inf)
                                 for s in pb.slots])
            price = min((s.usd_per_gpu_hour for s, _ in kinds), default=math.inf)
            fluid = fluid_s(per_slot, [s.capacity for s in pb.slots], pb.max_gpus, pb.global_batch_size // mbs)
            v = self._layers[mbs] = (fast, gsec, price, fluid, usd / SECONDS_PER_HOUR)
        return v

    def floor(self, mbs: int, p: int) -> float:
        """A score floor of every plan of p stages at microbatch size mbs."""
        fast, gsec, price, fluid, usd = self._per_mbs(mbs)
        n = self._pb.global_batch_size // mbs
        if not math.isfinite(fast) or self._gpus < p:
            return math.inf
        best = math.inf
        for d in d_values(n, self._gpus // p):
            slowest = max(fast / p, gsec / (self._gpus // d))
            t = max((-(-n // d) - 1) * slowest + fast, fluid)
            best = min(best, self._goal.floor(t, d, p * price, budget=False, work_usd=n * usd))
        return best


class SketchFloors:
    """Score lower bounds of whole sketches with their sends at the floor of their kinds (`LinkFloors.pairs`:
    the least over the slots' zones, wherever the placement puts them) and their gradient ring at its
    fastest; the terms that do not depend on D are kept per (mbs, bounds, kinds)."""

    def __init__(self, pb: Problem, costs: Costs, goal: Goal, links: LinkFloors, rings: RingTails | None = None,
                 shared: SketchFloors | None = None) -> None:
        """`shared`: the floors of a search over the same slots, whose D-free terms these reuse."""
        self._pb = pb
        self._costs = costs
        self._goal = goal
        self._links = links
        self._rings = rings or RingTails(pb, costs)
        self._terms: dict[tuple[object, ...], SketchTerms] = shared._terms if shared is not None else {}

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
            ring = self._rings.tail(mbs, bounds[0], kinds[0], d, f.bwd0)  # after stage 0's last backward
            score = self._goal.floor(t + ring, d, f.usd_per_hour, budget=True)
        return score


class RingTails:
    """`ring_tail` memoised per (microbatch size, stage 0's layers, its kind, D): splits of every stage
    count share their first stage's layers, and each sketch of a split its kinds."""

    def __init__(self, pb: Problem, costs: Costs) -> None:
        self._pb = pb
        self._costs = costs
        self._memo: dict[tuple[object, ...], float] = {}

    def last_bucket(self, mbs: int, d: int) -> float:
        """The least ring of layer 0's gradient alone over D replicas in one zone, any slot and TP: stage 0's
        last bucket holds layer 0 (buckets fill from the last layer back) and its ring starts after stage 0's
        last backward, which ends the pipeline, so every plan of D > 1 pipelines pays at least this after it."""
        key = ("last", mbs, d)
        v = self._memo.get(key)
        if v is None:
            pb, c = self._pb, self._costs
            v = min((c.dp_sync_terms(s, tp, ((z, d),), mbs, 0, 0)[1] for s in pb.slots for tp in pb.tp_values
                     if tp <= s.gpus_per_node and c.profiled(s.gpu_type, mbs, tp) for z in c.ring_zones(s)),
                    default=0.0)
            self._memo[key] = v
        return v

    def tail(self, mbs: int, bounds0: tuple[int, int], kind0: Kind, d: int, bwd0: float | None = None) -> float:
        """`ring_tail` of `kind0` at D replicas, memoised."""
        key = (mbs, bounds0, kind0, d, bwd0)
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = ring_tail(self._pb, self._costs, mbs, bounds0, kind0, d, bwd0)
        return v


def ring_tail(pb: Problem, costs: Costs, mbs: int, bounds0: tuple[int, int], kind0: Kind, d: int,
              bwd0: float | None = None) -> float:
    """The least time stage 0's gradient ring of D replicas of `kind0` adds after its last backward
    (`dp_sync_end_s` - finish; `bwd0`: the stage's backward, its compute without recomputation by default):
    the ring on one zone of its slot, the fastest of them (zones differ in their measured links; a
    cross-zone ring is slower)."""
    slot = pb.slots[kind0[0]]
    if bwd0 is None:
        bwd0 = costs.compute(slot.gpu_type, mbs, kind0[1], *bounds0).backward_s
    least = math.inf
    for zone in costs.ring_zones(slot):
        ar, ar_last, first_bwd = costs.dp_sync_terms(slot, kind0[1], ((zone, d),), mbs, *bounds0)
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
