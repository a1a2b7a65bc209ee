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
            f"not a sailor plan (format={d.get('format')!r}); for published plans use --format eth-easl"
        )
    version = d.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise PlanFormatError(
            f"plan format version {version} is not supported (this sailor reads version {FORMAT_VERSION}); "
            f"to fix: re-create the plan with this version's `sailor plan`"
        )
    named = d.get("model")
    if model and named and str(named) != model:
        raise PlanFormatError(f"the plan file is a plan for {named}, but --model says {model}; to fix: drop --model "
                              f"(the plan's model is used) or make a plan for {model} with `sailor plan`")
    try:
        stages = tuple(
            Stage(
                first_layer=int(s["layers"][0]),
                last_layer=int(s["layers"][1]),
                recompute=bool(s.get("recompute", False)),
                replicas=tuple(
                    Replica(
                        gpu_type=str(r["gpu_type"]),
                        zone=str(r["zone"]),
                        tp=int(r.get("tp", 1)),
                        gpus_per_node=int(r.get("gpus_per_node", 1)),
                        market=Market.parse(r.get("market", "on-demand")),
                        region=str(r.get("region", "")),
                    )
                    for r in s["replicas"]
                ),
            )
            for s in d["stages"]
        )
        pipelines = tuple(
            PipelineBatch(microbatch_size=int(p["microbatch_size"]), num_microbatches=int(p["num_microbatches"]))
            for p in d["pipelines"]
        )
        plan = ParallelPlan(
            model=str(model or d["model"]),
            global_batch_size=int(d["global_batch_size"]),
            stages=stages,
            pipelines=pipelines,
            schedule=str(d.get("schedule", "1f1b")),
            precision=str(d.get("precision", "fp32")),
            zero1=bool(d.get("zero1", False)),
        )
    except (KeyError, IndexError, TypeError) as e:
        raise PlanFormatError(
            f"plan is missing or mistypes field {e}; see docs/formats.md for the plan format"
        ) from None
    except ValidationError as e:  # the plan types' own message: every problem and the fix
        raise PlanFormatError(str(e)) from None
    except ValueError as e:
        raise PlanFormatError(f"invalid plan: {e}") from None
    return plan


def plan_from_eth_easl(d: dict[str, Any], *, model: str) -> ParallelPlan:
    """Import a published `plan_config_*.json` (first pipeline of `pipeline_list`).

    The artifact runs ceil(gbs / (mbs * dp)) microbatches on every pipeline. We share the exact
    global batch round-robin instead, so the slowest pipeline still runs ceil(...) microbatches
    and the iteration time is unchanged, while no sample is padded.
    """
    try:
        pipe = d["pipeline_list"][0]
        mbs = int(d["mbs"])
        gbs = int(d["gbs"])
        layer_lists = pipe["layers_per_stage"]
        stages = []
        for layers, reps in zip(layer_lists, pipe["tmp_per_stage"], strict=True):
            replicas = []
            for nodes, tp in reps:
                gpu_type, gpus_per_node, zone = nodes[0]
                replicas.append(
                    Replica(gpu_type=str(gpu_type), zone=str(zone), tp=int(tp), gpus_per_node=int(gpus_per_node))
                )
            if list(layers) != list(range(min(layers), max(layers) + 1)):
                raise PlanFormatError(f"stage layers {layers} are not a contiguous range")
            stages.append(Stage(first_layer=min(layers), last_layer=max(layers), replicas=tuple(replicas)))
    except PlanFormatError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise PlanFormatError(
            f"not a published Sailor plan_config file (problem at {e}); see docs/formats.md, 'eth-easl plans'"
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
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise PlanFormatError(f"plan file {path} does not exist") from None
    except IsADirectoryError:
        raise PlanFormatError(
            f"plan file {path} is a directory; to fix: pass the plan's JSON file "
            f"(e.g. the one `sailor plan --out FILE` wrote)"
        ) from None
    except json.JSONDecodeError as e:
        raise PlanFormatError(f"plan file {path} is not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlanFormatError(
            f"cannot read plan file {path}: {e}; to fix: check the path and its permissions"
        ) from None
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


def save_plan_file(plan: ParallelPlan, path: str | os.PathLike[str]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(plan_to_dict(plan), f, indent=2)
    os.replace(tmp, path)
