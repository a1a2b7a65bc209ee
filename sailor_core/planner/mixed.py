"""Mixed pipelines: a second group of pipelines on the GPUs the best plans leave idle.

Contract: `mixed_plans(search, top, ...)` takes the search's best single-shape plans and, for each,
plans a second group of data-parallel pipelines with the same layer split, and each microbatch
size in turn, on the capacity the first group leaves unused (the same stage table, bottleneck
sweep and DP, run on the leftover pool). The two groups form one plan whose stages hold replicas
of two GPU kinds (per-replica GPU type, TP and zone), each group with its own microbatch size;
the global batch is shared exactly so that both groups finish together: each pipeline of a group
runs about the same number of microbatches, the faster group more.
Returns `ParallelPlan`s for the caller to verify with the full simulator. Pure and deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from sailor_core.domain import ParallelPlan, PipelineBatch
from sailor_core.planner.costs import Costs
from sailor_core.planner.estimate import linear_time
from sailor_core.planner.placement import leftover, stages_of
from sailor_core.planner.search import Search
from sailor_core.planner.slots import Layout, Slot
from sailor_core.planner.space import Candidate, Problem, Sketch

# Of the leftover's best second groups, how many more than `per_base` are kept for those that cannot ring
# with the first group to make way for (algorithmic choice).
KEPT = 3


def _split(gbs: int, mbs_a: int, d_a: int, mbs_b: int, d_b: int, ta: tuple[float, float], tb: tuple[float, float]
           ) -> tuple[list[int], int] | None:
    """Microbatch counts that share the global batch exactly: group A's d_a pipelines take
    microbatches of mbs_a round-robin, each of group B's d_b pipelines m_b microbatches of mbs_b;
    m_b minimises the slower group's time (b_a sum m_a + b_b d_b m_b = gbs)."""
    best: tuple[float, int] | None = None
    for m_b in range(1, gbs // (d_b * mbs_b) + 1):
        rest = gbs - d_b * m_b * mbs_b
        if rest < d_a * mbs_a:
            break
        if rest % mbs_a:
            continue
        m_a = -(-(rest // mbs_a) // d_a)
        t = max(ta[0] + ta[1] * m_a, tb[0] + tb[1] * m_b)
        if best is None or t < best[0] - 1e-12:
            best = (t, m_b)
    if best is None:
        return None
    m_b = best[1]
    base, extra = divmod((gbs - d_b * m_b * mbs_b) // mbs_a, d_a)
    return [base + (1 if j < extra else 0) for j in range(d_a)], m_b


def _rings_linked(costs: Costs, slots: Sequence[Slot], a: Sketch, lay_a: Sequence[Layout], b: Sketch,
                  lay_b: Sequence[Layout]) -> bool:
    """Whether each stage's replicas of both groups have a network profile between every two of their zones
    (the stage's gradient ring runs over both)."""
    return all(costs.linked(slots[ka[0]], za, slots[kb[0]], zb)
               for ka, kb, la, lb in zip(a.kinds, b.kinds, lay_a, lay_b, strict=True)
               for za, na in la if na for zb, nb in lb if nb)


def _ringable(costs: Costs, slots: Sequence[Slot], a: Sketch, lay_a: Sequence[Layout], left: Sequence[Slot]
              ) -> tuple[Slot, ...]:
    """The leftover with the slots that could ring with no stage of the first group emptied: a second group
    on them would need a link without a network profile (missing links rule out only what needs them)."""
    def fits(s: Slot) -> bool:
        return any(all(costs.linked(slots[k[0]], za, s, zb) for za, na in la if na for zb, nb in s.zones if nb)
                   for k, la in zip(a.kinds, lay_a, strict=True))
    return tuple(s if not s.capacity or fits(s) else replace(s, zones=tuple((z, 0) for z, _ in s.zones))
                 for s in left)


def mixed_plans(search: Search, top: Sequence[Candidate], *, model: str, global_batch_size: int, precision: str,
                schedule: str, per_base: int = 3, own_microbatch: bool = True) -> list[ParallelPlan]:
    out: list[ParallelPlan] = []
    pb = search.problem
    seen: set[tuple[Sketch, Sketch]] = set()
    for cand in top:
        a = cand.sketch
        lay_a = cand.estimate.layouts
        left = _ringable(search.costs, pb.slots, a, lay_a, leftover(pb.slots, a, lay_a))
        if sum(s.capacity for s in left) == 0:
            continue
        max_gpus = None if pb.max_gpus is None else pb.max_gpus - cand.estimate.num_gpus
        if max_gpus is not None and max_gpus <= 0:
            continue
        ta = linear_time(search.costs, pb.slots, a, lay_a)
        # The second group has its own microbatch size: slower or smaller GPUs may run (or only fit)
        # a smaller one, and the counts then balance the two groups' finish times.
        for mbs_b in pb.mbs_values if own_microbatch else (a.mbs,):
            sub = Search(
                Problem(num_layers=pb.num_layers, global_batch_size=pb.global_batch_size,
                        tokens_per_sample=pb.tokens_per_sample, slots=left, mbs_values=(mbs_b,),
                        tp_values=pb.tp_values, objective=pb.objective, max_gpus=max_gpus, keep=KEPT * per_base),
                search.costs, shared=search,
            )
            # A group that cannot ring with the first one's replicas of its stages (no network profile between
            # them) is no option: the next best of the leftover takes its place.
            ringing = [c for c in sub.run_split(mbs_b, a.bounds)
                       if _rings_linked(search.costs, pb.slots, a, lay_a, c.sketch, c.estimate.layouts)]
            for b_cand in ringing[:per_base]:
                b = b_cand.sketch
                if (a, b) in seen:
                    continue
                seen.add((a, b))
                lay_b = b_cand.estimate.layouts
                tb = linear_time(sub.costs, sub.problem.slots, b, lay_b)
                split = _split(global_batch_size, a.mbs, a.dp, b.mbs, b.dp, ta, tb)
                if split is None:
                    continue
                counts_a, m_b = split
                stages = stages_of(pb.slots, a.bounds, ((a, lay_a), (b, lay_b)))
                pipes = [PipelineBatch(microbatch_size=a.mbs, num_microbatches=m) for m in counts_a]
                pipes += [PipelineBatch(microbatch_size=b.mbs, num_microbatches=m_b)] * b.dp
                out.append(ParallelPlan(model=model, global_batch_size=global_batch_size, stages=stages,
                                        pipelines=tuple(pipes), schedule=schedule, precision=precision))
    return out
