"""Any-shape stages: pipelines of several kinds, chosen together on the whole pool.

Contract: `group_plans(search, top, ...)` returns `ParallelPlan`s for the caller to verify with the
full simulator. Pure and deterministic. For the layer splits of the best single-shape plans (the
first `splits` distinct ones), a GPU type's own split where it holds a pipeline on none of them
(`own_splits`) and one of the best plans' pipelines re-split with one stage on an idle GPU kind
(`mixed_kind_splits`) it
1. collects pipeline *types*: a microbatch size and one (slot, TP) per stage, from the bottleneck
   sweep and DP run on the whole pool, on each GPU type alone and (three types or more) without each
   (types on slow or small GPUs exist even where the fastest would take every GPU), at the best sizes;
2. chooses how many pipelines of each type to run, jointly: for every combination of up to
   `max_groups` types (of the `types_kept` best by samples per second per GPU) and counts that fit
   the pool together, the iteration time of the combination when the global batch is shared so
   every pipeline finishes together, T = (B + sum_t x_t a_t r_t) / sum_t x_t r_t with
   r_t = b_t / c_t samples per second of a type-t pipeline (microbatch b_t, cycle c_t, fill a_t:
   the simulator's 1F1B pipeline time a_t + c_t m for m microbatches), the network and gradient
   rings left to the verification;
3. materialises the best combinations: each type's pipelines placed on what the earlier ones left,
   the global batch split exactly (microbatch counts per pipeline, each type its own size).
A stage then holds replicas of as many shapes (GPU type, TP, zone) as types were chosen: the
paper splits D over every GPU type in a stage. `max_groups=2` is the two-shape space of mixed.py,
searched jointly instead of on the leftovers of one plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import combinations

from sailor_core.domain import ParallelPlan, PipelineBatch
from sailor_core.planner.costs import Costs
from sailor_core.planner.estimate import linear_time
from sailor_core.planner.placement import place, place_in_turn, stages_of
from sailor_core.planner.request import Constraints, Objective
from sailor_core.planner.search import Search
from sailor_core.planner.shapes import Bounds, partitions, rebalanced, stage_table
from sailor_core.planner.slots import Slot
from sailor_core.planner.space import Candidate, Problem, Sketch


@dataclass(frozen=True)
class PipeType:
    """One kind of pipeline: its sketch (dp is ignored), GPUs per slot, fill a and cycle c (seconds)."""

    sketch: Sketch
    use: tuple[int, ...]
    fill_s: float
    cycle_s: float

    @property
    def samples_per_s(self) -> float:
        return self.sketch.mbs / self.cycle_s


def _types(search: Search, bounds: tuple[tuple[int, int], ...], mbs_values: Sequence[int], keep: int
           ) -> list[PipeType]:
    pb = search.problem
    out: dict[tuple[int, tuple[tuple[int, int], ...]], PipeType] = {}
    # The whole pool; each GPU type alone (what a slow or small GPU can run, which the whole pool's best
    # hide); each left out (the best of the others: a middle GPU paired with a slow one). By type, not
    # by slot: a type's slots in other regions run the same pipelines.
    by_type = [{s.index for s in pb.slots if s.gpu_type == g} for g in dict.fromkeys(s.gpu_type for s in pb.slots)]
    pools = [pb.slots] + ([_only(pb.slots, ix) for ix in by_type] if len(by_type) > 1 else []) + (
        [_only(pb.slots, {s.index for s in pb.slots} - ix) for ix in by_type] if len(by_type) > 2 else [])
    for mbs in mbs_values:
        for slots in pools:
            sub = Search(replace(pb, slots=slots, mbs_values=(mbs,), keep=keep, constraints=Constraints(),
                                 objective=Objective.MAX_THROUGHPUT), search.costs, shared=search)
            for cand in sub.run_split(mbs, bounds):
                sk = cand.sketch
                key = (sk.mbs, sk.kinds)
                if key in out:
                    continue
                fill, cycle = linear_time(sub.costs, sub.problem.slots, sk, cand.estimate.layouts)
                if cycle > 0 and math.isfinite(cycle):
                    out[key] = PipeType(sketch=replace(sk, dp=1, zone_rot=()), use=_use(pb, sk.kinds), fill_s=fill,
                                        cycle_s=cycle)
    # One stage moved to another GPU kind: types that mix kinds the sweeps' best never pair (a
    # middle GPU for the first stage of a pipeline whose other stages keep the fastest).
    for t in sorted(out.values(), key=lambda t: (-t.samples_per_s / sum(t.use), t.sketch))[:4]:
        for variant in _variants(search, t.sketch):
            key = (variant.sketch.mbs, variant.sketch.kinds)
            if key not in out:
                out[key] = variant
    ranked = sorted(out.values(), key=lambda t: (-t.samples_per_s / sum(t.use), t.sketch))
    # Diverse first: the best two of each set of slots a type uses, then the rest (TP and microbatch
    # variants of one GPU kind would otherwise fill every combination).
    seen: dict[tuple[int, ...], int] = {}
    rounds: list[list[PipeType]] = [[], [], []]
    for t in ranked:
        support = tuple(g for g, u in enumerate(t.use) if u)
        seen[support] = seen.get(support, 0) + 1
        rounds[min(seen[support], 3) - 1].append(t)
    return rounds[0] + rounds[1] + rounds[2]


def _only(slots: Sequence[Slot], keep: set[int]) -> tuple[Slot, ...]:
    """The slots with every one not in `keep` emptied (indices unchanged)."""
    return tuple(s if s.index in keep else replace(s, zones=tuple((z, 0) for z, _ in s.zones)) for s in slots)


def _variants(search: Search, sk: Sketch) -> list[PipeType]:
    pb = search.problem
    c = search.costs
    p = sk.num_stages
    out = []
    for s, (first, last) in enumerate(sk.bounds):
        for g, slot in enumerate(pb.slots):
            if g == sk.kinds[s][0] or not slot.capacity:
                continue
            for tp in pb.tp_values:
                if tp > slot.gpus_per_node or not c.profiled(slot.gpu_type, sk.mbs, tp):
                    continue
                if not c.fits(slot.gpu_type, tp, first, last, mbs=sk.mbs, in_flight=p - s, first_stage=s == 0,
                              last_stage=s == p - 1):
                    continue
                moved = _stage_moved(pb, sk.kinds, s, (g, tp))
                if moved is None:
                    continue
                kinds, use = moved
                v = replace(sk, kinds=kinds, dp=1)
                lay = place(pb.slots, v)
                if lay is None:
                    continue
                fill, cycle = linear_time(c, pb.slots, v, lay)
                if cycle > 0 and math.isfinite(cycle):
                    out.append(PipeType(sketch=v, use=use, fill_s=fill, cycle_s=cycle))
                break  # the smallest TP that fits
    return out


def _stage_moved(pb: Problem, kinds: tuple[tuple[int, int], ...], s: int, kind: tuple[int, int]
                 ) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]] | None:
    """(kinds, GPUs used per slot) of a pipeline with stage s on `kind` (slot, TP); None when one
    such pipeline needs more GPUs of a slot than the pool has."""
    moved = kinds[:s] + (kind,) + kinds[s + 1:]
    use = _use(pb, moved)
    if any(u > slot.capacity for u, slot in zip(use, pb.slots, strict=True)):
        return None
    return moved, use


def _use(pb: Problem, kinds: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """GPUs one pipeline of these kinds (slot, TP per stage) uses of each slot."""
    return tuple(sum(tp for si, tp in kinds if si == g) for g in range(len(pb.slots)))


def _balanced_time(gbs: int, types: Sequence[PipeType], counts: Sequence[int]) -> float:
    rate = sum(x * t.samples_per_s for t, x in zip(types, counts, strict=True))
    if rate <= 0:
        return math.inf
    return (gbs + sum(x * t.fill_s * t.samples_per_s for t, x in zip(types, counts, strict=True))) / rate


def _counts(types: Sequence[PipeType], caps: Sequence[int], max_gpus: int | None, gbs: int, steps: int = 8
            ) -> list[list[int]]:
    """Count vectors that fit together: the first type's count over its range (at most `steps`
    values), the others as many as then fit, in order; every type at least one pipeline."""
    def fit(left: list[int], t: PipeType, gpus_left: float) -> int:
        x = min((left[g] // u for g, u in enumerate(t.use) if u), default=0)
        return int(min(x, gpus_left // max(1, sum(t.use))))

    first = types[0]
    top = fit(list(caps), first, math.inf if max_gpus is None else max_gpus)
    values = sorted({max(1, round(top * (i + 1) / steps)) for i in range(steps)}) if top else []
    out = []
    for x0 in values:
        left = [c - x0 * u for c, u in zip(caps, first.use, strict=True)]
        gpus_left = math.inf if max_gpus is None else max_gpus - x0 * sum(first.use)
        xs = [x0]
        for t in types[1:]:
            x = fit(left, t, gpus_left)
            if x < 1:
                break
            xs.append(x)
            left = [c - x * u for c, u in zip(left, t.use, strict=True)]
            gpus_left -= x * sum(t.use)
        # every pipeline needs at least one microbatch of its size
        if len(xs) == len(types) and sum(x * t.sketch.mbs for t, x in zip(types, xs, strict=True)) <= gbs:
            out.append(xs)
    return out


def split_batch_by_finish(gbs: int, types: Sequence[PipeType], counts: Sequence[int]) -> list[list[int]] | None:
    """Microbatch counts per pipeline (per type) summing to exactly gbs samples, the latest finish
    as early as the integers allow: fill each pipeline up to a common finish time, then take back
    microbatches from the pipelines that finish last until the batch is exact (None if it cannot be)."""
    lo, hi = 0.0, max(t.fill_s + t.cycle_s * gbs for t in types)
    for _ in range(60):
        mid = (lo + hi) / 2
        got = sum(
            x * max(1, int((mid - t.fill_s) // t.cycle_s)) * t.sketch.mbs for t, x in zip(types, counts, strict=True)
        )
        if got >= gbs:
            hi = mid
        else:
            lo = mid
    m = [[max(1, int((hi - t.fill_s) // t.cycle_s))] * x for t, x in zip(types, counts, strict=True)]
    total = sum(sum(ms) * t.sketch.mbs for t, ms in zip(types, m, strict=True))

    def pick(latest: bool, room: int) -> tuple[int, int] | None:
        """The pipeline to take from (latest finish, keeps >= 1) or give to (earliest finish after), size <= room."""
        best: tuple[float, int, int] | None = None
        for i, (t, ms) in enumerate(zip(types, m, strict=True)):
            if t.sketch.mbs > room:
                continue
            for j, k in enumerate(ms):
                if latest and k > 1:
                    key = -(t.fill_s + t.cycle_s * k)
                elif not latest:
                    key = t.fill_s + t.cycle_s * (k + 1)
                else:
                    continue
                if best is None or key < best[0]:
                    best = (key, i, j)
        return None if best is None else (best[1], best[2])

    for _ in range(4 * (sum(counts) + gbs)):
        if total == gbs:
            return m
        if total > gbs:
            # take back from the pipeline that finishes last; if no size fits the excess, overshoot
            # into a deficit that smaller microbatches then fill
            at = pick(True, total - gbs) or pick(True, gbs)
            if at is None:
                return None
            m[at[0]][at[1]] -= 1
            total -= types[at[0]].sketch.mbs
        else:
            at = pick(False, gbs - total)
            if at is None:
                return None
            m[at[0]][at[1]] += 1
            total += types[at[0]].sketch.mbs
    return m if total == gbs else None


def group_plans(search: Search, top: Sequence[Candidate], *, model: str, global_batch_size: int, precision: str,
                schedule: str, max_groups: int = 4, own_microbatch: bool = True, types_kept: int = 8,
                per_base: int = 4, splits: int = 3) -> list[ParallelPlan]:
    pb = search.problem
    caps = [s.capacity for s in pb.slots]
    out: list[ParallelPlan] = []
    taken: list[tuple[Bounds, int]] = []  # the layer splits of the best plans, `splits` of them
    for cand in top:
        if len(taken) == splits:
            break
        if all(b != cand.sketch.bounds for b, _ in taken):
            taken.append((cand.sketch.bounds, cand.sketch.mbs))
    extra = own_splits(search, [b for b, _ in taken])
    extra += mixed_kind_splits(search, top, [b for b, _ in taken + extra], bases=splits)
    # Pipeline types at every profiled size: a size none of the best single-kind plans runs may still give
    # the type a group takes (a slow GPU's small microbatches beside a fast one's: brute force's 3-type worlds).
    for bounds, mbs in taken + extra:
        mbs_values = pb.mbs_values if own_microbatch else (mbs,)
        types = _types(search, bounds, mbs_values, keep=2)[:types_kept]
        scored: list[tuple[float, tuple[int, ...], list[int]]] = []
        for k in range(2, max_groups + 1):
            for combo in combinations(range(len(types)), k):
                chosen = [types[i] for i in combo]
                for counts in _counts(chosen, caps, pb.max_gpus, global_batch_size):
                    scored.append((_balanced_time(global_batch_size, chosen, counts), combo, counts))
        scored.sort(key=lambda s: (s[0], s[1], s[2]))
        for _, combo, counts in scored[:per_base]:
            pl = _materialize([types[i] for i in combo], counts, pb, model=model,
                              global_batch_size=global_batch_size, precision=precision, schedule=schedule)
            if pl is not None:
                out.append(pl)
    return out


def own_splits(search: Search, taken: Sequence[Bounds]) -> list[tuple[Bounds, int]]:
    """(split, microbatch size) for each GPU slot that fits a whole pipeline of its own on none of the
    `taken` splits (memory: the best plans' splits give its stages too many layers): the split with the
    fewest stages (within the request's stage range) on which it does, the one whose slowest stage is
    fastest per sample among the search's splits of that stage count (`partitions`), at the microbatch
    size that gives it. Pipeline types of that GPU, and of others beside it, exist only on such a split."""
    pb, costs = search.problem, search.costs
    out: list[tuple[Bounds, int]] = []
    for slot in pb.slots:
        alone = replace(pb, slots=(slot,))
        if not slot.capacity or any(stage_table(alone, costs, m, b) is not None for b in taken for m in pb.mbs_values):
            continue
        for p in range(max(1, pb.min_stages), min(pb.max_stages, pb.num_layers) + 1):  # the request's stage range
            best: tuple[float, Bounds, int] | None = None
            for mbs in pb.mbs_values:
                for bounds, _even in partitions(alone, costs, p, mbs):
                    table = stage_table(alone, costs, mbs, bounds)
                    if table is None:
                        continue
                    slowest = max(min(t for _, t in stage[0]) for stage in table) / mbs
                    if best is None or (slowest, bounds, mbs) < best:
                        best = (slowest, bounds, mbs)
            if best is not None:
                if all(best[1] != b for b in taken) and all(best[1] != b for b, _ in out):
                    out.append((best[1], best[2]))
                break
    return out


def mixed_kind_splits(search: Search, top: Sequence[Candidate], taken: Sequence[Bounds], *, bases: int,
                      limit: int = 1) -> list[tuple[Bounds, int]]:
    """(split, microbatch size) for pipelines whose stages run on different GPU kinds: the pipelines of
    the best plans (`top`, the first `bases` distinct ones), each with one stage moved to a GPU kind
    the best plan leaves idle (its smallest TP that gives a split), the layers re-split for the kinds
    it then has (`shapes.rebalanced`: the least bottleneck stage time within each GPU's memory); the
    `limit` of them not in `taken` whose pipeline is fastest per sample.

    A weaker GPU after a faster one wants another split than the best plans' (the fast stage keeps most
    layers, the weak one what it holds and keeps pace with): a plan pairing every fast GPU with an idle
    weak one exists only on it, and the single-shape search ranks it low (few of its pairs fit the pool)."""
    pb, costs = search.problem, search.costs
    if not top:
        return []
    idle = [s.capacity for s in pb.slots]  # what the best plan leaves: the GPUs such a pipeline would add
    for si, tp in top[0].sketch.kinds:
        idle[si] -= tp * top[0].sketch.dp
    pipelines: list[Sketch] = []
    for cand in top:
        if len(pipelines) == bases:
            break
        if all((b.bounds, b.kinds) != (cand.sketch.bounds, cand.sketch.kinds) for b in pipelines):
            pipelines.append(cand.sketch)
    split_found: dict[tuple[tuple[int, int], ...], bool] = {sk.kinds: True for sk in pipelines}
    scored: list[tuple[float, Bounds, int]] = []
    for sk in pipelines:
        p = sk.num_stages
        for s in range(p):
            for g, slot in enumerate(pb.slots):
                if g == sk.kinds[s][0] or idle[g] <= 0:
                    continue
                for tp in pb.tp_values:
                    if tp > min(slot.gpus_per_node, idle[g]):
                        continue
                    moved = _stage_moved(pb, sk.kinds, s, (g, tp))
                    if moved is None:
                        break  # a larger TP needs more GPUs still
                    kinds = moved[0]
                    if kinds not in split_found:
                        best = _best_split(pb, costs, replace(sk, kinds=kinds, dp=1))
                        split_found[kinds] = best is not None
                        if best is not None:
                            scored.append(best)
                    if split_found[kinds]:
                        break  # a larger TP only where this one holds no split
    out: list[tuple[Bounds, int]] = []
    for _, bounds, mbs in sorted(scored):
        if len(out) == limit:
            break
        if bounds not in taken and all(bounds != b for b, _ in out):
            out.append((bounds, mbs))
    return out


def _best_split(pb: Problem, costs: Costs, sk: Sketch) -> tuple[float, Bounds, int] | None:
    """(seconds per sample of the slowest stage, split, microbatch size) of the sketch's kinds re-split
    (`rebalanced`) at the microbatch size where that is least; None where no size gives a split."""
    best: tuple[float, Bounds, int] | None = None
    for mbs in pb.mbs_values:
        if not all(costs.profiled(pb.slots[si].gpu_type, mbs, tp) for si, tp in sk.kinds):
            continue
        bounds = rebalanced(pb, costs, replace(sk, mbs=mbs))
        if bounds is None:
            continue
        slowest = _slowest_stage_s(pb, costs, sk.kinds, bounds, mbs)
        if best is None or (slowest / mbs, bounds, mbs) < best:
            best = (slowest / mbs, bounds, mbs)
    return best


def _slowest_stage_s(pb: Problem, costs: Costs, kinds: Sequence[tuple[int, int]], bounds: Bounds, mbs: int
                     ) -> float:
    """Seconds per microbatch of the pipeline's slowest stage (compute, with recomputation where it must)."""
    p = len(bounds)
    return max(costs.stage_compute(pb.slots[si].gpu_type, mbs, tp, a, z, in_flight=p - i, first_stage=i == 0,
                                   last_stage=i == p - 1).total_s
               for i, ((a, z), (si, tp)) in enumerate(zip(bounds, kinds, strict=True)))


def _materialize(types: Sequence[PipeType], counts: Sequence[int], pb: Problem, *, model: str,
                 global_batch_size: int, precision: str, schedule: str) -> ParallelPlan | None:
    micro = split_batch_by_finish(global_batch_size, types, counts)
    if micro is None:
        return None
    placed = place_in_turn(pb.slots, [replace(t.sketch, dp=x) for t, x in zip(types, counts, strict=True)])
    if placed is None:
        return None
    stages = stages_of(pb.slots, types[0].sketch.bounds, placed)
    pipes = [PipelineBatch(microbatch_size=t.sketch.mbs, num_microbatches=m)
             for t, ms in zip(types, micro, strict=True) for m in ms]
    return ParallelPlan(model=model, global_batch_size=global_batch_size, stages=stages, pipelines=tuple(pipes),
                        schedule=schedule, precision=precision)
