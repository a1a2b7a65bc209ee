"""Stage-level building blocks of the simulator, memoised per ProfileBook.

Contract: `SimModel(book)` answers the questions the simulator and the planner's search ask about
one model on a set of GPUs and links, each in O(1) after a first call:

- `stage_compute(gpu, mbs, tp, first, last, recompute=False)`: forward and backward seconds of one
  microbatch on layers first..last (inclusive) of one TP group (prefix sums over the per-layer
  profiles); with activation recomputation the backward also runs the blocks' forward again;
- `optimizer_time_s(...)`: the optimizer step of that stage;
- `stage_params(tp, first, last)`, `stage_memory(...)`: parameters held per GPU and peak memory;
  with `recompute` a block keeps only its input per microbatch in flight, and the block being
  recomputed holds its full activations for one microbatch;
- `p2p_time_s(...)`, `allreduce_time_s(...)`: pipeline messages and data-parallel gradient rings on
  the published bandwidth fits, within a node, a zone, across zones and regions; a data-parallel
  group inside one node takes the node's measured all-reduce instead where the store has one
  (`node_allreduce_s`, written by the network profiler).

`model_for(book)` returns the cached `SimModel` of a book (one per book object), so `simulate` and
the planner share the same numbers and caches: one model, not two. Pure: no I/O, no globals read
beyond that cache, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sailor_core.domain import BandwidthFit, Replica
from sailor_core.errors import MissingProfileError
from sailor_core.profiles import ProfileBook
from sailor_core.simulator import constants as C


@dataclass(frozen=True, slots=True)
class StageCompute:
    """Seconds per microbatch of one stage on one replica."""

    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Peak bytes on one GPU of a stage replica, by term (see docs/simulator.md)."""

    framework_bytes: int  # CUDA context, kernels, communicator buffers: stored per GPU type
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    comm_buffer_bytes: int  # flat all-reduce bucket (data parallel only)
    activations_bytes: int  # saved activations of the microbatches in flight
    workspace_bytes: int  # backward temporaries of the largest layer
    p2p_buffers_bytes: int  # received activations/gradients from neighbouring stages
    optimizer_step_bytes: int = 0  # the optimizer step's temporaries beyond the freed activations

    @property
    def total_bytes(self) -> int:
        return (
            self.framework_bytes
            + self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + self.comm_buffer_bytes
            + self.activations_bytes
            + self.workspace_bytes
            + self.p2p_buffers_bytes
            + self.optimizer_step_bytes
        )


class _Prefix:
    """Prefix sums of per-layer forward/backward seconds for one (gpu, mbs, tp)."""

    __slots__ = ("fwd", "bwd", "opt_s")

    def __init__(self, fwd: list[float], bwd: list[float], opt_s: float) -> None:
        self.fwd = fwd
        self.bwd = bwd
        self.opt_s = opt_s


class _SizePrefix:
    """Prefix sums of per-layer sizes for one TP degree."""

    __slots__ = ("params", "act", "act_max", "out_elems", "in_elems", "_acts", "blocks", "block_act", "block_in")

    def __init__(self, book: ProfileBook, tp: int) -> None:
        m = book.model
        layers = [m.layer(i, tp) for i in range(m.num_layers)]
        self.params = [0]
        self.act = [0]
        for ly in layers:
            self.params.append(self.params[-1] + ly.params)
            self.act.append(self.act[-1] + ly.act_memory_bytes)
        self.act_max: dict[tuple[int, int], int] = {}
        self.out_elems = [ly.act_output_elems for ly in layers]
        self.in_elems = [ly.act_input_elems for ly in layers]
        self._acts = [ly.act_memory_bytes for ly in layers]
        # prefix sums over transformer blocks only (what activation recomputation applies to)
        self.blocks, self.block_act, self.block_in = [0], [0], [0]
        for ly in layers:
            is_block = ly.kind == "block"
            self.blocks.append(self.blocks[-1] + int(is_block))
            self.block_act.append(self.block_act[-1] + (ly.act_memory_bytes if is_block else 0))
            self.block_in.append(self.block_in[-1] + (ly.act_input_elems * C.FP32_BYTES if is_block else 0))

    def is_block(self, i: int) -> bool:
        return self.blocks[i + 1] > self.blocks[i]

    def max_block_act(self, first: int, last: int) -> int:
        return max((self._acts[i] for i in range(first, last + 1) if self.is_block(i)), default=0)

    def max_act(self, first: int, last: int) -> int:
        key = (first, last)
        v = self.act_max.get(key)
        if v is None:
            v = max(self._acts[first : last + 1])
            self.act_max[key] = v
        return v


class SimModel:
    """Memoised building blocks over one ProfileBook (see the module docstring)."""

    def __init__(self, book: ProfileBook, *, smooth: bool = True) -> None:
        self.book = book
        self.smooth = smooth
        self._prefix: dict[tuple[str, int, int], _Prefix] = {}
        self._sizes: dict[int, _SizePrefix] = {}
        self._fit_cache: dict[tuple[object, ...], tuple[BandwidthFit, int, bool]] = {}
        self._class_memo: dict[tuple[object, ...], tuple[object, ...]] = {}
        self._full_params: dict[int, int] = {}
        # Memo tables: a planner's search asks the same stage questions over and over.
        self._compute_memo: dict[tuple[str, int, int, int, int, bool], StageCompute] = {}
        self._memory_memo: dict[tuple[object, ...], StageMemory] = {}
        self._p2p_memo: dict[tuple[object, ...], float] = {}
        self._ar_memo: dict[tuple[object, ...], float] = {}
        self._bucket_memo: dict[tuple[int, int, int, int], tuple[tuple[int, int], ...]] = {}

    # -- compute ---------------------------------------------------------------------------
    def _prefix_for(self, gpu: str, mbs: int, tp: int) -> _Prefix:
        key = (gpu, mbs, tp)
        p = self._prefix.get(key)
        if p is None:
            fwd_l, bwd_l, opt_s = self._layer_times(gpu, mbs, tp)
            fwd = [0.0]
            bwd = [0.0]
            for f, b in zip(fwd_l, bwd_l, strict=True):
                fwd.append(fwd[-1] + f)
                bwd.append(bwd[-1] + b)
            p = _Prefix(fwd, bwd, opt_s)
            self._prefix[key] = p
        return p

    def _checked_layers(self, gpu: str, mbs: int, tp: int) -> tuple[list[float], list[float], float]:
        layers = self.book.layers(gpu, mbs, tp)
        n = self.book.model.num_layers
        if len(layers) != n or [ly.layer for ly in layers] != list(range(n)):
            raise MissingProfileError(
                f"profile (model={self.book.model.name}, gpu_type={gpu}, mbs={mbs}, tp={tp}) covers layers "
                f"{[ly.layer for ly in layers][:4]}... but the model has {n}",
                fix=f"re-run sailor profile model --model {self.book.model.name} --mbs {mbs} --tp {tp} "
                f"on a {gpu} machine",
                kind="layers", model=self.book.model.name, gpu_type=gpu, mbs=mbs, tp=tp,
            )
        return [ly.forward_s for ly in layers], [ly.backward_s for ly in layers], layers[0].optimizer_s

    def _layer_times(self, gpu: str, mbs: int, tp: int) -> tuple[list[float], list[float], float]:
        """Per-layer forward/backward seconds at (gpu, mbs, tp), denoised across microbatch sizes.

        Each profiled point is one short measurement; the published profiles disagree with each
        other by up to 50 % at single points (README, section 2b). A layer's time is locally affine
        in the microbatch size (a fixed launch cost plus work proportional to the tokens), so we
        estimate every point by the least-squares line through the `SMOOTHING_WINDOW` profiled
        microbatch sizes nearest to it (in log2 distance, itself included) for the same GPU type
        and TP degree, evaluated at mbs. An exactly affine profile is returned unchanged.
        """
        fwd, bwd, opt_s = self._checked_layers(gpu, mbs, tp)
        if not self.smooth:
            return fwd, bwd, opt_s
        complete = {mbs: (fwd, bwd, opt_s)}
        for m, t in self.book.profiled_points(gpu):
            if t == tp and m != mbs:
                try:
                    complete[m] = self._checked_layers(gpu, m, tp)
                except MissingProfileError:
                    continue  # an incomplete neighbour does not take part
        if len(complete) < C.SMOOTHING_WINDOW:
            return fwd, bwd, opt_s
        window = sorted(complete, key=lambda m: (abs(math.log2(m) - math.log2(mbs)), m))[: C.SMOOTHING_WINDOW]
        xs = [float(m) for m in window]
        ys = [complete[m] for m in window]
        xbar = sum(xs) / len(xs)
        sxx = sum((x - xbar) ** 2 for x in xs)
        # weight of each window point in the fitted value at mbs (the hat matrix row): linear in y
        w = [1.0 / len(xs) + (x - xbar) * (mbs - xbar) / sxx for x in xs]
        n = len(fwd)
        sf = [max(0.0, sum(wk * y[0][i] for wk, y in zip(w, ys, strict=True))) for i in range(n)]
        sb = [max(0.0, sum(wk * y[1][i] for wk, y in zip(w, ys, strict=True))) for i in range(n)]
        return sf, sb, opt_s

    def stage_compute(
        self, gpu: str, mbs: int, tp: int, first: int, last: int, recompute: bool = False
    ) -> StageCompute:
        """Forward and backward seconds of one microbatch of `mbs` on layers first..last."""
        key = (gpu, mbs, tp, first, last, recompute)
        hit = self._compute_memo.get(key)
        if hit is None:
            p = self._prefix_for(gpu, mbs, tp)
            bwd = p.bwd[last + 1] - p.bwd[first]
            if recompute:  # backward runs each block's forward again first
                size = self._size(tp)
                bwd += sum(p.fwd[i + 1] - p.fwd[i] for i in range(first, last + 1) if size.is_block(i))
            hit = StageCompute(forward_s=p.fwd[last + 1] - p.fwd[first], backward_s=bwd)
            self._compute_memo[key] = hit
        return hit

    def optimizer_time_s(self, gpu: str, mbs: int, tp: int, first: int, last: int) -> float:
        """Optimizer step of the stage's shard.

        The profile's update time is one per-GPU step for the whole model at that TP degree (the
        same number on every layer, README section 2a). Adam is memory-bound and linear in the
        parameters it updates, so a stage pays its share of the model's parameters.
        """
        p = self._prefix_for(gpu, mbs, tp)
        full = self._full(tp)
        return p.opt_s * (self.stage_params(tp, first, last) / full if full else 1.0)

    # -- sizes -----------------------------------------------------------------------------
    def _size(self, tp: int) -> _SizePrefix:
        s = self._sizes.get(tp)
        if s is None:
            s = _SizePrefix(self.book, tp)
            self._sizes[tp] = s
        return s

    def _full(self, tp: int) -> int:
        v = self._full_params.get(tp)
        if v is None:
            v = self._size(tp).params[-1]
            self._full_params[tp] = v
        return v

    def stage_params(self, tp: int, first: int, last: int) -> int:
        """Parameter elements held by one GPU of a tp-way group for layers first..last."""
        s = self._size(tp)
        return s.params[last + 1] - s.params[first]

    def boundary_elems(self, tp: int, last: int) -> int:
        """Elements of the activation leaving layer `last` for one sequence (the p2p message)."""
        return self._size(tp).out_elems[last]

    def stage_memory(
        self,
        gpu: str,
        tp: int,
        first: int,
        last: int,
        *,
        mbs: int,
        in_flight: int,
        precision: str = "fp32",
        zero1: bool = False,
        dp: int = 1,
        receives_activations: bool = False,
        receives_gradients: bool = False,
        recompute: bool = False,
        runtime: str = "sailor",
    ) -> StageMemory:
        """Peak bytes on one GPU of a replica that keeps `in_flight` microbatches of `mbs`."""
        key = (gpu, tp, first, last, mbs, in_flight, precision, zero1, dp, receives_activations, receives_gradients,
               recompute, runtime)
        hit = self._memory_memo.get(key)
        if hit is None:
            hit = self._stage_memory(
                gpu, tp, first, last, mbs=mbs, in_flight=in_flight, precision=precision, zero1=zero1, dp=dp,
                receives_activations=receives_activations, receives_gradients=receives_gradients,
                recompute=recompute, runtime=runtime,
            )
            self._memory_memo[key] = hit
        return hit

    def _stage_memory(
        self,
        gpu: str,
        tp: int,
        first: int,
        last: int,
        *,
        mbs: int,
        in_flight: int,
        precision: str,
        zero1: bool,
        dp: int,
        receives_activations: bool,
        receives_gradients: bool,
        recompute: bool = False,
        runtime: str = "sailor",
    ) -> StageMemory:
        s = self._size(tp)
        params = s.params[last + 1] - s.params[first]
        if precision == "bf16":
            w, g, opt = C.BF16_WEIGHT_BYTES, C.BF16_GRAD_BYTES, C.BF16_MASTER_AND_ADAM_BYTES
            act_scale = C.BF16_ACTIVATION_SCALE
        else:
            w, g, opt = C.FP32_WEIGHT_BYTES, C.FP32_GRAD_BYTES, C.FP32_ADAM_STATE_BYTES
            act_scale = 1.0
        opt_bytes = params * opt
        if zero1 and dp > 1:
            opt_bytes = math.ceil(opt_bytes / dp)
        # The flat bucket gradients are copied into for the data-parallel all-reduce. Ours: a 25 MiB
        # copy per bucket, made while the last backward frees activations, whose freed blocks the
        # caching allocator hands back out: they add to the peak only beyond what was freed.
        # DeepSpeed: one contiguous copy of up to 5e8 elements after the last backward; the freed
        # activations are separate cached blocks (reserved memory, what nvidia-smi shows, never
        # shrinks), and no such block holds it, so the allocator reserves a new segment: it adds in full.
        kept = s.act[last + 1] - s.act[first]
        recomputing = 0
        if recompute:
            # blocks keep only their input per microbatch in flight; during backward one block at a
            # time holds its full activations again, for one microbatch
            kept += (s.block_in[last + 1] - s.block_in[first]) - (s.block_act[last + 1] - s.block_act[first])
            recomputing = s.max_block_act(first, last) * mbs
        act = int((kept * mbs * in_flight + recomputing) * act_scale)
        workspace = int(C.BACKWARD_WORKSPACE_FACTOR * s.max_act(first, last) * mbs * act_scale)
        msg = C.P2P_BYTES_PER_ELEMENT.get(precision, C.FP32_BYTES)
        p2p = 0
        # this project's runtime keeps every bucket's flat copy until the step's synchronisation ends (all
        # the gradients); DeepSpeed reuses one bucket of at most 5e8 gradient elements
        bucket = (params * g if runtime == "sailor" else min(params, C.DEEPSPEED_BUCKET_ELEMENTS) * g) if dp > 1 else 0
        if receives_activations:  # inputs received from the previous stage, one per microbatch in flight
            p2p += s.in_elems[first] * mbs * msg * in_flight
        if receives_gradients:  # the gradient of the stage output, one microbatch at a time
            p2p += s.out_elems[last] * mbs * msg
        comm = max(0, bucket - (act + workspace + p2p)) if runtime == "sailor" else bucket
        stepped = math.ceil(params / dp) if zero1 and dp > 1 else params  # what this rank's optimizer steps
        step_tmp = stepped * C.ADAM_STEP_TEMPORARY_BYTES_PER_PARAM if runtime == "sailor" else 0
        step_extra = max(0, step_tmp - (act + workspace + p2p + comm))  # after the backward's memory is freed
        return StageMemory(
            framework_bytes=self.book.overhead_bytes(gpu),
            weights_bytes=params * w,
            gradients_bytes=params * g,
            optimizer_bytes=opt_bytes,
            comm_buffer_bytes=comm,
            activations_bytes=act,
            workspace_bytes=workspace,
            p2p_buffers_bytes=p2p,
            optimizer_step_bytes=step_extra,
        )

    # -- network ---------------------------------------------------------------------------
    def _inter_fit(self, a: Replica, a_count: int, b: Replica, b_count: int) -> tuple[BandwidthFit, int]:
        """The measured link a -> b and the GPU count it was measured with.

        Lookup order: exact counts; both counts set to the smaller one (the artifact derives mixed
        counts that way); count 1 (the flows then share one measured NIC); the reverse direction.
        """
        key = ("inter", a.zone, a.gpu_type, a_count, b.zone, b.gpu_type, b_count)
        hit = self._fit_cache.get(key)
        if hit is not None:
            return hit[0], hit[1]
        book = self.book
        c = min(a_count, b_count)
        tries = [
            (a.zone, a.gpu_type, a_count, b.zone, b.gpu_type, b_count),
            (a.zone, a.gpu_type, c, b.zone, b.gpu_type, c),
            (a.zone, a.gpu_type, 1, b.zone, b.gpu_type, 1),
            (b.zone, b.gpu_type, b_count, a.zone, a.gpu_type, a_count),
            (b.zone, b.gpu_type, c, a.zone, a.gpu_type, c),
            (b.zone, b.gpu_type, 1, a.zone, a.gpu_type, 1),
        ]
        for t in tries:
            lk = book.link(*t)
            if lk is not None:
                self._fit_cache[key] = (lk.fit, t[2], False)
                return lk.fit, t[2]
        raise MissingProfileError(
            f"no network profile for {a.gpu_type} x{a_count} in {a.zone} -> {b.gpu_type} x{b_count} in {b.zone}",
            fix=f"sailor profile network --from {a.zone}:{a.gpu_type} --to {b.zone}:{b.gpu_type}",
            kind="link", model=book.model.name, link=(a.zone, a.gpu_type, a_count, b.zone, b.gpu_type, b_count),
        )

    def link_class(self, zone_a: str, gpu_a: str, per_node_a: int, zone_b: str, gpu_b: str, per_node_b: int
                   ) -> tuple[object, ...]:
        """What a send between a GPU of `gpu_a` in `zone_a` and one of `gpu_b` in `zone_b` reads of the
        book's links, either way: the fit `_inter_fit` finds (and the count it was measured with) for every
        number of concurrent flows a node can hold, None where it finds none. Two pairs of zones of one
        class time every boundary message the same (the planner's link floors time one pair per class)."""
        key = (zone_a, gpu_a, per_node_a, zone_b, gpu_b, per_node_b)
        hit = self._class_memo.get(key)
        if hit is None:
            a = Replica(gpu_type=gpu_a, zone=zone_a, tp=1, gpus_per_node=per_node_a)
            b = Replica(gpu_type=gpu_b, zone=zone_b, tp=1, gpus_per_node=per_node_b)
            out: list[object] = []
            for f in range(1, max(per_node_a, per_node_b, 1) + 1):
                for x, cx, y, cy in ((a, min(f, per_node_a), b, min(f, per_node_b)),
                                     (b, min(f, per_node_b), a, min(f, per_node_a))):
                    try:
                        out.append(self._inter_fit(x, max(1, cx), y, max(1, cy)))
                    except MissingProfileError:
                        out.append(None)
            hit = self._class_memo[key] = tuple(out)
        return hit

    def _intra_fit(self, gpu: str, num_gpus: int, gpus_per_node: int) -> tuple[BandwidthFit, int]:
        key = ("intra", gpu, num_gpus)
        hit = self._fit_cache.get(key)
        if hit is not None:
            return hit[0], hit[1]
        for n in sorted({max(2, min(num_gpus, gpus_per_node)), 2, 4, 8}, key=lambda x: (abs(x - num_gpus), x)):
            lk = self.book.intra_node_link(gpu, n)
            if lk is not None:
                self._fit_cache[key] = (lk.fit, n, True)
                return lk.fit, n
        raise MissingProfileError(
            f"no intra-node network profile for {gpu} (needed for GPUs of one node talking to each other)",
            fix=f"sailor profile network --intra-node --gpu-type {gpu}",
            kind="intra-node", model=self.book.model.name, gpu_type=gpu,
        )

    def flow_bandwidth_bytes_per_s(
        self, a: Replica, b: Replica, flows: int, message_bytes: float, *, same_node: bool
    ) -> float:
        """Bandwidth one of `flows` concurrent transfers of `message_bytes` each gets from a to b.

        Across nodes, a fit measured with n GPUs of a node sending at once is their aggregate
        bandwidth (cloud NICs are shared: README section 3), so each of max(n, flows) concurrent
        senders gets 1/max(n, flows) of it. Within a node, a transfer is a GPU pair on NVLink/PCIe
        (the fit measured with 2 GPUs); pairs of one node use distinct links.
        """
        if same_node:
            fit, _ = self._intra_fit(a.gpu_type, 2, a.gpus_per_node)
            return fit.bandwidth_bytes_per_s(message_bytes)
        # more flows than a node has GPUs (several copies per GPU) share the fit of the whole node
        fit, n = self._inter_fit(a, min(flows, max(1, a.gpus_per_node)), b, min(flows, max(1, b.gpus_per_node)))
        return fit.bandwidth_bytes_per_s(message_bytes) / max(n, flows)

    def p2p_time_s(self, sender: Replica, receiver: Replica, message_bytes: float, *, same_node: bool,
                   copies: int | None = None, share: int = 1) -> float:
        """Seconds until `copies` copies of one pipeline message, sent at once from `sender`'s node to
        `receiver`'s, have all arrived (default: one per rank of the smaller TP group), while `share`
        pipelines in all (this one included) send theirs through the same node's link.

        The copies are concurrent flows between the same two nodes: across nodes they share the
        measured bandwidth (`flow_bandwidth_bytes_per_s`) with every other pipeline's copies on that
        link, inside a node each pair has its own link.
        """
        if message_bytes <= 0:
            return 0.0
        k = copies if copies is not None else max(1, min(sender.tp, receiver.tp))
        flows = k if same_node else k * max(1, share)
        key = (sender.zone, sender.gpu_type, sender.gpus_per_node,
               receiver.zone, receiver.gpu_type, receiver.gpus_per_node, message_bytes, same_node, flows)
        hit = self._p2p_memo.get(key)
        if hit is None:
            bw = self.flow_bandwidth_bytes_per_s(sender, receiver, flows, message_bytes, same_node=same_node)
            hit = message_bytes / bw
            self._p2p_memo[key] = hit
        return hit

    def sliced_p2p_s(self, sender: Replica, receiver: Replica, message_bytes: float, slices: int, *,
                     same_node: bool, share: int = 1) -> float:
        """Seconds to hand one pipeline message to a receiving TP group in `slices` slices: the slices
        cross at once (each a flow sharing the two nodes' link, with the other `share` - 1 pipelines'
        flows through the same NIC), then the receiving group all-gathers them over its node's GPU
        pairs ((slices - 1) ring steps of one slice). One slice is the whole message, no gather."""
        k = max(1, slices)
        if k == 1 or message_bytes <= 0:
            return self.p2p_time_s(sender, receiver, message_bytes, same_node=same_node, copies=1, share=share)
        part = message_bytes / k
        send = self.p2p_time_s(sender, receiver, part, same_node=same_node, copies=k, share=share)
        gather = (k - 1) * part / self.flow_bandwidth_bytes_per_s(receiver, receiver, 1, part, same_node=True)
        return send + gather

    def boundary_p2p_s(self, sender: Replica, receiver: Replica, message_bytes: float, *,
                       same_node: bool, share: int = 1) -> tuple[float, float]:
        """(activation forward, gradient back) seconds across one stage boundary, as our runtime sends.

        The activation crosses once, cut in one slice per receiving TP rank, and the receiving group
        all-gathers it; the input gradient comes back the same way, one slice per sending TP rank
        (pipeline_schedule.P2P): `sliced_p2p_s` with tp_recv slices forward and tp_send slices back.
        """
        return (self.sliced_p2p_s(sender, receiver, message_bytes, max(1, receiver.tp), same_node=same_node,
                                  share=share),
                self.sliced_p2p_s(receiver, sender, message_bytes, max(1, sender.tp), same_node=same_node,
                                  share=share))

    def partitioned_p2p_s(self, sender: Replica, receiver: Replica, message_bytes: float, *,
                          same_node: bool, share: int = 1) -> float:
        """Seconds of one pipeline message as DeepSpeed's pipeline engine sends it (the artifact's runs).

        With tensor parallelism it partitions the activation, and the gradient coming back, over the
        TP group (its `pipe_partitioned` and `grad_partitioned` settings, both on by default): each of
        the k = min(tp) ranks sends its 1/k slice to its peer and the receiving group all-gathers
        them (`sliced_p2p_s` with k slices). Without TP it is one whole message.
        """
        k = max(1, min(sender.tp, receiver.tp))
        return self.sliced_p2p_s(sender, receiver, message_bytes, k, same_node=same_node, share=share)

    def grad_buckets(self, tp: int, first: int, last: int, bytes_per_elem: int) -> tuple[tuple[int, int], ...]:
        """The runtime's gradient buckets of a stage, in launch order: (bytes, first layer of the bucket).

        Whole layers from the last one back, each bucket filled while it stays within
        `ALLREDUCE_BUCKET_BYTES` (a larger layer is a bucket of its own): data_parallel.buckets_of.
        """
        key = (tp, first, last, bytes_per_elem)
        hit = self._bucket_memo.get(key)
        if hit is None:
            s = self._size(tp)
            out: list[list[int]] = []
            for i in range(last, first - 1, -1):
                nbytes = (s.params[i + 1] - s.params[i]) * bytes_per_elem
                if nbytes <= 0:
                    continue
                if out and out[-1][0] + nbytes <= C.ALLREDUCE_BUCKET_BYTES:
                    out[-1][0] += nbytes
                    out[-1][1] = i
                else:
                    out.append([nbytes, i])
            hit = tuple((b, i) for b, i in out)
            self._bucket_memo[key] = hit
        return hit

    def allreduce_time_s(self, replicas: Sequence[Replica], nodes: Sequence[int],
                         grad_bytes_per_gpu: float | Sequence[float]) -> float:
        """Ring all-reduce of each GPU's gradient shard over the stage's data-parallel replicas.

        `grad_bytes_per_gpu`: the bytes, cut into buckets of `ALLREDUCE_BUCKET_BYTES`, or the
        buckets themselves (`grad_buckets`). Ring order follows the replicas sorted by (region, zone,
        node), so a ring crosses each zone boundary twice at most. Per bucket, 2(D-1) steps each move
        a chunk of bucket/D; every step waits for the slowest hop. The tp GPUs of a replica run tp
        rings at once (one per TP rank) that share their node's links.
        """
        d = len(replicas)
        buckets = bucket_counts(grad_bytes_per_gpu)
        if d <= 1 or not buckets:
            return 0.0
        # Node ids matter only through which neighbours share a node: key on their first appearance.
        first_seen: dict[int, int] = {}
        key = (
            buckets,
            tuple((r.region, r.zone, r.gpu_type, r.tp, r.gpus_per_node, first_seen.setdefault(n, len(first_seen)))
                  for r, n in zip(replicas, nodes, strict=True)),
        )
        hit = self._ar_memo.get(key)
        if hit is None:
            hit = self._allreduce(replicas, nodes, buckets)
            self._ar_memo[key] = hit
        return hit

    def ring_step_s(self, a: Replica, b: Replica, flows: int, chunk: float, *, same_node: bool) -> float:
        """Seconds of one ring step that moves `chunk` bytes from a to b, `flows` rings at once.

        Between two machines whose all-reduce over their link was measured (`sailor profile link`, one
        worker each: `flows` = 1), from that: a 2-worker all-reduce of 2c bytes is two ring steps of c, so
        a step is t(2c) / 2. It holds what the ping-pong fit leaves out: both directions at once, the
        collective's chunking, the reduction on the device. Elsewhere a transfer of `chunk` at the link's
        bandwidth (`flow_bandwidth_bytes_per_s`).
        """
        if not same_node and flows == 1:
            m = self.book.link_allreduce_fit(a.zone, a.gpu_type, b.zone, b.gpu_type)
            if m is not None:
                return m.fit.transfer_time_s(2 * chunk) / 2
        return chunk / self.flow_bandwidth_bytes_per_s(a, b, flows, chunk, same_node=same_node)

    def tied_weight_bytes(self) -> float:
        """Bytes of the fp32 gradient of a tied embedding/head weight (vocab x hidden); 0 when untied."""
        spec = self.book.model
        return spec.vocab_size * spec.hidden_size * C.FP32_GRAD_BYTES if spec.tied_head else 0.0

    def tied_sync_s(self, first: Replica, last: Replica, *, same_node: bool) -> float:
        """Seconds of one pipeline's tied embedding/head exchange in our runtime (tied_weights.TiedWeights.sync),
        0 for an untied model: after the data-parallel sync, the first stage's replica and the last
        one's add their fp32 gradients of the vocab x hidden weight. With one TP degree at both ends
        TP rank t meets TP rank t over its vocabulary slice: tp two-member rings at once
        (`allreduce_time_s` of the two replicas); else the two TP groups form one ring over the
        whole weight, each of its 2(k - 1) steps a chunk of 1/k across the nodes' link."""
        weight = self.tied_weight_bytes()
        if not weight:
            return 0.0
        if first.tp == last.tp:
            return self.allreduce_time_s([first, last], [0, 0 if same_node else 1], [weight / first.tp])
        k = first.tp + last.tp
        chunk = weight / k
        return 2 * (k - 1) * chunk / self.flow_bandwidth_bytes_per_s(first, last, 1, chunk, same_node=same_node)

    def node_allreduce_s(self, gpu_type: str, workers: int, tp: int,
                         grad_bytes_per_gpu: float | Sequence[float]) -> float | None:
        """A data-parallel group of `workers` replicas inside one node, from the node's measured
        all-reduce (bucket by bucket); None where the store has no such measurement. Measured with
        one GPU per worker, so it stands for tp = 1 replicas only (tp rings at once share the node)."""
        m = self.book.node_allreduce_fit(gpu_type, workers) if tp == 1 else None
        if m is None:
            return None
        return sum(n * m.fit.transfer_time_s(b) for b, n in bucket_counts(grad_bytes_per_gpu))

    def _allreduce(self, replicas: Sequence[Replica], nodes: Sequence[int],
                   buckets: tuple[tuple[float, int], ...]) -> float:
        d = len(replicas)
        if len(set(nodes)) == 1:  # one node: its measured all-reduce, where the store has one
            measured = self.node_allreduce_s(replicas[0].gpu_type, d, max(r.tp for r in replicas),
                                             [b for b, n in buckets for _ in range(n)])
            if measured is not None:
                return measured
        order = sorted(range(d), key=lambda i: (replicas[i].region, replicas[i].zone, nodes[i]))
        total = 0.0
        for bucket, count in buckets:
            chunk = bucket / d
            step = 0.0
            for k in range(d):
                a = replicas[order[k]]
                b = replicas[order[(k + 1) % d]]
                same = nodes[order[k]] == nodes[order[(k + 1) % d]]
                flows = max(1, min(a.tp, a.gpus_per_node, b.tp, b.gpus_per_node))
                step = max(step, self.ring_step_s(a, b, flows, chunk, same_node=same))
            total += count * 2 * (d - 1) * step
        return total


def allreduce_buckets(grad_bytes: float, bucket_bytes: float = C.ALLREDUCE_BUCKET_BYTES) -> list[float]:
    """The gradient bytes of one GPU cut into all-reduce buckets of `bucket_bytes`."""
    n_full, rest = divmod(grad_bytes, bucket_bytes)
    return [float(bucket_bytes)] * int(n_full) + ([rest] if rest > 0 else [])


def bucket_counts(grad: float | Sequence[float]) -> tuple[tuple[float, int], ...]:
    """Buckets as (bytes, how many), sorted: bytes are cut into `allreduce_buckets`, a sequence of
    bucket sizes is taken as is. Equal buckets cost the same, so each size is timed once."""
    if isinstance(grad, (int, float)):
        if grad <= 0:
            return ()
        n_full, rest = divmod(float(grad), C.ALLREDUCE_BUCKET_BYTES)
        out = [(float(C.ALLREDUCE_BUCKET_BYTES), int(n_full))] if n_full else []
        return tuple(out + ([(rest, 1)] if rest > 0 else []))
    counts: dict[float, int] = {}
    for b in grad:
        if b > 0:
            counts[float(b)] = counts.get(float(b), 0) + 1
    return tuple(sorted(counts.items()))


# One SimModel per ProfileBook object. Keyed by id with the book kept alive by the entry, so an id
# is never reused while cached; bounded so a long-running planner does not grow without limit.
_MODELS: dict[int, tuple[ProfileBook, SimModel]] = {}
_MAX_MODELS = 16


def model_for(book: ProfileBook) -> SimModel:
    """The shared, memoised SimModel of `book`."""
    hit = _MODELS.get(id(book))
    if hit is not None and hit[0] is book:
        return hit[1]
    if len(_MODELS) >= _MAX_MODELS:
        _MODELS.pop(next(iter(_MODELS)))
    sm = SimModel(book)
    _MODELS[id(book)] = (book, sm)
    return sm
