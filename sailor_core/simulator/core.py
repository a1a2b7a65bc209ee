"""simulate(plan, book): iteration time, memory and cost of a heterogeneous PP x DP x TP plan.

Contract: a pure function of (plan, ProfileBook, SimOptions). An invalid plan raises
`PlanInvalidError` listing every violation; a missing profile raises `MissingProfileError`
naming (model, GPU type, mbs, tp) and the command that creates it; a plan that does not fit in
memory is a valid result (`fits_memory` False, with stage, replica and bytes over).

Time model (docs/simulator.md has the derivations):
- pipeline j runs m_j microbatches of its own size through its replica of every stage. Our runtime's
  schedule (1F1B or GPipe) is run batch by batch as pipeline_schedule.run_schedule posts it (`schedule`), so each
  stage ends its last backward when the runtime's order of operations says; DeepSpeed's blocking
  sends keep their closed form T_j = sum_s (F_s + B_s) + 2 sum_b t_b + (m_j - 1) max_s c_s.
- a stage's gradient ring starts when every pipeline's replica is done with it (stragglers gate
  the sync; ours overlaps it with the last backward in buckets) and the iteration ends when every
  ring and the optimizer step are done.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

from sailor_core.domain import Market, ParallelPlan, Replica, Stage
from sailor_core.errors import PlanInvalidError
from sailor_core.profiles import ProfileBook
from sailor_core.simulator import constants as C
from sailor_core.simulator.model import SimModel, StageCompute, allreduce_buckets, model_for
from sailor_core.simulator.result import Breakdown, ReplicaRow, SimOptions, SimulationResult
from sailor_core.simulator.schedule import run_1f1b, run_deepspeed_1f1b, run_gpipe


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
    compute: Sequence[StageCompute], p2p_s: Sequence[float | tuple[float, float]], num_microbatches: int,
    schedule: str = "1f1b", runtime: str = "sailor", *, with_p2p_part: bool = True,
) -> tuple[float, float, list[float]]:
    """(pipeline seconds, its p2p part, when each stage ends its last backward).

    `compute[s]` is stage s's per-microbatch forward/backward, `p2p_s[b]` the send times across
    boundary b (between stages b and b+1): (activation forward, gradient back), or one number for
    both; len(p2p_s) == len(compute) - 1.

    Our runtime (`sailor`): the schedule is run as pipeline_schedule.run_schedule runs it, batch by batch
    (`simulator.schedule`: 1F1B's warm-up forwards, steady one-forward-one-backward with the mirror
    batches, drain; GPipe's forwards then backwards; a message moves once its send and its receive
    are both posted). Unequal stages get the overlap of their fill and drain exactly. The p2p part
    is the time over the same schedule with free links (skipped with `with_p2p_part=False`).
    DeepSpeed (`deepspeed`): its TrainSchedule run instruction by instruction, with blocking sends
    (`simulator.schedule.run_deepspeed_1f1b`); the p2p part again against free links. DeepSpeed has no
    GPipe schedule: `gpipe` under it keeps the closed form of blocking sends (`_blocking_pipeline_time_s`).
    """
    if runtime == "deepspeed":
        msg = [x if isinstance(x, (int, float)) else max(x) for x in p2p_s]
        if schedule == "gpipe":
            return _blocking_pipeline_time_s(compute, msg, num_microbatches, schedule)
        f_ds = [c.forward_s for c in compute]
        b_ds = [c.backward_s for c in compute]
        total, finish = run_deepspeed_1f1b(f_ds, b_ds, msg, num_microbatches)
        if not with_p2p_part:
            return total, 0.0, finish
        free = run_deepspeed_1f1b(f_ds, b_ds, [0.0] * len(msg), num_microbatches)[0]
        return total, max(0.0, total - free), finish
    fwd = [float(x) if isinstance(x, (int, float)) else x[0] for x in p2p_s]
    bwd = [float(x) if isinstance(x, (int, float)) else x[1] for x in p2p_s]
    f_s = [c.forward_s for c in compute]
    b_s = [c.backward_s for c in compute]
    run = run_gpipe if schedule == "gpipe" else run_1f1b
    total, finish = run(f_s, b_s, fwd, bwd, num_microbatches)
    if not with_p2p_part:
        return total, 0.0, finish
    zero = [0.0] * len(fwd)
    return total, max(0.0, total - run(f_s, b_s, zero, zero, num_microbatches)[0]), finish


def _blocking_pipeline_time_s(
    compute: Sequence[StageCompute], p2p_s: Sequence[float], m: int, schedule: str
) -> tuple[float, float, list[float]]:
    """DeepSpeed's pipeline engine (the artifact's runs): sends and receives are blocking calls inside
    the stage's instruction stream, so a stage pays each boundary twice per microbatch (activation
    and gradient) on top of its compute: c_s = F_s + B_s + 2 (t_{s-1} + t_s), and
    T = sum_s (F_s + B_s) + 2 sum_b t_b + (m - 1) max_s c_s. GPipe: all forwards, then all backwards."""
    p = len(compute)
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


def dp_sync_end_s(finish_s: float, first_bucket_ready_s: float, ring_s: float, last_bucket_ring_s: float) -> float:
    """When a stage's gradient all-reduce ends, buckets launched during the last backward (the runtime's
    DDP-style overlap): bucket k starts when its gradients are final and the previous bucket is done.

    With buckets ready at evenly spaced times the chain ends at the later of (first bucket ready +
    every bucket's ring) and (the backward's end + the last bucket's ring). `first_bucket_ready_s`:
    when the slowest replica has the first bucket's gradients; `finish_s`: its last backward's end.
    Without overlap (replicas that shard differently) pass first_bucket_ready_s = finish_s and
    last_bucket_ring_s = ring_s.
    """
    return max(first_bucket_ready_s + ring_s, finish_s + last_bucket_ring_s)


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
    if opts.runtime not in C.RUNTIMES:
        problems.append(f"runtime must be one of {', '.join(C.RUNTIMES)}, got {opts.runtime!r}")
    if problems:
        raise PlanInvalidError("invalid plan: " + "; ".join(problems))
    return simulate_valid(plan, model_for(book), schedule=schedule, precision=precision, zero1=zero1, options=opts)


class _Pipelines(NamedTuple):
    """Every pipeline's timeline: per-stage compute, pipeline seconds, p2p part, last-backward ends."""

    computes: list[list[StageCompute]]
    times_s: list[float]
    p2p_s: list[float]
    finishes_s: list[list[float]]
    egress_usd: float  # activations and gradients crossing zones, this iteration


class _GradSync(NamedTuple):
    """Every stage's gradient ring and optimizer step, and when the last overlapped ring ends."""

    ring_s: list[float]
    optimizer_s: list[list[float]]  # [stage][replica]
    end_s: float
    egress_usd: float  # the pipelines' egress plus the rings' crossings between zones
    tied_s: float = 0.0  # the tied embedding/head exchange after the first and last stages' rings


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
    nodes = place_nodes(plan)
    pipes = _pipelines(plan, sm, nodes, schedule=schedule, precision=precision, runtime=options.runtime)
    sync = _gradient_sync(plan, sm, nodes, pipes, precision=precision, zero1=zero1, runtime=options.runtime)
    rows, peak_all, fits_all = _memory_rows(plan, sm, pipes, sync, schedule=schedule, precision=precision,
                                            zero1=zero1, runtime=options.runtime)
    return _result(plan, sm.book, pipes, sync, options, rows=tuple(rows), peak_memory_bytes=peak_all,
                   fits_memory=fits_all, schedule=schedule, precision=precision, zero1=zero1)


def _pipelines(
    plan: ParallelPlan, sm: SimModel, nodes: list[list[int]], *, schedule: str, precision: str, runtime: str,
) -> _Pipelines:
    """Compute, p2p and pipeline time of every pipeline; pipelines alike in replicas, batch and
    node sharing have the same timeline, which is computed once."""
    stages = plan.stages
    p = len(stages)
    computes: list[list[StageCompute]] = []
    pipe_times: list[float] = []
    pipe_comm: list[float] = []
    finishes: list[list[float]] = []
    egress_usd = 0.0
    seen: dict[tuple[object, ...], tuple[list[StageCompute], float, float, list[float], float]] = {}
    crowd = nic_sharing(nodes, [(pb.microbatch_size, pb.num_microbatches,
                                 tuple((st.replicas[j].gpu_type, st.replicas[j].tp) for st in stages))
                                for j, pb in enumerate(plan.pipelines)])
    for j, pb in enumerate(plan.pipelines):
        reps = [st.replicas[j] for st in stages]
        shared = tuple(nodes[s][j] == nodes[s + 1][j] for s in range(p - 1))
        share = tuple(crowd[s][j] for s in range(p - 1))
        sig = (pb.microbatch_size, pb.num_microbatches, shared, share,
               tuple((r.gpu_type, r.zone, r.tp, r.gpus_per_node) for r in reps))
        hit = seen.get(sig)
        if hit is None:
            hit = _pipeline_timeline(sm, stages, reps, shared, share, pb.microbatch_size, pb.num_microbatches,
                                     schedule=schedule, precision=precision, runtime=runtime)
            seen[sig] = hit
        computes.append(hit[0])
        pipe_times.append(hit[1])
        pipe_comm.append(hit[2])
        finishes.append(hit[3])
        egress_usd += hit[4]
    return _Pipelines(computes, pipe_times, pipe_comm, finishes, egress_usd)


def nic_sharing(nodes: Sequence[Sequence[int]], pace: Sequence[Hashable] | None = None) -> list[list[int]]:
    """For every boundary s and pipeline j: how many pipelines send their stage-s -> s+1 messages
    through the busier of the two nodes' NICs at the same time (1 inside a node).

    Pipelines of one pace (`pace[j]`: the same microbatches on the same GPU types and TP degrees)
    run in step, so every such pipeline whose boundary leaves node N sends when the others do (and
    all those entering N receive together): their flows share N's link. Pipelines of different
    paces drift apart and meet on the link only now and then, which this first-order count leaves
    out. It counts pipelines per (boundary, node, pace) at the sending and the receiving end and
    takes the larger count of the two ends of each pipeline's hop."""
    keys: Sequence[Hashable] = pace if pace is not None else [0] * (len(nodes[0]) if nodes else 0)
    out: list[list[int]] = []
    for s in range(len(nodes) - 1):
        hops = list(zip(nodes[s], nodes[s + 1], keys, strict=True))
        leaving = Counter((a, k) for a, b, k in hops if a != b)
        entering = Counter((b, k) for a, b, k in hops if a != b)
        out.append([1 if a == b else max(leaving[a, k], entering[b, k]) for a, b, k in hops])
    return out


def _pipeline_timeline(
    sm: SimModel, stages: Sequence[Stage], reps: Sequence[Replica], shared: tuple[bool, ...],
    share: tuple[int, ...], mbs: int, num_microbatches: int, *, schedule: str, precision: str, runtime: str,
) -> tuple[list[StageCompute], float, float, list[float], float]:
    """(per-stage compute, pipeline seconds, its p2p part, last-backward ends, egress USD) of one pipeline;
    `share[s]`: pipelines whose boundary-s messages share this one's NIC (`nic_sharing`)."""
    book = sm.book
    msg_bytes_per_elem = C.P2P_BYTES_PER_ELEMENT[precision]
    ours = runtime == "sailor"
    comp = [sm.stage_compute(r.gpu_type, mbs, r.tp, st.first_layer, st.last_layer, st.recompute)
            for r, st in zip(reps, stages, strict=True)]
    p2p: list[float | tuple[float, float]] = []
    egress = 0.0
    for s in range(len(stages) - 1):
        a, b = reps[s], reps[s + 1]
        msg = sm.boundary_elems(a.tp, stages[s].last_layer) * mbs * msg_bytes_per_elem
        if ours:
            p2p.append(sm.boundary_p2p_s(a, b, msg, same_node=shared[s], share=share[s]))
        else:
            p2p.append(sm.partitioned_p2p_s(a, b, msg, same_node=shared[s], share=share[s]))
        if a.zone != b.zone:  # both runtimes send one message each way, in slices
            gb = msg * num_microbatches / C.BYTES_PER_GB
            egress += gb * (book.egress_usd_per_gb(a.zone, b.zone) + book.egress_usd_per_gb(b.zone, a.zone))
    total, comm, finish = pipeline_time_s(comp, p2p, num_microbatches, schedule, runtime)
    return comp, total, comm, finish, egress


def _gradient_sync(
    plan: ParallelPlan, sm: SimModel, nodes: list[list[int]], pipes: _Pipelines, *, precision: str, zero1: bool,
    runtime: str,
) -> _GradSync:
    """Each stage's gradient ring (when it ends, what crossing zones costs) and optimizer step."""
    dp = len(plan.pipelines)
    grad_bytes = C.FP32_GRAD_BYTES if precision == "fp32" else C.BF16_GRAD_BYTES
    dp_sync: list[float] = []
    opt_s: list[list[float]] = []
    ends: list[float] = []
    egress_usd = pipes.egress_usd
    for s, st in enumerate(plan.stages):
        reps = list(st.replicas)
        grads = max(sm.stage_params(r.tp, st.first_layer, st.last_layer) for r in reps) * grad_bytes
        ar, sync_end = _stage_ring(plan, sm, s, nodes[s], pipes, grads, grad_bytes, runtime)
        dp_sync.append(ar)
        if dp > 1 and len({r.zone for r in reps}) > 1:
            egress_usd = _ring_egress_usd(sm.book, reps, nodes[s], grads, egress_usd)
        # ZeRO-1: each replica steps 1/dp of the optimizer state; the reduce-scatter of gradients plus
        # the all-gather of updated weights move the same bytes as the all-reduce they replace.
        shard = dp if zero1 else 1
        opt_s.append(
            [
                sm.optimizer_time_s(r.gpu_type, plan.pipelines[j].microbatch_size, r.tp, st.first_layer, st.last_layer)
                / shard
                for j, r in enumerate(reps)
            ]
        )
        ends.append(sync_end)
    end = max(ends)
    tied = _tied_sync(plan, sm, nodes) if runtime == "sailor" else None
    if tied is None:
        return _GradSync(dp_sync, opt_s, end, egress_usd)
    tied_s, tied_usd = tied
    return _GradSync(dp_sync, opt_s, max(end, max(ends[0], ends[-1]) + tied_s), egress_usd + tied_usd, tied_s)


def _tied_sync(plan: ParallelPlan, sm: SimModel, nodes: list[list[int]]) -> tuple[float, float] | None:
    """(seconds, egress USD) of our runtime's tied embedding/head exchange, which starts when the first
    and the last stage's rings have ended (tied_weights.TiedWeights.sync): the slowest pipeline's, each crossing
    zones moving the fp32 weight once each way. None for one stage or an untied model."""
    gb = sm.tied_weight_bytes() / C.BYTES_PER_GB
    if len(plan.stages) < 2 or not gb:
        return None
    first, last = plan.stages[0], plan.stages[-1]
    worst = usd = 0.0
    for j, (a, b) in enumerate(zip(first.replicas, last.replicas, strict=True)):
        worst = max(worst, sm.tied_sync_s(a, b, same_node=nodes[0][j] == nodes[-1][j]))
        if a.zone != b.zone:
            usd += gb * (sm.book.egress_usd_per_gb(a.zone, b.zone) + sm.book.egress_usd_per_gb(b.zone, a.zone))
    return worst, usd


def _stage_ring(
    plan: ParallelPlan, sm: SimModel, s: int, nodes_s: list[int], pipes: _Pipelines, grads: float,
    grad_bytes: int, runtime: str,
) -> tuple[float, float]:
    """(seconds of stage s's gradient all-reduce, when it ends) under the runtime's bucketing."""
    st = plan.stages[s]
    reps = list(st.replicas)
    dp = len(plan.pipelines)
    finishes, computes = pipes.finishes_s, pipes.computes
    finish_s = max(finishes[j][s] for j in range(dp))
    if runtime != "sailor":  # DeepSpeed: 5e8-byte buckets once the stage's last backward is done
        ar = sm.allreduce_time_s(reps, nodes_s, allreduce_buckets(grads, C.DEEPSPEED_BUCKET_BYTES))
        return ar, dp_sync_end_s(finish_s, finish_s, ar, ar)
    if dp > 1 and len({r.tp for r in reps}) == 1:
        # the runtime's buckets, launched during the last microbatch's backward (data_parallel.buckets_of)
        buckets = sm.grad_buckets(reps[0].tp, st.first_layer, st.last_layer, grad_bytes)
        ar = sm.allreduce_time_s(reps, nodes_s, [b for b, _ in buckets])
        ar_last = sm.allreduce_time_s(reps, nodes_s, [buckets[-1][0]])
        first_layer_of_bucket = buckets[0][1]
        ready = max(
            finishes[j][s] - computes[j][s].backward_s
            + sm.stage_compute(r.gpu_type, plan.pipelines[j].microbatch_size, r.tp, first_layer_of_bucket,
                               st.last_layer, st.recompute).backward_s
            for j, r in enumerate(reps)
        )
        return ar, dp_sync_end_s(finish_s, ready, ar, ar_last)
    # replicas that shard differently meet in the full layout after the pipeline: one all-reduce
    ar = sm.allreduce_time_s(reps, nodes_s, grads)
    return ar, dp_sync_end_s(finish_s, finish_s, ar, ar)


def _ring_egress_usd(
    book: ProfileBook, reps: Sequence[Replica], nodes_s: Sequence[int], grads: float, egress_usd: float,
) -> float:
    """`egress_usd` plus what one stage's gradient ring pays where neighbours sit in different zones."""
    dp = len(reps)
    order = sorted(range(dp), key=lambda i: (reps[i].region, reps[i].zone, nodes_s[i]))
    for k in range(dp):
        a, b = reps[order[k]], reps[order[(k + 1) % dp]]
        if a.zone != b.zone:
            flows = max(1, min(a.tp, a.gpus_per_node, b.tp, b.gpus_per_node))
            gb = 2 * (dp - 1) / dp * grads * flows / C.BYTES_PER_GB
            egress_usd += gb * book.egress_usd_per_gb(a.zone, b.zone)
    return egress_usd


def _memory_rows(
    plan: ParallelPlan, sm: SimModel, pipes: _Pipelines, sync: _GradSync, *, schedule: str, precision: str,
    zero1: bool, runtime: str,
) -> tuple[list[ReplicaRow], int, bool]:
    """(one row per (stage, replica) with its peak memory, the plan's peak bytes, whether all fit)."""
    stages = plan.stages
    p = len(stages)
    dp = len(plan.pipelines)
    book, computes, opt_s, dp_sync = sm.book, pipes.computes, sync.optimizer_s, sync.ring_s
    rows: list[ReplicaRow] = []
    peak_all = 0
    fits_all = True
    for s, st in enumerate(stages):
        for j, r in enumerate(st.replicas):
            pb = plan.pipelines[j]
            in_flight = pb.num_microbatches if schedule == "gpipe" else min(p - s, pb.num_microbatches)
            mem = sm.stage_memory(
                r.gpu_type, r.tp, st.first_layer, st.last_layer,
                mbs=pb.microbatch_size, in_flight=in_flight, precision=precision, zero1=zero1, dp=dp,
                receives_activations=s > 0, receives_gradients=s < p - 1, recompute=st.recompute,
                runtime=runtime,
            )
            cap = book.gpu(r.gpu_type).memory_bytes
            peak = mem.total_bytes
            peak_all = max(peak_all, peak)
            fits_all = fits_all and peak <= cap
            rows.append((s, j, r, pb.microbatch_size, pb.num_microbatches, computes[j][s], opt_s[s][j],
                         dp_sync[s], in_flight, mem, cap))
    return rows, peak_all, fits_all


def _usd_per_gpu_s(
    plan: ParallelPlan, book: ProfileBook, override: Mapping[tuple[str, str, Market], float] | None,
) -> tuple[float, list[tuple[str, str, str]]]:
    """(USD per second of every priced GPU of the plan, the (zone, GPU type, market) with no price)."""
    usd_per_gpu_s = 0.0
    unpriced: list[tuple[str, str, str]] = []
    for (zone, gpu, market), n_gpus in plan.gpus_by_place().items():
        price = override.get((zone, gpu, market)) if override is not None else None
        if price is None:
            price = book.price_usd_per_gpu_hour(zone, gpu, market)
        if price is None:
            unpriced.append((zone, gpu, market.value))
            continue
        usd_per_gpu_s += price * n_gpus / C.SECONDS_PER_HOUR
    return usd_per_gpu_s, unpriced


def _result(
    plan: ParallelPlan, book: ProfileBook, pipes: _Pipelines, sync: _GradSync, options: SimOptions, *,
    rows: tuple[ReplicaRow, ...], peak_memory_bytes: int, fits_memory: bool, schedule: str, precision: str,
    zero1: bool,
) -> SimulationResult:
    """The iteration's time (slowest pipeline, exposed gradient sync, optimizer), throughput and cost."""
    pipe_times, pipe_comm = pipes.times_s, pipes.p2p_s
    slowest = max(range(len(plan.pipelines)), key=lambda j: pipe_times[j])
    pipeline_end = pipe_times[slowest]
    end = sync.end_s if options.overlap_dp_sync else pipeline_end + sum(sync.ring_s) + sync.tied_s
    dp_exposed = max(0.0, end - pipeline_end)
    opt_max = max(max(row) for row in sync.optimizer_s)
    iteration = pipeline_end + dp_exposed + opt_max
    samples = plan.global_batch_size
    tokens = samples * book.model.sequence_length
    usd_per_gpu_s, unpriced = _usd_per_gpu_s(plan, book, options.prices_usd_per_gpu_hour)
    compute_usd = usd_per_gpu_s * iteration
    egress_usd = sync.egress_usd
    usd_iter = compute_usd + egress_usd
    return SimulationResult(
        iteration_time_s=iteration,
        breakdown=Breakdown(
            pipeline_compute_s=pipeline_end - pipe_comm[slowest],
            pipeline_p2p_s=pipe_comm[slowest],
            dp_sync_exposed_s=dp_exposed,
            optimizer_s=opt_max,
            dp_sync_per_stage_s=tuple(sync.ring_s),
            pipeline_time_per_pipeline_s=tuple(pipe_times),
            bubble_s=max(
                0.0,
                pipeline_end
                - pipe_comm[slowest]
                - max(c.total_s for c in pipes.computes[slowest]) * plan.pipelines[slowest].num_microbatches,
            ),
            slowest_pipeline=slowest,
        ),
        rows=rows,
        peak_memory_bytes=peak_memory_bytes,
        fits_memory=fits_memory,
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
