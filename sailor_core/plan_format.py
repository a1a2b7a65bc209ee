"""Plan files: our versioned JSON format, and an importer for the Sailor artifact's `plan_config_*.json`.

Contract: pure functions between JSON-compatible dicts and `ParallelPlan`. `load_plan_file` reads
a file and picks the parser by `fmt` ("sailor" | "eth-easl" | "auto"). Every violation of a plan
is listed in one `PlanFormatError`. The format is documented in docs/formats.md.

Sailor plan format, version 1:

    {"format": "sailor-plan", "version": 1, "model": "OPT-350", "global_batch_size": 1024,
     "schedule": "1f1b", "precision": "fp32", "zero1": false,
     "stages": [{"layers": [0, 12],              # first and last layer, inclusive
                 "replicas": [{"gpu_type": "A100-40", "gpus_per_node": 4, "zone": "us-central1-a",
                               "region": "us-central1", "market": "on-demand", "tp": 1}, ...]}, ...],
     "pipelines": [{"microbatch_size": 2, "num_microbatches": 16}, ...]}   # one per replica index
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from sailor_core.domain import (
    Market,
    ParallelPlan,
    PipelineBatch,
    Replica,
    Stage,
)
from sailor_core.errors import PlanFormatError as PlanFormatError  # re-exported: tests import it from here
from sailor_core.errors import ValidationError
from sailor_core.files import MAX_NAME_CHARS, parse_json, read_text, shown, shown_path, write_atomic

FORMAT_NAME = "sailor-plan"
FORMAT_VERSION = 1


def plan_to_dict(plan: ParallelPlan) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "model": plan.model,
        "global_batch_size": plan.global_batch_size,
        "schedule": plan.schedule,
        "precision": plan.precision,
        "zero1": plan.zero1,
        "stages": [
            {
                "layers": [st.first_layer, st.last_layer],
                **({"recompute": True} if st.recompute else {}),
                "replicas": [
                    {
                        "gpu_type": r.gpu_type,
                        "gpus_per_node": r.gpus_per_node,
                        "zone": r.zone,
                        "region": r.region,
                        "market": r.market.value,
                        "tp": r.tp,
                    }
                    for r in st.replicas
                ],
            }
            for st in plan.stages
        ],
        "pipelines": [
            {"microbatch_size": p.microbatch_size, "num_microbatches": p.num_microbatches} for p in plan.pipelines
        ],
    }


def plan_from_dict(d: dict[str, Any], *, model: str | None = None) -> ParallelPlan:
    if d.get("format") not in (None, FORMAT_NAME):
        raise PlanFormatError(
            f"not a sailor plan (format={shown(d.get('format'))}); for published plans use --format eth-easl"
        )
    version = d.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise PlanFormatError(
            f"plan format version {shown(version)} is not supported (this sailor reads version {FORMAT_VERSION}); "
            f"to fix: re-create the plan with this version's `sailor plan`"
        )
    named = d.get("model")
    if model and named and str(named) != model:
        raise PlanFormatError(f"the plan file is a plan for {shown(named)}, but --model says {model}; to fix: drop "
                              f"--model (the plan's model is used) or make a plan for {model} with `sailor plan`")
    try:
        stages, pipelines = _stages(d["stages"]), _pipelines(d["pipelines"])
        if len(stages) * len(pipelines) > MAX_REPLICAS:
            raise PlanFormatError(f"the plan has {len(stages)} stages x {len(pipelines)} pipelines, more than the "
                                  f"{MAX_REPLICAS:,} replicas a plan may have; to fix: check the file (limits: "
                                  f"docs/formats.md)")
        plan = ParallelPlan(
            model=model or _text(d["model"], "model", 256),
            global_batch_size=_whole(d["global_batch_size"], "global_batch_size", 1, MAX_GLOBAL_BATCH_SIZE),
            stages=stages,
            pipelines=pipelines,
            schedule=_text(d.get("schedule", "1f1b"), "schedule", 16),
            precision=_text(d.get("precision", "fp32"), "precision", 16),
            zero1=bool(d.get("zero1", False)),
        )
    except (KeyError, IndexError, TypeError) as e:
        raise PlanFormatError(
            f"plan is missing or mistypes field {shown(e)}; see docs/formats.md for the plan format"
        ) from None
    except ValidationError as e:  # the plan types' own message: every problem and the fix
        raise PlanFormatError(str(e)) from None
    except ValueError as e:
        raise PlanFormatError(f"invalid plan: {shown(str(e), 300)}") from None
    return plan


# Limits of a plan file (docs/formats.md, "Limits"): far beyond any plan of a real pool, so that a hostile
# file is refused in bounded time (the simulator and runtime work per stage and replica).
MAX_PLAN_BYTES = 8 << 20
MAX_STAGES = 1024
MAX_PIPELINES = 16384
MAX_REPLICAS = 131072  # stages x pipelines
MAX_LAYER = 100_000
MAX_GPUS_PER_NODE = 64  # as a pool's gpus_per_vm
MAX_MICROBATCH_SIZE = 1 << 20
MAX_MICROBATCHES = 1 << 24
MAX_GLOBAL_BATCH_SIZE = 1 << 40


def _whole(v: Any, where: str, lo: int, hi: int) -> int:
    """A whole number in [lo, hi] (an integral float such as 4.0 counts), else a PlanFormatError."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise PlanFormatError(f"plan field {where} must be a whole number from {lo} to {hi:,}, got {shown(v)}; "
                              f"to fix: correct the file (format and limits: docs/formats.md)")
    return v


def _text(v: Any, where: str, most: int = MAX_NAME_CHARS) -> str:
    """A name of 1 to `most` printable characters (no newline, tab or escape), else a PlanFormatError."""
    if isinstance(v, str) and 0 < len(v) <= most and v.isprintable() and v == v.strip():
        return v
    raise PlanFormatError(f"plan field {where} must be text of 1 to {most} printable characters (no newline, tab or "
                          f"leading blank), got {shown(v)}; to fix: correct the file (format: docs/formats.md)")


def _sized(v: Any, where: str, most: int) -> list[Any]:
    if not isinstance(v, list) or not 1 <= len(v) <= most:
        size = f"{len(v):,} items" if isinstance(v, list) else shown(v)
        raise PlanFormatError(f"plan field {where} must be a list of 1 to {most:,} items, got {size}; to fix: "
                              f"correct the file (format and limits: docs/formats.md)")
    return v


def _stages(raw: Any) -> tuple[Stage, ...]:
    out = []
    for i, s in enumerate(_sized(raw, "stages", MAX_STAGES)):
        where = f"stages[{i}]"
        layers = _sized(s["layers"], f"{where}.layers", 2)
        replicas = tuple(
            Replica(
                gpu_type=_text(r["gpu_type"], f"{where}.replicas[{j}].gpu_type"),
                zone=_text(r["zone"], f"{where}.replicas[{j}].zone"),
                tp=_whole(r.get("tp", 1), f"{where}.replicas[{j}].tp", 1, MAX_GPUS_PER_NODE),
                gpus_per_node=_whole(r.get("gpus_per_node", 1), f"{where}.replicas[{j}].gpus_per_node", 1,
                                     MAX_GPUS_PER_NODE),
                market=Market.parse(_text(r.get("market", "on-demand"), f"{where}.replicas[{j}].market")),
                region=_text(r["region"], f"{where}.replicas[{j}].region") if r.get("region") else "",
            )
            for j, r in enumerate(_sized(s["replicas"], f"{where}.replicas", MAX_PIPELINES))
        )
        out.append(Stage(first_layer=_whole(layers[0], f"{where}.layers[0]", 0, MAX_LAYER),
                         last_layer=_whole(layers[1], f"{where}.layers[1]", 0, MAX_LAYER),
                         recompute=bool(s.get("recompute", False)), replicas=replicas))
    return tuple(out)


def _pipelines(raw: Any) -> tuple[PipelineBatch, ...]:
    return tuple(
        PipelineBatch(microbatch_size=_whole(p["microbatch_size"], f"pipelines[{j}].microbatch_size", 1,
                                             MAX_MICROBATCH_SIZE),
                      num_microbatches=_whole(p["num_microbatches"], f"pipelines[{j}].num_microbatches", 1,
                                              MAX_MICROBATCHES))
        for j, p in enumerate(_sized(raw, "pipelines", MAX_PIPELINES))
    )


def plan_from_eth_easl(d: dict[str, Any], *, model: str) -> ParallelPlan:
    """Import a published `plan_config_*.json` (first pipeline of `pipeline_list`).

    The artifact runs ceil(gbs / (mbs * dp)) microbatches on every pipeline. We share the exact
    global batch round-robin instead, so the slowest pipeline still runs ceil(...) microbatches
    and the iteration time is unchanged, while no sample is padded.
    """
    try:
        pipe = d["pipeline_list"][0]
        mbs = _whole(d["mbs"], "mbs", 1, MAX_MICROBATCH_SIZE)
        gbs = _whole(d["gbs"], "gbs", 1, MAX_GLOBAL_BATCH_SIZE)
        layer_lists = _sized(pipe["layers_per_stage"], "layers_per_stage", MAX_STAGES)
        stages = []
        for i, (layers, reps) in enumerate(zip(layer_lists, pipe["tmp_per_stage"], strict=True)):
            replicas = []
            for nodes, tp in _sized(reps, f"tmp_per_stage[{i}]", MAX_PIPELINES):
                gpu_type, gpus_per_node, zone = nodes[0]
                replicas.append(Replica(gpu_type=_text(gpu_type, "gpu_type"), zone=_text(zone, "zone"),
                                        tp=_whole(tp, "tp", 1, MAX_GPUS_PER_NODE),
                                        gpus_per_node=_whole(gpus_per_node, "gpus_per_node", 1, MAX_GPUS_PER_NODE)))
            first, last = (_whole(x, f"layers_per_stage[{i}]", 0, MAX_LAYER) for x in (min(layers), max(layers)))
            if list(layers) != list(range(first, last + 1)):
                raise PlanFormatError(f"stage layers {shown(layers)} are not a contiguous range")
            stages.append(Stage(first_layer=first, last_layer=last, replicas=tuple(replicas)))
    except PlanFormatError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise PlanFormatError(
            f"not a published Sailor plan_config file (problem at {shown(e)}); see docs/formats.md, 'eth-easl plans'"
        ) from None
    dps = {len(st.replicas) for st in stages}
    if len(dps) != 1:
        raise PlanFormatError(f"stages have different data-parallel degrees {sorted(dps)}; sailor pipelines need one")
    dp = dps.pop()
    n_micro = gbs // mbs if gbs % mbs == 0 else math.ceil(gbs / mbs)
    if n_micro < dp:
        raise PlanFormatError(f"gbs={gbs} with mbs={mbs} gives {n_micro} microbatches, fewer than dp={dp}")
    base, extra = divmod(n_micro, dp)
    pipelines = tuple(
        PipelineBatch(microbatch_size=mbs, num_microbatches=base + (1 if j < extra else 0)) for j in range(dp)
    )
    try:
        return ParallelPlan(model=model, global_batch_size=sum(p.samples for p in pipelines), stages=tuple(stages),
                            pipelines=pipelines)
    except ValidationError as e:  # the plan types list every problem of the plan's shape
        raise PlanFormatError(str(e)) from None


def load_plan_file(path: str | os.PathLike[str], *, fmt: str = "auto", model: str | None = None) -> ParallelPlan:
    """The plan in the file at `path`, read within `MAX_PLAN_BYTES` as bounded JSON (sailor_core/files.py:
    no NaN, infinities, duplicate keys or deep nesting); every problem is one `PlanFormatError`."""
    if os.path.isdir(path):
        raise PlanFormatError(
            f"plan file {shown_path(path)} is a directory; to fix: pass the plan's JSON file "
            f"(e.g. the one `sailor plan --out FILE` wrote)"
        )
    text = read_text(path, max_bytes=MAX_PLAN_BYTES, what="plan file", error=PlanFormatError)
    d = parse_json(text, source=f"plan file {shown_path(path)}", error=PlanFormatError)
    if not isinstance(d, dict):
        raise PlanFormatError(f"plan file {path} holds a JSON {type(d).__name__ if d is not None else 'null'}, "
                              f"not a plan object; to fix: pass a file written by `sailor plan --out` "
                              f"(see docs/formats.md)")
    if fmt == "auto":
        fmt = "eth-easl" if "pipeline_list" in d else "sailor"
    if fmt == "eth-easl":
        if not model:
            raise PlanFormatError("published plan files do not name their model; to fix: pass --model (e.g. OPT-350)")
        return plan_from_eth_easl(d, model=model)
    if fmt == "sailor":
        return plan_from_dict(d, model=model)
    raise PlanFormatError(f"unknown plan format {fmt!r}; use 'sailor' or 'eth-easl'")


def save_plan_file(plan: ParallelPlan, path: str | os.PathLike[str], *, flag: str = "plan file") -> None:
    """Write the plan to `path`, a regular file or a new path (never a device, folder or link), atomically
    through a uniquely named temporary file (sailor_core/files.py: parallel writers never share one)."""
    write_atomic(flag, path, json.dumps(plan_to_dict(plan), indent=2).encode())
