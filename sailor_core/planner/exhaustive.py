"""Brute force over the planner's plan space, scored with the full simulator: the optimality yardstick.

Contract: `exhaustive_best(request, book, max_stages)` enumerates every sketch the planner's space
holds for small pools (every microbatch size, stage count up to `max_stages`, every contiguous
partition, every (slot, TP) per stage, every data-parallel degree that fits, every zone fill
start, stage-major or whole pipelines per zone first), materialises each, runs `simulate()` and
returns the best plan that fits in memory and meets the constraints, with its result and the
number of plans simulated. No pruning, no bounds:
slow by design, for tests and benchmarks on pools of a few GPUs.
"""

from __future__ import annotations

from itertools import combinations, product

from sailor_core.domain import ParallelPlan
from sailor_core.planner.core import build_slots, materialize, objective_value, sim_options
from sailor_core.planner.request import PlanRequest
from sailor_core.planner.search import PIPELINE_MAJOR, STAGE_MAJOR, Problem, Search, Sketch, _bounds_from_cuts
from sailor_core.profiles import ProfileBook
from sailor_core.simulator import SimulationResult, simulate


def exhaustive_best(
    request: PlanRequest, book: ProfileBook, *, max_stages: int
) -> tuple[ParallelPlan | None, SimulationResult | None, int]:
    pool = request.restrictions.apply(request.pool)
    slots = build_slots(pool)
    L = book.model.num_layers
    gbs = request.global_batch_size
    so = sim_options(pool, request.options.precision, request.options.schedule)
    # A Search object only for its zone filling (the same placement rule the planner uses).
    placer = Search(Problem(num_layers=L, global_batch_size=gbs, tokens_per_sample=book.model.sequence_length,
                            slots=slots, mbs_values=(), tp_values=()), costs=None)  # type: ignore[arg-type]
    best: tuple[float, ParallelPlan, SimulationResult] | None = None
    simulated = 0
    caps = [s.capacity for s in slots]
    rotations = list(product(*[range(len(s.zones)) for s in slots]))
    for mbs in sorted({m for s in slots for m, _ in book.profiled_points(s.gpu_type)}):
        if gbs % mbs:
            continue
        n = gbs // mbs
        kinds_all = [
            (s.index, tp) for s in slots for m, tp in book.profiled_points(s.gpu_type) if m == mbs and tp <= s.gpus_per_node
        ]
        for p in range(1, min(max_stages, L) + 1):
            for cuts in combinations(range(1, L), p - 1):
                bounds = _bounds_from_cuts(cuts, L)
                for kinds in product(kinds_all, repeat=p):
                    per_pipe = [0] * len(slots)
                    for si, tp in kinds:
                        per_pipe[si] += tp
                    d_max = min((caps[i] // u for i, u in enumerate(per_pipe) if u), default=0)
                    if request.restrictions.max_gpus is not None:
                        d_max = min(d_max, request.restrictions.max_gpus // sum(per_pipe))
                    for d in range(1, min(d_max, n) + 1):
                        placed: set[object] = set()
                        for rot, placement in product(rotations, (STAGE_MAJOR, PIPELINE_MAJOR)):
                            sk = Sketch(mbs=mbs, bounds=bounds, kinds=tuple(kinds), dp=d, zone_rot=tuple(rot),
                                        placement=placement)
                            lay = placer.layouts(sk)
                            if lay is None or lay in placed:
                                continue
                            placed.add(lay)
                            plan = materialize(sk, lay, slots, model=request.model, global_batch_size=gbs,
                                               precision=request.options.precision, schedule=request.options.schedule)
                            r = simulate(plan, book, options=so)
                            simulated += 1
                            if not r.fits_memory:
                                continue
                            if request.constraints.violations(
                                usd_per_iteration=r.usd_per_iteration, usd_per_hour=r.usd_per_hour,
                                iterations_per_s=r.throughput_iterations_per_s,
                            ):
                                continue
                            v = objective_value(request.objective, r)
                            if best is None or v < best[0]:
                                best = (v, plan, r)
    if best is None:
        return None, None, simulated
    return best[1], best[2], simulated
