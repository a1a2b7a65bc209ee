"""Layer profiler: per-layer forward, backward and optimizer time and activation memory of a model.

Contract: `profile_model(settings, progress=None) -> ModelProfile` measures the model
`settings.model` (a built-in config of sailor_core.models, or `settings.model_config`) on the
device at hand, for every microbatch size in `settings.mbs` and TP degree in `settings.tp`, with
the runtime's own layers (sailor_core.models.torch_model.build_layer, Megatron-style TP layers over a
real process group):
- every TP degree runs in `tp` spawned worker processes on this node (one GPU each on CUDA; gloo on
  CPU, one thread each, as the runtime's workers run); rank 0's times are reported;
- per layer of the store's indexing (0 embedding, 1..L blocks, L+1 final norm + head, the head's
  forward including the loss): forward and backward seconds of one microbatch, timed where a step
  runs them (the measured layers' forwards in order, then their backwards in reverse, in runs of
  CHAIN_LAYERS), warm-up excluded, repeated until stable (timing.RepeatPolicy), the mean reported
  (DEFAULT_STATISTIC).
  CUDA: CUDA events, synchronised before reading; CPU: the thread's CPU time, read at the speed of
  the device the rank is bound to (a testbed device is a CPU share: sailor_core/runtime/devices.py);
  a TP layer's adds the median wall time a repetition spent waiting in its collectives (their own
  cost and the ranks' typical skew, without the rare peer held up by other jobs on the host);
- blocks are identical, so only `settings.blocks` of them are measured and their mean is copied to
  the others (`all_blocks=True` measures every one);
- optimizer: the parameter work that ends the runtime's step over the measured layers' parameters
  (engine.Trainer.train_step: the gradient norm's pass, `data_parallel.grad_sq_norm`, the clipping
  pass that scales every gradient, and one AdamW step with the runtime's settings), scaled to the
  whole model's parameters on one GPU of the TP group; the same value on every layer, as the store's
  profiles hold it (README section 2a) and the simulator reads it. The clip is timed on every step:
  the runtime scales whenever the norm passes `max_grad_norm`, which early training does nearly always;
- activation memory kept for backward per layer and sequence: the unique storages torch saves for
  backward (torch.autograd.graph.saved_tensors_hooks), parameters excluded; on CUDA also the
  allocator delta across the forward;
- the framework's fixed memory on this device: on CUDA the device memory in use that the caching
  allocator does not account for (context, kernels, library workspaces) after a warm-up; on CPU the
  resident memory of a worker process with torch loaded and warmed up, before any model tensor.
Out-of-memory at a grid point records that (mbs, tp) as infeasible and goes on. An unknown model,
an unusable device or a TP degree larger than the node raise `SailorError` before any measurement.
Nothing is written anywhere: callers store the result (sailor_core.profiler.save), after the whole
profile succeeded, so an interrupted profile leaves the store as it was.
"""

from __future__ import annotations

import functools
import math
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any

from sailor_core.catalog import GPU_TYPES
from sailor_core.domain import LayerProfile, ModelSpec, Provenance
from sailor_core.errors import ProfilingWorkerError, SailorError
from sailor_core.models.config import TransformerConfig, get_config, model_spec
from sailor_core.profiler.env import check_device, default_gpu_type, provenance
from sailor_core.profiler.spawn import is_out_of_memory, run_workers
from sailor_core.profiler.timing import Measurement, RepeatPolicy, StopRule, check_statistic
from sailor_core.runtime.devices import device_count, device_cpu_clock

if TYPE_CHECKING:  # torch is imported in the workers only
    from torch import Tensor, nn
    from torch import device as TorchDevice

    from sailor_core.models.tensor_parallel import TPContext

_Timed = Callable[..., tuple[float, Any]]  # timed(fn) -> (seconds, fn's result)
_Agree = Callable[[bool], bool]  # agree(stop) -> rank 0's decision, on every TP rank

DEFAULT_POLICY = RepeatPolicy(warmup=2, min_reps=5, max_reps=50, rel_err=0.02, time_cap_s=1.0)
# A layer's time is the mean of its repetitions: a training step runs every layer once per
# microbatch, so its expected time is the sum of the layers' means, their long tails included.
# Where that matters: a TP layer on CPU waits inside gloo all-reduces whose wake-ups have a long
# tail (on the 2-core dev box the TP-2 layers' 10th percentiles summed to 10 ms per microbatch of 2,
# their medians to 19 ms, their means to 23 ms, and the runtime's TP-2 step matched the means). Other
# jobs on the host do not inflate layers without collectives: those are timed in thread CPU time.
DEFAULT_STATISTIC = "mean"
DEFAULT_BLOCKS = 2  # blocks measured when identical blocks are collapsed
# Layers timed together, one after the other as a step runs them (`_measure_chain`): the default
# profile's four measured layers (embedding, two blocks, head) in one run; with every block measured,
# runs of four, so a large model's profile holds one microbatch's activations of four layers, not all.
CHAIN_LAYERS = 4
# The runtime's AdamW (sailor_core.runtime.engine; the artifact's ds_config.json): the step's cost
# does not depend on the values, only on the parameter count, but use the real ones anyway.
ADAMW = dict(lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=4e-5)


@dataclass(frozen=True, kw_only=True)
class ModelProfileSettings:
    model: str
    device: str = "cpu"
    mbs: tuple[int, ...] = (1, 2, 4)
    tp: tuple[int, ...] = (1,)
    gpu_type: str | None = None  # None: derived from the device (env.default_gpu_type)
    blocks: int = DEFAULT_BLOCKS
    all_blocks: bool = False
    policy: RepeatPolicy = field(default_factory=lambda: DEFAULT_POLICY)
    seed: int = 0
    statistic: str = DEFAULT_STATISTIC  # of the repetitions, reported: mean, median or pNN
    precision: str = "fp32"  # or "bf16": forward under bf16 autocast, as the runtime runs bf16 plans
    timeout_s: float = 3600.0
    # CPU only: memory a worker may allocate beyond what it holds after start-up (None: no limit).
    # Makes a CPU worker slot run out of memory like a GPU of that size would, instead of swapping
    # or meeting the kernel's out-of-memory killer.
    memory_limit_bytes: int | None = None
    # A model not among the built-ins (e.g. read from a config.json): travels to the spawned workers
    model_config: TransformerConfig | None = None

    def config(self) -> TransformerConfig:
        return self.model_config if self.model_config is not None else get_config(self.model)

    def node_size(self) -> int:
        """GPUs of this node a TP group may use."""
        if self.device == "cuda":
            import torch

            return torch.cuda.device_count()
        # A testbed VM's devices are CPU shares (sailor_core/runtime/devices.py): rank r binds to share r.
        shares = device_count()
        if shares:
            return shares
        # The local provider's worker slots of GPU type `cpu` (catalog): TP stays inside them.
        return GPU_TYPES["cpu"].gpus_per_node

    def validate(self) -> TransformerConfig:
        cfg = self.config()  # unknown model -> SailorError naming the known ones
        check_device(self.device)
        if not self.mbs or any(m < 1 for m in self.mbs):
            raise SailorError(f"microbatch sizes must be >= 1, got {list(self.mbs)}; to fix: e.g. --mbs 1,2,4")
        if not self.tp or any(t < 1 for t in self.tp):
            raise SailorError(f"TP degrees must be >= 1, got {list(self.tp)}; to fix: e.g. --tp 1,2")
        node = self.node_size()
        too_big = [t for t in self.tp if t > node]
        if too_big:
            raise SailorError(
                f"TP degree {max(too_big)} is larger than this node ({node} "
                f"{'GPUs' if self.device == 'cuda' else 'cpu worker slots'}); TP stays inside one node; "
                f"to fix: use --tp values up to {node}"
            )
        for t in self.tp:
            cfg.check_tp(t)  # heads, FFN and vocabulary must split evenly
        if self.blocks < 1:
            raise SailorError(f"blocks to measure must be >= 1, got {self.blocks}")
        check_statistic(self.statistic)
        if self.precision not in ("fp32", "bf16"):
            raise SailorError(f"precision must be fp32 or bf16, got {self.precision!r}; to fix: --precision fp32")
        return cfg

    def measured_layers(self, cfg: TransformerConfig) -> list[int]:
        nb = cfg.num_blocks if self.all_blocks else min(self.blocks, cfg.num_blocks)
        return [0, *range(1, nb + 1), cfg.num_layers - 1]


@dataclass(frozen=True, kw_only=True)
class LayerPoint:
    """One measured layer at one (mbs, tp)."""

    mbs: int
    tp: int
    layer: int
    forward: Measurement
    backward: Measurement
    saved_bytes: int  # unique storages kept for backward, parameters excluded, for the microbatch
    allocated_bytes: int | None  # CUDA allocator delta across the forward (None on CPU)
    statistic: str = DEFAULT_STATISTIC

    @property
    def forward_s(self) -> float:
        return self.forward.stat_s(self.statistic)

    @property
    def backward_s(self) -> float:
        return self.backward.stat_s(self.statistic)


@dataclass(frozen=True, kw_only=True)
class Infeasible:
    mbs: int
    tp: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    model: str
    gpu_type: str
    device: str
    spec: ModelSpec  # analytic sizes (sailor_core.models.config.model_spec) for the profiled TP degrees
    profiles: tuple[LayerProfile, ...]  # every layer, measured or copied from a measured block
    points: tuple[LayerPoint, ...]  # what was measured
    optimizer_s: dict[int, float]  # per TP degree, whole model on one GPU of the group
    infeasible: tuple[Infeasible, ...]
    framework_overhead_bytes: int
    provenance: Provenance


# ----------------------------------------------------------------------------------------------
# Worker side


def _limit_address_space(extra_bytes: int) -> None:
    """Let this process map at most `extra_bytes` more (RLIMIT_AS): allocations beyond it fail with
    torch's out-of-memory error instead of swapping."""
    with open("/proc/self/statm") as f:
        virtual = int(f.read().split()[0]) * resource.getpagesize()
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = virtual + int(extra_bytes)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux: the peak is the best there is
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def layer_worker(
    rank: int, world_size: int, init_method: str, emit: Callable[[Any], None], settings: ModelProfileSettings
) -> None:
    """Measure every layer at every mbs for one TP degree (= world_size); messages go through `emit`."""
    import torch
    import torch.distributed as dist

    from sailor_core.models.tensor_parallel import TPContext

    cuda = settings.device == "cuda"
    tp = world_size
    dev = _init_rank(torch, dist, rank, tp, init_method, settings)
    try:
        ctx = TPContext(dist.group.WORLD, rank, tp) if tp > 1 else TPContext.single()
        overhead = _warm_up_and_overhead(torch, dev, cuda)
        if settings.memory_limit_bytes is not None and not cuda:
            _limit_address_space(settings.memory_limit_bytes)
        if rank == 0:
            emit({"kind": "overhead", "tp": tp, "bytes": overhead})
        cpu_timed, layer_timed = _timers(torch, cuda, tp)
        agree = _agreement(torch, dist, dev, tp)
        rig = _LayerRig(torch, settings, ctx, dev, rank, tp)
        rig.waits = _CollectiveWaits.install() if tp > 1 and not cuda else None
        for mbs in sorted(settings.mbs):
            _measure_mbs(torch, dist, rig, mbs, emit, layer_timed, agree)
        params = [p for ly in rig.layers.values() for p in ly.parameters()]
        opt_s = _optimizer_step_s(torch, params, settings.policy, cpu_timed).stat_s(settings.statistic)
        if rank == 0:
            emit({"kind": "optimizer", "tp": tp, "seconds": opt_s,
                  "params": sum(p.numel() for ly in rig.layers.values() for p in ly.parameters())})
        return None
    finally:
        if tp > 1:
            dist.destroy_process_group()


def _init_rank(
    torch: ModuleType, dist: ModuleType, rank: int, tp: int, init_method: str, settings: ModelProfileSettings
) -> TorchDevice:
    """This rank's device (CUDA: GPU `rank`, made current), its process group joined when tp > 1."""
    cuda = settings.device == "cuda"
    dev: TorchDevice = torch.device("cuda", rank) if cuda else torch.device("cpu")  # bind_device made it current
    if tp > 1:
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=tp,
            timeout=timedelta(seconds=settings.timeout_s),
        )
    return dev


def _timers(torch: ModuleType, cuda: bool, tp: int) -> tuple[_Timed, _Timed]:
    """(timer of work without collectives, timer of a layer): each runs fn() and returns (seconds, its result)."""

    def timed(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter) -> tuple[float, Any]:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, out
        t0 = clock()
        out = fn()
        return clock() - t0, out

    # CPU work runs in this thread (one intra-op thread), so its thread CPU time is its cost whatever
    # else the host runs; wall time would add the other jobs' time slices. Read at the bound device's
    # speed: on the testbed a device is a share of a core, and a layer must cost what it costs that
    # device. A TP layer's rank waits off-CPU inside its all-reduces (gloo's threads move the data):
    # its CPU clock is the layer's compute, and _measure_chain adds the collectives' own time
    # (_CollectiveWaits). Wall time over a TP layer would count every wake-up and time slice lost to
    # the other jobs on the host twice per collective, at both ranks. See docs/profiler.md.
    cpu_timed = functools.partial(timed, clock=device_cpu_clock())
    layer_timed = timed if cuda else cpu_timed
    return cpu_timed, layer_timed


class _CollectiveWaits:
    """Wall seconds this rank spends waiting in TP collectives (models/tensor_parallel.set_wait), for a
    CPU TP layer: `take()` returns those since the last call. Of a layer's repetitions the least is its
    collectives' own cost (both ranks arrived at once); the rest is a peer held up by the host's load."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._taken_s = 0.0

    @staticmethod
    def install() -> _CollectiveWaits:

        from sailor_core.models.tensor_parallel import set_wait

        waits = _CollectiveWaits()

        def wait(work: Any) -> None:
            t0 = time.perf_counter()
            work.wait()
            waits.total_s += time.perf_counter() - t0

        set_wait(wait)
        return waits

    def take(self) -> float:
        out, self._taken_s = self.total_s - self._taken_s, self.total_s
        return out


def _agreement(torch: ModuleType, dist: ModuleType, dev: TorchDevice, tp: int) -> _Agree:
    """agree(stop): rank 0's stop decision, broadcast so every TP rank repeats a layer as often."""
    flag = torch.zeros(1, dtype=torch.int32, device=dev)

    def agree(stop: bool) -> bool:
        if tp == 1:
            return stop
        flag.fill_(int(stop))
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    return agree


class _LayerRig:
    """One TP rank's measured layers on its device, their deterministic inputs and their forward."""

    def __init__(
        self, torch: ModuleType, settings: ModelProfileSettings, ctx: TPContext, dev: TorchDevice, rank: int, tp: int
    ) -> None:
        from sailor_core.models.torch_model import build_layer

        self.torch, self.settings, self.ctx, self.dev, self.rank, self.tp = torch, settings, ctx, dev, rank, tp
        self.cuda = settings.device == "cuda"
        self.cfg = cfg = settings.config()
        self.layers: dict[int, nn.Module] = {
            i: build_layer(cfg, i, ctx, settings.seed).to(dev) for i in settings.measured_layers(cfg)
        }
        self.head = cfg.num_layers - 1
        self.waits: _CollectiveWaits | None = None  # CPU TP ranks: time in collectives, added to the compute

    def inputs(self, i: int, mbs: int) -> tuple[Tensor, Tensor | None]:
        """(input, targets or None) of layer i for a microbatch of mbs: the same on every TP rank."""
        torch, cfg, dev = self.torch, self.cfg, self.dev
        s, h = cfg.sequence_length, cfg.hidden_size
        g = torch.Generator(device="cpu").manual_seed(1000 * mbs + i)  # identical on every TP rank
        if i == 0:
            return torch.randint(0, cfg.vocab_size, (mbs, s), generator=g).to(dev), None
        x = torch.randn(mbs, s, h, generator=g).to(dev).requires_grad_(True)
        tgt = torch.randint(0, cfg.vocab_size, (mbs, s), generator=g).to(dev) if i == self.head else None
        return x, tgt

    def forward(self, i: int, x: Tensor, tgt: Tensor | None) -> Tensor:
        """Layer i's forward in the profile's precision; the head's includes the loss."""
        from sailor_core.models.torch_model import loss_sum

        out: Tensor
        if self.settings.precision == "bf16":
            with self.torch.autocast(self.dev.type, dtype=self.torch.bfloat16):
                out = self.layers[i](x)
        else:
            out = self.layers[i](x)
        if i != self.head:
            return out
        if tgt is None:
            raise SailorError(f"layer {i} is the head: its forward needs the targets (inputs() gives them)")
        return loss_sum(out, tgt, self.ctx)

    def measure_point(self, mbs: int, emit: Callable[[Any], None], layer_timed: _Timed, agree: _Agree
                      ) -> list[LayerPoint]:
        """Every measured layer at microbatch size mbs, timed in runs of up to CHAIN_LAYERS consecutive
        layers as a step runs them (`_measure_chain`); rank 0 reports progress per layer."""
        out = []
        ids = list(self.layers)
        for run in [ids[k:k + CHAIN_LAYERS] for k in range(0, len(ids), CHAIN_LAYERS)]:
            inputs = {i: self.inputs(i, mbs) for i in run}
            forwards = [functools.partial(self.forward, i, *inputs[i]) for i in run]
            saved = [_saved_for_backward(self.torch, self.layers[i], f, self.cuda) for i, f in zip(run, forwards,
                                                                                                 strict=True)]
            timed = _measure_chain(self.torch, forwards, [inputs[i][0] for i in run], self.settings.policy,
                                   layer_timed, agree, self.waits)
            for i, (fwd, bwd), (kept, allocated) in zip(run, timed, saved, strict=True):
                out.append(LayerPoint(mbs=mbs, tp=self.tp, layer=i, forward=fwd, backward=bwd, saved_bytes=kept,
                                      allocated_bytes=allocated, statistic=self.settings.statistic))
                if self.rank == 0:  # progress only; the point's results are sent once all its layers ran
                    emit({"kind": "layer", "mbs": mbs, "tp": self.tp, "layer": i})
        return out


def _measure_mbs(torch: ModuleType, dist: ModuleType, rig: _LayerRig, mbs: int, emit: Callable[[Any], None],
                 layer_timed: _Timed, agree: _Agree) -> None:
    """Measures one microbatch size; rank 0 emits its points, or the size as infeasible when any rank ran out
    of memory (every rank skips it together)."""
    status = torch.zeros(1, dtype=torch.int32, device=rig.dev)
    reason = ""
    results: list[LayerPoint] = []
    try:
        results = rig.measure_point(mbs, emit, layer_timed, agree)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        status.fill_(1)
        reason = f"out of memory at mbs={mbs}: {str(e).splitlines()[0][:200]}"
        if rig.cuda:
            torch.cuda.empty_cache()
    if rig.tp > 1:
        # Every rank learns whether any rank ran out of memory, so all skip the point together.
        dist.all_reduce(status, op=dist.ReduceOp.MAX)
    if rig.rank == 0:
        if int(status.item()):
            emit(
                {"kind": "infeasible", "mbs": mbs, "tp": rig.tp, "reason": reason or "out of memory on another TP rank"}
            )
        else:
            for p in results:
                emit({"kind": "point", "point": p})


def _measure_chain(torch: ModuleType, forwards: Sequence[Callable[[], Tensor]], inputs: Sequence[Tensor],
                   policy: RepeatPolicy, timed: _Timed, agree: _Agree, waits: _CollectiveWaits | None = None
                   ) -> list[tuple[Measurement, Measurement]]:
    """(forward, backward) of one microbatch for each of a run of consecutive layers, timed where a step
    runs them: every repetition runs the forwards in layer order, then the backwards in reverse, each
    layer timed on its own, until every time is stable.

    A layer repeated alone finds its weights and activations where its last repetition left them; in
    a step the layer before it has just used the caches, and on a CPU share the quota's off-periods
    let other tenants in between. On the testbed's CPU devices (gpt-tiny, microbatch 4, three rounds
    each) the forwards of the layers run alone summed to 22-23 ms (0.4-core device) and 48-50 ms
    (0.2-core device), run one after the other 24-29 and 62-64 ms (backwards: 42-43 against 43-46,
    89-92 against 99-101 ms); on a core without a quota the two agree within 4 %.
    `agree(stop)` returns rank 0's decision on every rank: TP layers run collectives, so every rank
    of the group must run the same number of repetitions. With `waits` (a CPU TP rank, timed by its
    CPU clock) each repetition's compute gets the median time a repetition spent in its collectives.
    """
    n = len(forwards)
    f_rules, b_rules = [StopRule(policy) for _ in range(n)], [StopRule(policy) for _ in range(n)]
    f_waits: list[list[float]] = [[] for _ in range(n)]
    b_waits: list[list[float]] = [[] for _ in range(n)]
    grad_outs: list[Tensor | None] = [None] * n
    while True:
        outs = []
        for k in range(n):
            if inputs[k].requires_grad:
                inputs[k].grad = None  # the input's gradient would otherwise accumulate across repetitions
            if waits is not None:
                waits.take()
            t_f, out = timed(forwards[k])
            f_waits[k].append(waits.take() if waits is not None else 0.0)
            f_rules[k].add(t_f)
            if grad_outs[k] is None and out.dim() > 0:
                grad_outs[k] = torch.ones_like(out)
            outs.append(out)
        for k in reversed(range(n)):
            t_b, _ = timed(functools.partial(outs[k].backward, grad_outs[k]))
            b_waits[k].append(waits.take() if waits is not None else 0.0)
            b_rules[k].add(t_b)
            outs[k] = None  # parameter gradients do accumulate, as over a pipeline's microbatches
        if agree(all(not f.warming() and f.done() and b.done() for f, b in zip(f_rules, b_rules, strict=True))):
            return [(_plus(f.result(), statistics.median(fw), policy), _plus(b.result(), statistics.median(bw), policy))
                    for f, b, fw, bw in zip(f_rules, b_rules, f_waits, b_waits, strict=True)]


def _plus(m: Measurement, seconds: float, policy: RepeatPolicy) -> Measurement:
    """`m` with `seconds` added to every repetition (a CPU TP layer's collectives, on top of its compute)."""
    if not seconds:
        return m
    return replace(Measurement.of([t + seconds for t in m.samples], policy.rel_err), stable=m.stable)


def _warm_up_and_overhead(torch: ModuleType, dev: TorchDevice, cuda: bool) -> int:
    """Load the kernels and libraries a training step uses, then measure what they hold."""
    a = torch.randn(64, 64, device=dev, requires_grad=True)
    (a @ a).sum().backward()
    torch.nn.functional.scaled_dot_product_attention(
        a.view(1, 1, 64, 64), a.view(1, 1, 64, 64), a.view(1, 1, 64, 64), is_causal=True
    ).sum().backward()
    del a
    if cuda:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return int(total - free - torch.cuda.memory_reserved())
    return _rss_bytes()


def _saved_for_backward(torch: ModuleType, layer: nn.Module, run_forward: Callable[[], Any], cuda: bool
                        ) -> tuple[int, int | None]:
    """Bytes of the unique non-parameter storages autograd keeps for this layer's backward."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in param_ptrs:
            storages[ptr] = st.nbytes()
        return t

    before = torch.cuda.memory_allocated() if cuda else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_forward()
    allocated = int(torch.cuda.memory_allocated() - before) if cuda else None
    del out  # frees the graph and what it saved
    return int(sum(storages.values())), allocated


def _optimizer_step_s(torch: ModuleType, params: list[nn.Parameter], policy: RepeatPolicy, timed: _Timed
                      ) -> Measurement:
    """The runtime's step end over `params` (see the module): gradient norm, clip, AdamW step."""
    from sailor_core.runtime.data_parallel import grad_sq_norm

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": ADAMW["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"],
    )
    device = params[0].device if params else torch.device("cpu")

    def step_end() -> None:
        float(grad_sq_norm(params, pipeline=0, tp_rank=0, device=device))  # read back, as the runtime's .tolist()
        for p in params:  # the clip's pass; its factor does not change its time
            p.grad.mul_(1.0)  # type: ignore[union-attr]
        opt.step()

    rule = StopRule(policy)
    while True:
        t, _ = timed(step_end)
        rule.add(t)
        if not rule.warming() and rule.done():
            return rule.result()


# ----------------------------------------------------------------------------------------------
# Parent side


def profile_model(
    settings: ModelProfileSettings, progress: Callable[[dict[str, Any]], None] | None = None
) -> ModelProfile:
    """Measure the grid; returns every layer's profile (blocks copied where collapsed). Writes nothing."""
    cfg = settings.validate()
    gpu_type = settings.gpu_type or default_gpu_type(settings.device)
    points: list[LayerPoint] = []
    infeasible: list[Infeasible] = []
    optimizer: dict[int, tuple[float, int]] = {}
    overheads: list[int] = []

    for tp in sorted(set(settings.tp)):
        def on_message(msg: dict[str, Any], tp: int = tp) -> None:
            kind = msg["kind"]
            if kind == "point":
                points.append(msg["point"])
            elif kind == "infeasible":
                infeasible.append(Infeasible(mbs=msg["mbs"], tp=tp, reason=msg["reason"]))
            elif kind == "optimizer":
                optimizer[tp] = (msg["seconds"], msg["params"])
            elif kind == "overhead":
                overheads.append(int(msg["bytes"]))
            if progress is not None:
                progress(msg)

        try:
            run_workers(layer_worker, tp, (settings,), device=settings.device, on_message=on_message,
                        timeout_s=settings.timeout_s)
        except ProfilingWorkerError as e:
            # A TP group that dies (an out-of-memory kill mid-collective) loses only its own points:
            # the ones it did not finish are infeasible, the others stay, and the grid goes on.
            if not e.out_of_memory:
                raise
            done = {p.mbs for p in points if p.tp == tp} | {x.mbs for x in infeasible if x.tp == tp}
            for mbs in sorted(set(settings.mbs) - done):
                infeasible.append(Infeasible(mbs=mbs, tp=tp, reason=str(e)))
                if progress is not None:
                    progress({"kind": "infeasible", "mbs": mbs, "tp": tp, "reason": str(e)})

    profiled_tps = sorted({p.tp for p in points})
    spec = model_spec(cfg, tuple(sorted(set(settings.tp) | {1})))
    profiles, opt_by_tp = _complete(cfg, spec, gpu_type, points, optimizer)
    if not profiles:
        raise SailorError(
            f"no grid point of {settings.model} could be measured on {settings.device} "
            f"({'; '.join(x.reason for x in infeasible)[:300]}); to fix: use smaller --mbs or larger --tp"
        )
    prov = provenance(
        "sailor-profiler-layers",
        settings.device,
        {
            "model": settings.model,
            "gpu_type": gpu_type,
            "mbs": sorted(settings.mbs),
            "tp": sorted(settings.tp),
            "profiled_tp": profiled_tps,
            "measured_layers": settings.measured_layers(cfg),
            "all_blocks": settings.all_blocks,
            "precision": settings.precision,
            "policy": asdict(settings.policy),
            "statistic": settings.statistic,
            "infeasible": [asdict(x) for x in infeasible],
        },
    )
    return ModelProfile(
        model=cfg.name,
        gpu_type=gpu_type,
        device=settings.device,
        spec=spec,
        profiles=tuple(profiles),
        points=tuple(sorted(points, key=lambda p: (p.tp, p.mbs, p.layer))),
        optimizer_s=opt_by_tp,
        infeasible=tuple(sorted(infeasible, key=lambda x: (x.tp, x.mbs))),
        framework_overhead_bytes=min(overheads) if overheads else 0,
        provenance=prov,
    )


def _complete(
    cfg: TransformerConfig,
    spec: ModelSpec,
    gpu_type: str,
    points: list[LayerPoint],
    optimizer: dict[int, tuple[float, int]],
) -> tuple[list[LayerProfile], dict[int, float]]:
    """Every layer of every measured (mbs, tp): measured layers as is, other blocks the measured blocks' mean."""
    by_point: dict[tuple[int, int], dict[int, LayerPoint]] = {}
    for p in points:
        by_point.setdefault((p.mbs, p.tp), {})[p.layer] = p
    opt_full: dict[int, float] = {}
    for tp, (seconds, measured_params) in optimizer.items():
        full = sum(spec.layer(i, tp).params for i in range(cfg.num_layers))
        # The norm, the clip and AdamW are passes over gradients, parameters and two moments: linear in
        # the parameter count.
        opt_full[tp] = seconds * full / measured_params if measured_params else seconds
    out: list[LayerProfile] = []
    head = cfg.num_layers - 1
    for (mbs, tp), layers in sorted(by_point.items()):
        blocks = [layers[i] for i in range(1, head) if i in layers]
        if 0 not in layers or head not in layers or not blocks or tp not in opt_full:
            continue  # an incomplete point (its group died mid-way) is not a profile
        mean_f = statistics.fmean(b.forward_s for b in blocks)
        mean_b = statistics.fmean(b.backward_s for b in blocks)
        for i in range(cfg.num_layers):
            measured = layers.get(i)
            f, b = (measured.forward_s, measured.backward_s) if measured else (mean_f, mean_b)
            if not (math.isfinite(f) and math.isfinite(b)):
                raise SailorError(f"layer {i} at mbs={mbs} tp={tp} timed as {f}, {b}; the measurement failed")
            out.append(
                LayerProfile(
                    model=cfg.name, gpu_type=gpu_type, mbs=mbs, tp=tp, layer=i,
                    forward_s=f, backward_s=b, optimizer_s=opt_full[tp],
                )
            )
    return out, opt_full
