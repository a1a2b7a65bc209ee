"""simulate(plan, book): iteration time, memory and cost of a heterogeneous PP x DP x TP plan.

Contract: a pure function of (plan, ProfileBook, SimOptions). An invalid plan raises
`PlanInvalidError` listing every violation; a missing profile raises `MissingProfileError`
naming (model, GPU type, mbs, tp) and the command that creates it; a plan that does not fit in
memory is a valid result (`fits_memory` False, with stage, replica and bytes over).

Time model (docs/simulator.md has the derivations):
- pipeline j runs m_j microbatches of its own size through its replica of every stage. Under
  1F1B, T_j = sum_s (F_s + B_s) + 2 sum_b t_b + (m_j - 1) max_s c_s, where c_s = F_s + B_s plus the
  blocking sends and receives of stage s per microbatch (each boundary b costs t_b on both ends,
  once for the activation and once for its gradient). GPipe runs all forwards, then all backwards.
- stage s finishes its last backward at T_j - sum_{k<s} (B_k + t_k) (the last backward flows from
  the last stage to the first); its gradient ring starts when every pipeline's replica is done
  (stragglers gate the sync) and the iteration ends when every ring and the optimizer step are done.
"""

from __future__ import annotations

from collections.abc import Sequence

from sailor_core.domain import Market, ParallelPlan, Replica, SailorError
from sailor_core.profiles import ProfileBook
from sailor_core.simulator import constants as C
from sailor_core.simulator.model import SimModel, StageCompute, model_for
from sailor_core.simulator.result import Breakdown, ReplicaResult, SimOptions, SimulationResult


class PlanInvalidError(SailorError):
    """The plan breaks structural rules; the message lists every violation."""


def place_nodes(plan: ParallelPlan) -> list[list[int]]:
    """Node id of every (stage, replica), packing TP groups into nodes as a launcher ranks them.

    Ranks are laid out stage by stage, data-parallel replicas of a stage next to each other
    (DeepSpeed's pipe x data topology), and consecutive ranks of one (zone, GPU type, market) fill
    a node of gpus_per_node GPUs before the next node is opened.
    """
    nodes: list[list[int]] = []
    open_node: dict[tuple[str, str, Market], tuple[int, int]] = {}  # key -> (node id, free GPUs)
    next_id = 0
    for st in plan.stages:
        row = []
        for r in st.replicas:
            key = (r.zone, r.gpu_type, r.market)
            cur = open_node.get(key)
            if cur is None or cur[1] < r.tp:
                cur = (next_id, r.gpus_per_node)
                next_id += 1
            row.append(cur[0])
            open_node[key] = (cur[0], cur[1] - r.tp)
        nodes.append(row)
    return nodes


def pipeline_time_s(
    compute: Sequence[StageCompute], p2p_s: Sequence[float], num_microbatches: int, schedule: str = "1f1b"
) -> tuple[float, float, list[float]]:
    """(pipeline seconds, its p2p part on the critical path, finish time of each stage's last backward).

    `compute[s]` is stage s's per-microbatch forward/backward, `p2p_s[b]` the one-way send time
    across boundary b (between stages b and b+1), len(p2p_s) == len(compute) - 1.
    """
    p = len(compute)
    m = num_microbatches
    t_in = [0.0] + list(p2p_s)
    t_out = list(p2p_s) + [0.0]
    fill_comm = 2.0 * sum(p2p_s)
    if schedule == "gpipe":
        fwd_cycle = [compute[s].forward_s + t_in[s] + t_out[s] for s in range(p)]
        bwd_cycle = [compute[s].backward_s + t_in[s] + t_out[s] for s in range(p)]
        fs, bs = max(range(p), key=lambda s: fwd_cycle[s]), max(range(p), key=lambda s: bwd_cycle[s])
        total = sum(c.total_s for c in compute) + fill_comm + (m - 1) * (fwd_cycle[fs] + bwd_cycle[bs])
        comm = fill_comm + (m - 1) * (t_in[fs] + t_out[fs] + t_in[bs] + t_out[bs])
    else:
        cycle = [compute[s].total_s + 2.0 * (t_in[s] + t_out[s]) for s in range(p)]
        bott = max(range(p), key=lambda s: cycle[s])
        total = sum(c.total_s for c in compute) + fill_comm + (m - 1) * cycle[bott]
        comm = fill_comm + (m - 1) * 2.0 * (t_in[bott] + t_out[bott])
    finish = []
    back = 0.0
    for s in range(p):
        finish.append(total - back)
        back += compute[s].backward_s + t_out[s]
    return total, comm, finish


def _resolve(plan: ParallelPlan, options: SimOptions | None) -> tuple[str, str, bool, SimOptions]:
    o = options or SimOptions()
    schedule = o.schedule or plan.schedule
    precision = o.precision or plan.precision
    zero1 = plan.zero1 if o.zero1 is None else o.zero1
    return schedule, precision, zero1, o


def simulate(plan: ParallelPlan, book: ProfileBook, *, options: SimOptions | None = None) -> SimulationResult:
    """Simulate one iteration of `plan` with the profiles, links and prices of `book`."""
    problems = plan.violations(book.model.num_layers)
    if plan.model != book.model.name:
        problems.append(f"plan is for model {plan.model} but the profiles are for {book.model.name}")
    schedule, precision, zero1, opts = _resolve(plan, options)
    if schedule not in ("1f1b", "gpipe"):
        problems.append(f"schedule must be '1f1b' or 'gpipe', got {schedule!r}")
    if precision not in ("fp32", "bf16"):
        problems.append(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    if problems:
        raise PlanInvalidError("invalid plan: " + "; ".join(problems))
    return simulate_valid(plan, model_for(book), schedule=schedule, precision=precision, zero1=zero1, options=opts)


def simulate_valid(
    plan: ParallelPlan,
    sm: SimModel,
    *,
    schedule: str,
    precision: str,
    zero1: bool,
    options: SimOptions,
) -> SimulationResult:
    """`simulate` without validation, for callers (the planner) whose plans are valid by construction."""
    book = sm.book
    stages = plan.stages
    p = len(stages)
    dp = len(plan.pipelines)
    nodes = place_nodes(plan)
    msg_bytes_per_elem = C.P2P_BYTES_PER_ELEMENT[precision]
    grad_bytes = C.FP32_GRAD_BYTES if precision == "fp32" else C.BF16_GRAD_BYTES

    # --- per pipeline: compute, p2p, pipeline time ---------------------------------------------
    computes: list[list[StageCompute]] = []
    pipe_times: list[float] = []
    pipe_comm: list[float] = []
    finishes: list[list[float]] = []
    egress_usd = 0.0
    for j, pb in enumerate(plan.pipelines):
        comp = [sm.stage_compute(st.replicas[j].gpu_type, pb.microbatch_size, st.replicas[j].tp, st.first_layer, st.last_layer) for st in stages]
        p2p = []
        for s in range(p - 1):
            a, b = stages[s].replicas[j], stages[s + 1].replicas[j]
            msg = sm.boundary_elems(a.tp, stages[s].last_layer) * pb.microbatch_size * msg_bytes_per_elem
            p2p.append(sm.p2p_time_s(a, b, msg, same_node=nodes[s][j] == nodes[s + 1][j]))
            if a.zone != b.zone:
                flows = max(1, min(a.tp, a.gpus_per_node, b.tp, b.gpus_per_node))
                gb = msg * flows * pb.num_microbatches / C.BYTES_PER_GB
                egress_usd += gb * (book.egress_usd_per_gb(a.zone, b.zone) + book.egress_usd_per_gb(b.zone, a.zone))
        total, comm, finish = pipeline_time_s(comp, p2p, pb.num_microbatches, schedule)
        computes.append(comp)
        pipe_times.append(total)
        pipe_comm.append(comm)
        finishes.append(finish)

    # --- per stage: gradient ring, optimizer ---------------------------------------------------
    dp_sync: list[float] = []
    opt_s: list[list[float]] = []
    end = 0.0
    for s, st in enumerate(stages):
        reps = st.replicas
        grads = max(sm.stage_params(r.tp, st.first_layer, st.last_layer) for r in reps) * grad_bytes
        ar = sm.allreduce_time_s(reps, nodes[s], grads)
        dp_sync.append(ar)
        if dp > 1:
            order = sorted(range(dp), key=lambda i: (reps[i].region, reps[i].zone, nodes[s][i]))
            for k in range(dp):
                a, b = reps[order[k]], reps[order[(k + 1) % dp]]
                if a.zone != b.zone:
                    flows = max(1, min(a.tp, a.gpus_per_node, b.tp, b.gpus_per_node))
                    gb = 2 * (dp - 1) / dp * grads * flows / C.BYTES_PER_GB
                    egress_usd += gb * book.egress_usd_per_gb(a.zone, b.zone)
        opt_s.append(
            [
                sm.optimizer_time_s(r.gpu_type, plan.pipelines[j].microbatch_size, r.tp, st.first_layer, st.last_layer)
                for j, r in enumerate(reps)
            ]
        )
        start = max(finishes[j][s] for j in range(dp))
        end = max(end, start + ar)
    slowest = max(range(dp), key=lambda j: pipe_times[j])
    pipeline_end = pipe_times[slowest]
    if not options.overlap_dp_sync:
        end = pipeline_end + sum(dp_sync)
    dp_exposed = max(0.0, end - pipeline_end)
    opt_max = max(max(row) for row in opt_s)
    iteration = pipeline_end + dp_exposed + opt_max

    # --- memory per (stage, replica) -----------------------------------------------------------
    per_stage: list[ReplicaResult] = []
    for s, st in enumerate(stages):
        for j, r in enumerate(st.replicas):
            pb = plan.pipelines[j]
            in_flight = pb.num_microbatches if schedule == "gpipe" else min(p - s, pb.num_microbatches)
            mem = sm.stage_memory(
                r.gpu_type, r.tp, st.first_layer, st.last_layer,
                mbs=pb.microbatch_size, in_flight=in_flight, precision=precision, zero1=zero1, dp=dp,
                receives_activations=s > 0, receives_gradients=s < p - 1,
            )
            cap = book.gpu(r.gpu_type).memory_bytes
            peak = mem.total_bytes
            c = computes[j][s]
            per_stage.append(
                ReplicaResult(
                    stage=s, replica=j, gpu_type=r.gpu_type, zone=r.zone, tp=r.tp,
                    microbatch_size=pb.microbatch_size, num_microbatches=pb.num_microbatches,
                    forward_s=c.forward_s, backward_s=c.backward_s, compute_s=c.total_s * pb.num_microbatches,
                    optimizer_s=opt_s[s][j], dp_sync_s=dp_sync[s], in_flight_microbatches=in_flight,
                    memory=mem, peak_memory_bytes=peak, capacity_bytes=cap, fits=peak <= cap,
                    bytes_over=max(0, peak - cap),
                )
            )

    # --- throughput and cost -----------------------------------------------------------------------
    samples = plan.global_batch_size
    tokens = samples * book.model.sequence_length
    usd_per_gpu_s = 0.0
    unpriced: list[tuple[str, str, str]] = []
    override = options.prices_usd_per_gpu_hour
    for st in stages:
        for r in st.replicas:
            price = override.get((r.zone, r.gpu_type, r.market)) if override is not None else None
            if price is None:
                price = book.price_usd_per_gpu_hour(r.zone, r.gpu_type, r.market)
            if price is None:
                key = (r.zone, r.gpu_type, r.market.value)
                if key not in unpriced:
                    unpriced.append(key)
                continue
            usd_per_gpu_s += price * r.tp / C.SECONDS_PER_HOUR
    compute_usd = usd_per_gpu_s * iteration
    usd_iter = compute_usd + egress_usd
    return SimulationResult(
        iteration_time_s=iteration,
        breakdown=Breakdown(
            pipeline_compute_s=pipeline_end - pipe_comm[slowest],
            pipeline_p2p_s=pipe_comm[slowest],
            dp_sync_exposed_s=dp_exposed,
            optimizer_s=opt_max,
            dp_sync_per_stage_s=tuple(dp_sync),
            pipeline_time_per_pipeline_s=tuple(pipe_times),
            bubble_s=pipeline_end
            - pipe_comm[slowest]
            - max(c.total_s for c in computes[slowest]) * plan.pipelines[slowest].num_microbatches,
            slowest_pipeline=slowest,
        ),
        per_stage=tuple(per_stage),
        peak_memory_bytes=max(r.peak_memory_bytes for r in per_stage),
        fits_memory=all(r.fits for r in per_stage),
        throughput_iterations_per_s=1.0 / iteration,
        samples_per_s=samples / iteration,
        tokens_per_s=tokens / iteration,
        usd_per_iteration=usd_iter,
        usd_per_hour=usd_iter / iteration * C.SECONDS_PER_HOUR,
        usd_per_million_tokens=usd_iter / tokens * 1e6,
        egress_usd_per_iteration=egress_usd,
        compute_usd_per_iteration=compute_usd,
        num_gpus=plan.num_gpus,
        schedule=schedule,
        precision=precision,
        zero1=zero1,
        unpriced=tuple(unpriced),
    )


def replica_label(r: Replica) -> str:
    return f"{r.gpu_type} x{r.tp} @ {r.zone} ({r.market.value})"
