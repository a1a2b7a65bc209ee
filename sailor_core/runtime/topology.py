"""Rank layout of a ParallelPlan and the checks that reject plans the runtime cannot run.

Contract (torch-free, so a launcher can reject a plan before any process starts):
- Global ranks are numbered stage-major: stage 0 replica 0 TP ranks 0..tp-1, stage 0 replica 1, ...,
  then stage 1. `layout(plan)` returns one `RankInfo` per rank.
- `runtime_problems(plan, cfg, slots=...)` lists why a plan cannot run: unknown GPU type, a
  device the machine lacks, more ranks than worker slots, layers that do not tile the model, TP
  degrees that do not divide heads/FFN/vocabulary, a microbatch plan that does not add up.
  `check_runnable` raises one `SailorError` with all of them.
- Pipeline j is replica j of every stage; its samples in the global batch are the contiguous range
  starting at `sample_offset(plan, j)`, so the global batch is the same for every plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from sailor_core.catalog import GPU_TYPES, is_cpu_type
from sailor_core.domain import ParallelPlan
from sailor_core.errors import SailorError
from sailor_core.models.config import TransformerConfig


@dataclass(frozen=True)
class RankInfo:
    rank: int
    stage: int
    pipeline: int  # = replica index within the stage
    tp_rank: int
    tp: int
    gpu_type: str
    zone: str


def layout(plan: ParallelPlan) -> list[RankInfo]:
    out: list[RankInfo] = []
    for s, st in enumerate(plan.stages):
        for j, rep in enumerate(st.replicas):
            for t in range(rep.tp):
                out.append(RankInfo(len(out), s, j, t, rep.tp, rep.gpu_type, rep.zone))
    return out


def ranks_of(plan: ParallelPlan, stage: int, pipeline: int) -> list[int]:
    """Global ranks of the TP group of replica `pipeline` of `stage`, in TP-rank order."""
    return [r.rank for r in layout(plan) if r.stage == stage and r.pipeline == pipeline]


def tie_groups(plan: ParallelPlan) -> list[tuple[list[int], bool]]:
    """The groups that add a tied embedding's and head's gradients when they sit on different stages:
    per pipeline, (TP rank t of its first stage, TP rank t of its last), a vocabulary slice each
    (sliced = True), where the two stages' TP degrees agree; else (both TP groups, False), which meet
    in the full layout. Empty for a one-stage plan."""
    last = plan.num_stages - 1
    if last == 0:
        return []
    out: list[tuple[list[int], bool]] = []
    for j in range(len(plan.pipelines)):
        a, b = ranks_of(plan, 0, j), ranks_of(plan, last, j)
        if len(a) == len(b):
            out += [([x, y], True) for x, y in zip(a, b, strict=True)]
        else:
            out.append((a + b, False))
    return out


def sample_offset(plan: ParallelPlan, pipeline: int) -> int:
    return sum(p.samples for p in plan.pipelines[:pipeline])


def runtime_problems(plan: ParallelPlan, cfg: TransformerConfig, *, slots: int | None = None,
                     cuda_devices: int = 0) -> list[str]:
    problems = list(plan.violations(cfg.num_layers))
    gpu_types = {r.gpu_type for st in plan.stages for r in st.replicas}
    for g in sorted(gpu_types):
        if g not in GPU_TYPES and not is_cpu_type(g):
            problems.append(f"unknown GPU type {g!r} (known: {', '.join(GPU_TYPES)}, or cpu-<name> for CPU devices)")
        elif not is_cpu_type(g) and cuda_devices == 0:
            problems.append(f"GPU type {g!r} needs CUDA but this machine has none; plans for this machine use 'cpu'")
    cpu = {g for g in gpu_types if is_cpu_type(g)}
    if cpu and len(cpu) < len(gpu_types):
        problems.append(f"a plan cannot mix CPU workers with GPUs ({sorted(gpu_types)})")
    for s, st in enumerate(plan.stages):
        for j, r in enumerate(st.replicas):
            try:
                cfg.check_tp(r.tp)
            except SailorError as e:
                problems.append(f"stage {s} replica {j}: {e}")
    n = sum(r.tp for st in plan.stages for r in st.replicas)
    if slots is not None and n > slots:
        problems.append(f"the plan needs {n} worker processes but only {slots} slots are available")
    if plan.model and plan.model.lower() != cfg.name.lower():
        problems.append(f"the plan is for model {plan.model!r} but the run trains {cfg.name!r}")
    return problems


def check_runnable(plan: ParallelPlan, cfg: TransformerConfig, *, slots: int | None = None,
                   cuda_devices: int = 0) -> None:
    problems = runtime_problems(plan, cfg, slots=slots, cuda_devices=cuda_devices)
    if problems:
        raise SailorError("the runtime cannot run this plan: " + "; ".join(problems))
