"""The planner's answer in words: one-line plan summaries, why this plan, and why no plan.

Contract: pure functions of a request, plans and their simulated results; no search. `summarize` is
the one-line form every report uses; `explain` gives the few sentences of `PlanResult.explanation`
(the goal met, the GPUs used, the split, the iteration's parts, spot risk, the limits, the frontier,
how complete the search was, and a cheaper plan within the tolerance when there is one);
`memory_miss`, `constraint_hint` and `profile_command` word the no-plan answer's parts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from sailor_core.catalog import is_cpu_type
from sailor_core.domain import ParallelPlan
from sailor_core.planner.costs import SimCosts
from sailor_core.planner.request import FrontierPoint, Objective, PlanRequest
from sailor_core.planner.risk import Goodput
from sailor_core.planner.shapes import packed_partition, uniform_partition
from sailor_core.planner.slots import Offer, Slot
from sailor_core.profiles import ProfileBook
from sailor_core.simulator import SimulationResult
from sailor_core.units import sig
from sailor_core.units import usd as usd_text


def summarize(plan: ParallelPlan) -> str:
    """One line: stages, layers, replicas per stage by GPU type/TP/zone, microbatches."""
    parts = []
    for st in plan.stages:
        groups: dict[tuple[str, int, str, str], int] = {}
        for r in st.replicas:
            k = (r.gpu_type, r.tp, r.zone, r.market.value)
            groups[k] = groups.get(k, 0) + 1
        reps = " + ".join(
            f"{n}x{g}(tp{tp}{', spot' if mk == 'spot' else ''})@{z}" for (g, tp, z, mk), n in groups.items()
        )
        parts.append(f"layers {st.first_layer}-{st.last_layer}: {reps}")
    by_size: dict[int, list[int]] = {}
    for p in plan.pipelines:
        by_size.setdefault(p.microbatch_size, []).append(p.num_microbatches)
    if len(by_size) == 1:
        (size, counts), = by_size.items()
        batches = f"microbatch {size} x {max(counts)}"
    else:  # per-pipeline microbatch sizes: one group per size
        batches = "microbatches " + " + ".join(f"{size} x {max(c)} ({len(c)} pipelines)" for size, c in by_size.items())
    return (
        f"{plan.num_stages} stage(s) x {plan.data_parallel} pipeline(s), {plan.num_gpus} GPUs, {batches} | "
        + " | ".join(parts)
    )


def explain(request: PlanRequest, pl: ParallelPlan, r: SimulationResult, slots: Sequence[Slot],
            frontier: Sequence[FrontierPoint], gp: Goodput | None = None, *, completeness: str = "",
            alternative: tuple[ParallelPlan, SimulationResult] | None = None) -> str:
    """Why these GPUs, why this split: a few plain sentences. `completeness`: how much of the plan space
    the search covered (`core`); `alternative`: a plan within the tolerance on the objective that is
    better on the other goal (`verify.near_alternative`)."""
    goal = {
        Objective.MAX_THROUGHPUT: "the highest throughput",
        Objective.MIN_COST: "the lowest cost per iteration",
        Objective.MIN_COST_PER_TOKEN: "the lowest cost per million tokens",
        Objective.MAX_GOODPUT: "the most useful iterations per dollar with spot preemptions expected",
    }[request.objective]
    lines = [
        f"Chosen for {goal}: {sig(r.throughput_iterations_per_s)} it/s, {usd_text(r.usd_per_iteration)} USD/iteration, "
        f"{usd_text(r.usd_per_hour)} USD/hour on {pl.num_gpus} GPUs.",
        _explain_gpus(pl, slots),
        *_explain_shape(pl),
    ]
    b = r.breakdown
    lines.append(
        f"Iteration {r.iteration_time_s:.3f} s: pipeline compute {b.pipeline_compute_s:.3f} s, "
        f"p2p {b.pipeline_p2p_s:.3f} s, "
        f"exposed gradient sync {b.dp_sync_exposed_s:.3f} s, optimizer {b.optimizer_s:.3f} s."
    )
    if gp is not None and gp.preemptions_per_hour > 0:
        lines.append(_explain_risk(request, gp))
    binding = _explain_constraints(request, r)
    if binding:
        lines.append("Constraints: " + "; ".join(binding) + ".")
    if frontier:
        fastest = frontier[0]
        cheapest = frontier[-1]
        lines.append(
            f"Frontier: {len(frontier)} plans from {sig(fastest.iterations_per_s)} it/s "
            f"at {usd_text(fastest.usd_per_iteration)} USD/iteration "
            f"to {sig(cheapest.iterations_per_s)} it/s at {usd_text(cheapest.usd_per_iteration)} USD/iteration."
        )
    if alternative is not None:
        lines.append(_explain_alternative(request, r, *alternative))
    if completeness:
        lines.append(completeness)
    return "\n".join(lines)


def _explain_alternative(request: PlanRequest, r: SimulationResult, alt: ParallelPlan, ar: SimulationResult) -> str:
    """One sentence on a plan nearly as good on the objective and better on the other goal."""
    tol = request.options.tolerance
    if request.objective is Objective.MAX_THROUGHPUT:
        saved = 1 - ar.usd_per_iteration / r.usd_per_iteration
        return (f"Within {tol:.1%} of this throughput, {summarize(alt)} runs {sig(ar.throughput_iterations_per_s)} "
                f"it/s for {usd_text(ar.usd_per_iteration)} USD/iteration ({saved:.0%} less); to take it: "
                f"--objective min-cost --min-iterations-per-s {sig(ar.throughput_iterations_per_s * 0.999)}.")
    return (f"Within {tol:.1%} of this cost, {summarize(alt)} runs {sig(ar.throughput_iterations_per_s)} it/s "
            f"({ar.throughput_iterations_per_s / r.throughput_iterations_per_s - 1:.0%} faster) for "
            f"{usd_text(ar.usd_per_iteration)} USD/iteration; to take it: --objective max-throughput "
            f"--max-usd-per-iteration {sig(ar.usd_per_iteration * 1.001)}.")


def _explain_gpus(pl: ParallelPlan, slots: Sequence[Slot]) -> str:
    """One sentence: how many of the pool's GPUs of each type and market the plan uses."""
    used = pl.gpus_by_place()
    have: dict[tuple[str, str], int] = defaultdict(int)
    for s in slots:
        for _z, mk, n, _usd in s.offers or tuple(Offer(z, s.market, n, 0.0) for z, n in s.zones):
            have[(s.gpu_type, mk.value)] += n
    per_type: dict[tuple[str, str], int] = defaultdict(int)
    for (_, g, mk), n in used.items():
        per_type[(g, mk.value)] += n
    parts = [f"{per_type.get(k, 0)} of {n} {k[0]} ({k[1]})" for k, n in sorted(have.items())]
    return "GPUs used: " + ", ".join(parts) + "."


def _explain_shape(pl: ParallelPlan) -> list[str]:
    """Sentences on the split: one stage or how the layers were cut, and why GPU kinds share a stage."""
    lines = []
    kinds_per_stage = [{(x.gpu_type, x.tp) for x in st.replicas} for st in pl.stages]
    mixed = any(len(k) > 1 for k in kinds_per_stage)
    counts = sorted({p.num_microbatches for p in pl.pipelines})
    if pl.num_stages == 1 and not mixed:
        gpu, tp = next(iter(kinds_per_stage[0]))
        lines.append(
            f"One stage: the whole model fits on one {'GPU' if tp == 1 else f'{tp}-GPU TP group'} of {gpu}, "
            f"so every GPU runs data parallel ({pl.data_parallel} replicas) with no pipeline bubble."
        )
    else:
        sizes = [st.last_layer - st.first_layer + 1 for st in pl.stages]
        uniform = max(sizes) - min(sizes) <= 1
        lines.append(
            f"{pl.num_stages} pipeline stage(s) with {sizes} layers "
            f"({'an even split' if uniform else 'split to balance stage times on the chosen GPUs'}), "
            f"{pl.data_parallel} data-parallel pipelines."
        )
    if mixed:
        n_kinds = max(len(k) for k in kinds_per_stage)
        sizes_used = sorted({p.microbatch_size for p in pl.pipelines})
        words = {2: "two", 3: "three", 4: "four"}
        lines.append(
            f"Pipelines of {words.get(n_kinds, str(n_kinds))} GPU kinds share a stage (per-replica GPU type) to use "
            f"GPUs a single shape leaves idle; faster pipelines run more microbatches ({counts[0]} to {counts[-1]} "
            "each) so all finish together"
            + (f", each kind with its own microbatch size ({', '.join(map(str, sizes_used))})."
               if len(sizes_used) > 1 else ".")
        )
    return lines


def _explain_risk(request: PlanRequest, gp: Goodput) -> str:
    """One sentence: the expected preemptions and the share of time that trains."""
    risk = request.spot_risk
    return (
        f"Spot risk: {gp.preemptions_per_hour:.3g} preemptions/hour expected on its spot VMs; with checkpoints "
        f"every {risk.checkpoint_interval_steps} steps and {risk.reconfiguration_s:.0f} s to reconfigure, "
        f"{gp.useful_fraction:.1%} of the time trains: {gp.expected_iterations_per_s:.4f} useful it/s "
        f"(nominal {gp.nominal_iterations_per_s:.4f}), {usd_text(gp.expected_usd_per_useful_iteration)} USD per useful "
        f"iteration."
    )


def _explain_constraints(request: PlanRequest, r: SimulationResult) -> list[str]:
    """Each limit of the request beside what the plan uses of it."""
    c = request.constraints
    binding = []
    if c.max_usd_per_iteration is not None:
        binding.append(f"budget {c.max_usd_per_iteration:g} USD/iteration (uses {usd_text(r.usd_per_iteration)})")
    if c.max_usd_per_hour is not None:
        binding.append(f"budget {c.max_usd_per_hour:g} USD/hour (uses {r.usd_per_hour:.2f})")
    if c.min_iterations_per_s is not None:
        binding.append(f"minimum {c.min_iterations_per_s:g} it/s (runs {r.throughput_iterations_per_s:.4f})")
    return binding


def recompute_note(pl: ParallelPlan, mode: str) -> str:
    """The explanation's line on activation recomputation, when the plan recomputes."""
    stages = [s for s, st in enumerate(pl.stages) if st.recompute]
    if not stages:
        return ""
    if mode == "always":
        return "\nActivation recomputation on every stage (--recompute always)."
    return (f"\nActivation recomputation on stage(s) {', '.join(map(str, stages))} of {pl.num_stages}: no plan fits "
            f"in memory without it, and these stages fit only with it (--recompute never forbids it).")


def constraint_hint(request: PlanRequest) -> str:
    """What to change when a limit is what no plan meets."""
    c = request.constraints
    hints = []
    if c.min_iterations_per_s is not None:
        hints.append("lower --min-iterations-per-s or add faster GPUs")
    if c.max_usd_per_iteration is not None or c.max_usd_per_hour is not None:
        hints.append("raise the budget or add cheaper (spot) GPUs")
    return "; ".join(hints)


def memory_miss(book: ProfileBook, slots: Sequence[Slot], request: PlanRequest) -> str:
    """No split fits: the smallest pipeline that would fit in memory if the pool had the GPUs, or else
    the GPU, TP, microbatch and stage count within the pool that come closest, and why."""
    judges = {rc: SimCosts(book, precision=request.options.precision, recompute="always" if rc else "never")
              for rc in (False, True)}
    L = book.model.num_layers
    gpus = sum(s.capacity for s in slots)
    gpus = min(gpus, request.restrictions.max_gpus or gpus)
    modes = (False,) if request.options.recompute == "never" else (False, True)
    best: tuple[float, str] | None = None  # closest within the pool's GPUs
    fewest: tuple[int, str] | None = None  # the fewest GPUs of a pipeline that fits, beyond the pool's
    for s in slots:
        cap = book.gpu(s.gpu_type).memory_bytes
        for mbs, tp in book.profiled_points(s.gpu_type):
            if tp > s.gpus_per_node or tp not in book.model.tp_degrees:
                continue
            for p, rc in ((p, rc) for p in range(1, L + 1) for rc in modes):
                shape = f"{s.gpu_type} tp={tp} mbs={mbs} in {p} stage(s){' recomputing activations' if rc else ''}"
                if p * tp > gpus:
                    if (fewest is None or p * tp < fewest[0]) and packed_partition(judges[rc], s.gpu_type, tp, mbs,
                                                                                      p, L) is not None:
                        fewest = (p * tp, shape)
                    continue
                # 1F1B: stage i keeps p - i microbatches in flight; the worst stage sets the peak.
                worst = max(
                    (judges[rc].stage_memory(s.gpu_type, tp, a, b, mbs=mbs, in_flight=p - i, first_stage=i == 0,
                                             last_stage=i == p - 1)
                     for i, (a, b) in enumerate(uniform_partition(L, p))),
                    key=lambda m: m.total_bytes,
                )
                ratio = worst.total_bytes / cap
                if best is None or ratio < best[0]:
                    act = worst.activations_bytes / worst.total_bytes
                    best = (ratio, f"{shape} still needs {worst.total_bytes / 2**30:.1f} GiB on its fullest GPU of "
                                   f"{cap / 2**30:.0f} GiB ({act:.0%} activations of the microbatches in flight)")
    if fewest is not None:
        return (f"nothing fits in memory on the pool's {gpus} GPUs; the smallest pipeline that fits is {fewest[1]} "
                f"({fewest[0]} GPUs); to fix: add GPUs (at least {fewest[0]}) or GPUs with more memory")
    allow = ", allow activation recomputation (--recompute auto)" if request.options.recompute == "never" else ""
    return (f"nothing fits in memory; closest: {best[1] if best else 'no profiled GPU'}; to fix: add GPUs with "
            f"more memory or larger TP groups (profile a larger --tp){allow}, or use a smaller model")


def profile_command(model: str, gpu_type: str) -> str:
    """The whole command that measures `model` on `gpu_type`, where that GPU is (its device and the name the
    results are stored under), e.g. `sailor profile model --model OPT-350 --gpu-type H100-80 --device cuda
    on a H100-80 machine`."""
    device = "cpu" if is_cpu_type(gpu_type) else "cuda"
    return f"sailor profile model --model {model} --gpu-type {gpu_type} --device {device} on a {gpu_type} machine"
