"""The shapes step: which layer splits, stage tables, data-parallel degrees and neighbour sketches to try.

Contract: pure functions of a `Problem` and the `Costs` protocol (no search state). For one
microbatch size and stage count P: `partitions` yields the contiguous layer splits worth
searching (every one when there are few; else the uniform split and one balanced per GPU type's
profile), `stage_table` the (TP, seconds per microbatch) options of every stage in every slot that
are profiled, fit a node and fit in memory with the 1F1B in-flight microbatches, and `d_values`
the data-parallel degrees worth estimating (the smallest of each distinct microbatch count). After
the sweep, `rebalanced` re-splits a sketch's layers for the GPUs it chose (min-max stage time,
memory-checked) and `kind_changes` lists its neighbours with one stage on another GPU kind or two
stages' kinds swapped (the local search's moves).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from itertools import combinations

from sailor_core.planner.costs import Costs
from sailor_core.planner.space import Problem, Sketch

Bounds = tuple[tuple[int, int], ...]
# table[stage][slot] = [(tp, seconds per microbatch)]: the TPs that fit without recomputing, ascending, then
# the smaller ones that fit only recomputing (`stage_table`)
StageTable = list[list[list[tuple[int, float]]]]


def bounds_from_cuts(cuts: Sequence[int], num_layers: int) -> Bounds:
    """The stage bounds (first, last layer) of a split whose stages start at each cut."""
    edges = [0, *cuts, num_layers]
    return tuple((edges[i], edges[i + 1] - 1) for i in range(len(edges) - 1))


def uniform_partition(num_layers: int, p: int) -> Bounds:
    """Layers split as evenly as counts allow; the first stages take the extra layer."""
    base, extra = divmod(num_layers, p)
    out = []
    first = 0
    for s in range(p):
        size = base + (1 if s < extra else 0)
        out.append((first, first + size - 1))
        first += size
    return tuple(out)


def balanced_partition(times: Sequence[float], p: int) -> Bounds | None:
    """Contiguous split of per-layer times into p parts minimising the largest part (exact DP)."""
    L = len(times)
    if p > L:
        return None
    pre = [0.0]
    for t in times:
        pre.append(pre[-1] + t)
    inf = math.inf
    # f[k][i]: best max over the first i layers in k parts
    f = [[inf] * (L + 1) for _ in range(p + 1)]
    arg = [[0] * (L + 1) for _ in range(p + 1)]
    f[0][0] = 0.0
    for k in range(1, p + 1):
        for i in range(k, L - (p - k) + 1):
            best, at = inf, 0
            for j in range(k - 1, i):
                v = max(f[k - 1][j], pre[i] - pre[j])
                if v < best - 1e-15:
                    best, at = v, j
            f[k][i] = best
            arg[k][i] = at
    cuts = []
    i = L
    for k in range(p, 0, -1):
        j = arg[k][i]
        cuts.append(j)
        i = j
    return bounds_from_cuts(sorted(cuts)[1:], L)


def partitions(pb: Problem, costs: Costs, p: int, mbs: int) -> Iterator[tuple[Bounds, bool]]:
    """The layer splits into p stages worth searching at microbatch size mbs, each once, with whether
    it is an even one (every split, uniform or time-balanced) rather than packed to memory."""
    L = pb.num_layers
    seen: set[Bounds] = set()
    # Every split when there are few (small models, 2 stages); deep pipelines of a large model
    # have few splits too (p close to L) but nothing to gain from them beyond uniform/balanced.
    if math.comb(L - 1, p - 1) <= pb.exhaustive_partitions_up_to and (2 * (p - 1) <= L - 1 or L <= 12):
        for cuts in combinations(range(1, L), p - 1):
            b = bounds_from_cuts(cuts, L)
            seen.add(b)
            yield b, True
        return
    uni = uniform_partition(L, p)
    seen.add(uni)
    yield uni, True
    for slot in pb.slots:
        for tp in pb.tp_values:
            if tp > slot.gpus_per_node or not costs.profiled(slot.gpu_type, mbs, tp):
                continue
            times = [costs.compute(slot.gpu_type, mbs, tp, i, i).total_s for i in range(L)]
            bal = balanced_partition(times, p)
            if bal is not None and bal not in seen:
                seen.add(bal)
                yield bal, True
            break  # the smallest profiled TP of each GPU type is enough to shape the split
    # Where no GPU type holds the uniform split at its largest TP (1F1B: the first stages keep the most
    # microbatches in flight), the split that packs each stage as full as it fits there; the re-split
    # pass (`rebalanced`) then evens it out for time within memory.
    largest = [(slot, max(tps)) for slot in pb.slots
               if (tps := [tp for tp in pb.tp_values
                           if tp <= slot.gpus_per_node and costs.profiled(slot.gpu_type, mbs, tp)])]
    if any(all(_fits_plain(costs, slot.gpu_type, tp, a, b, s, p, mbs) for s, (a, b) in enumerate(uni))
           for slot, tp in largest):
        return  # some GPU type holds the even split: memory does not shape this stage count
    for slot, tp in largest:
        packed = (packed_partition(costs, slot.gpu_type, tp, mbs, p, L, plain=True)
                  or packed_partition(costs, slot.gpu_type, tp, mbs, p, L))
        if packed is not None and packed not in seen:
            seen.add(packed)
            yield packed, False


def packed_partition(costs: Costs, gpu: str, tp: int, mbs: int, p: int, num_layers: int, *, plain: bool = False
                     ) -> Bounds | None:
    """The split into p stages whose every stage but the last takes as many layers as fit in memory with
    its p - s microbatches in flight (`plain`: without recomputing activations); None when even that
    leaves too many for the last stage. Taking the most each time leaves the last stage the fewest
    layers any split can, so None means no split fits."""
    fits = _fits_plain if plain else _fits
    out = []
    first = 0
    for s in range(p - 1):
        last = first - 1
        while last + 1 < num_layers - (p - s - 1) and fits(costs, gpu, tp, first, last + 1, s, p, mbs):
            last += 1
        if last < first:
            return None
        out.append((first, last))
        first = last + 1
    if not fits(costs, gpu, tp, first, num_layers - 1, p - 1, p, mbs):
        return None
    return (*out, (first, num_layers - 1))


def d_values(n: int, d_max: int) -> list[int]:
    """The smallest D for each distinct microbatch count ceil(n/D), D <= d_max (a larger D with the
    same count only adds GPUs and ring length: paper heuristic)."""
    out = []
    last_m = None
    for d in range(1, min(n, d_max) + 1):
        m = -(-n // d)
        if m != last_m:
            out.append(d)
            last_m = m
    return out


def _fits_plain(costs: Costs, gpu_type: str, tp: int, first: int, last: int, s: int, p: int, mbs: int) -> bool:
    """`_fits` without recomputing activations (under "always" nothing does)."""
    return _fits(costs, gpu_type, tp, first, last, s, p, mbs) and not costs.recomputes(
        gpu_type, tp, first, last, mbs=mbs, in_flight=p - s, first_stage=s == 0, last_stage=s == p - 1)


def _fits(costs: Costs, gpu_type: str, tp: int, first: int, last: int, s: int, p: int, mbs: int) -> bool:
    """Whether layers first..last as stage s of p fit in memory on this GPU at this TP (1F1B: p - s in flight)."""
    return costs.fits(gpu_type, tp, first, last, mbs=mbs, in_flight=p - s,
                      first_stage=s == 0, last_stage=s == p - 1)


def stage_table(pb: Problem, costs: Costs, mbs: int, bounds: Bounds) -> StageTable | None:
    """table[s][slot] = [(tp, seconds per microbatch)] for TPs that are profiled and fit (see `StageTable`);
    None when some stage fits nowhere."""
    p = len(bounds)
    table = []
    for s, (first, last) in enumerate(bounds):
        row = []
        any_ok = False
        for slot in pb.slots:
            opts, plain = [], []
            for tp in pb.tp_values:
                if tp > slot.gpus_per_node or not costs.profiled(slot.gpu_type, mbs, tp):
                    continue
                if not _fits(costs, slot.gpu_type, tp, first, last, s, p, mbs):
                    continue
                opts.append((tp, costs.stage_compute(slot.gpu_type, mbs, tp, first, last, in_flight=p - s,
                                                     first_stage=s == 0, last_stage=s == p - 1).total_s))
                if _fits_plain(costs, slot.gpu_type, tp, first, last, s, p, mbs):
                    plain.append(opts[-1])
            # The TPs that fit without recomputation first, then the smaller ones that fit only with it:
            # a TP that fits plain keeps its place among `Problem.tp_options` (the options are taken in
            # this order), and a pool too short of this GPU for the plain TP still has the smaller group.
            opts = plain + [o for o in opts if o not in plain and (not plain or o[0] < plain[0][0])]
            any_ok |= bool(opts)
            row.append(opts)
        if not any_ok:
            return None
        table.append(row)
    return table


def kind_changes(pb: Problem, costs: Costs, sk: Sketch) -> Iterator[Sketch]:
    """The sketch with one stage on another (slot, tp) kind that fits, then with two stages' different
    kinds swapped where both still fit: the moves of the network-aware local search."""
    p = sk.num_stages
    kinds_all = [
        (g, tp) for g, slot in enumerate(pb.slots) for tp in pb.tp_values
        if tp <= slot.gpus_per_node and costs.profiled(slot.gpu_type, sk.mbs, tp)
    ]
    for s in range(p):
        for k in kinds_all:
            if k != sk.kinds[s] and _fits(costs, pb.slots[k[0]].gpu_type, k[1], *sk.bounds[s], s, p, sk.mbs):
                kinds = sk.kinds[:s] + (k,) + sk.kinds[s + 1:]
                yield Sketch(mbs=sk.mbs, bounds=sk.bounds, kinds=kinds, dp=sk.dp, placement=sk.placement)
    for s, t in combinations(range(p), 2):
        if sk.kinds[s] == sk.kinds[t]:
            continue
        kinds_l = list(sk.kinds)
        kinds_l[s], kinds_l[t] = kinds_l[t], kinds_l[s]
        if all(_fits(costs, pb.slots[kinds_l[i][0]].gpu_type, kinds_l[i][1], *sk.bounds[i], i, p,
                                      sk.mbs) for i in (s, t)):
            yield Sketch(mbs=sk.mbs, bounds=sk.bounds, kinds=tuple(kinds_l), dp=sk.dp, placement=sk.placement)


def rebalanced(pb: Problem, costs: Costs, sk: Sketch) -> Bounds | None:
    """The sketch's layers re-split for the GPU kinds it chose: the least bottleneck stage time whose
    greedy split fits memory stage by stage without recomputing activations, else with (None when no
    split fits). Recomputing stages are not mixed into the first: their extra forward makes a stage's
    time jump where recomputation starts, and the bisection needs it to grow with the layers."""
    return _rebalanced(pb, costs, sk, plain=True) or _rebalanced(pb, costs, sk, plain=False)


def _rebalanced(pb: Problem, costs: Costs, sk: Sketch, *, plain: bool) -> Bounds | None:
    L = pb.num_layers
    p = sk.num_stages
    slots = pb.slots

    def stage_t(s: int, first: int, last: int) -> float:
        si, tp = sk.kinds[s]
        return costs.stage_compute(slots[si].gpu_type, sk.mbs, tp, first, last, in_flight=p - s, first_stage=s == 0,
                                   last_stage=s == p - 1).total_s

    def fits(s: int, first: int, last: int) -> bool:
        si, tp = sk.kinds[s]
        return (_fits_plain if plain else _fits)(costs, slots[si].gpu_type, tp, first, last, s, p, sk.mbs)

    def greedy(tau: float) -> Bounds | None:
        out = []
        first = 0
        for s in range(p):
            left_stages = p - s - 1
            last = first
            if stage_t(s, first, last) > tau or not fits(s, first, last):
                return None
            while (
                last + 1 <= L - 1 - left_stages and stage_t(s, first, last + 1) <= tau and fits(s, first, last + 1)
            ):
                last += 1
            if s == p - 1 and last != L - 1:
                return None
            out.append((first, last))
            first = last + 1
        return tuple(out)

    return least_bottleneck(greedy, lambda b: max(stage_t(s, a, z) for s, (a, z) in enumerate(b)),
                            hi=sum(stage_t(s, 0, L - 1) for s in range(p)))


def least_bottleneck(split: Callable[[float], Bounds | None], bottleneck: Callable[[Bounds], float],
                     hi: float) -> Bounds | None:
    """The split at the least bottleneck time for which `split(tau)` (monotone: feasible at tau, feasible
    above) finds one. Bisection on tau until the bounds meet, then the split at the bottleneck it found:
    that time is the least feasible one (nothing feasible lies below the infeasible bound), so the
    answer is the split at the exact optimum, with O(log) calls instead of one per candidate time."""
    best = split(hi)
    if best is None:
        return None
    lo = 0.0
    hi = bottleneck(best)
    while hi - lo > 1e-12 * max(hi, 1e-30):
        mid = (lo + hi) / 2
        got = split(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, min(mid, bottleneck(got))
    return split(hi) or best
