"""Semi-synchronous training (DiLoCo): islands that synchronise every `inner_steps` steps, as values.

Contract: frozen, keyword-only dataclasses validated on construction, and their JSON form. Pure: the
simulator (simulator/semisync.py), the planner (planner/islands.py) and the runtime
(runtime/outer_sync.py) share them.

- `OuterSync`: the knobs of the outer loop. Every `inner_steps` (H) steps each island's pseudo-gradient
  (global parameters minus its own) is averaged over the islands, weighted by the tokens each trained,
  and one outer step is taken with SGD, Nesterov momentum `momentum` and learning rate `outer_lr`
  (DiLoCo: 0.7 and 0.9), identical on every island. `compression`: what crosses the slow links, "none"
  (fp32), "bf16", or "int8" (one scale per tensor, INTELLECT-1's). `fragments`: the model's parameters
  cut into this many fragments, one synchronised per H / fragments steps in turn (Streaming DiLoCo;
  1: the whole model at once).
- `IslandPlan`: one ordinary `ParallelPlan` per island (synchronous inside) and the `OuterSync`; the
  islands' global batches add up to `global_batch_size`, one iteration of the whole plan. The
  runtime pairs ranks across islands shard for shard, so every island has the same stages (layer
  ranges) and one TP degree per stage (`shape`); `violations` says what breaks that.
- `islands_to_dict` / `islands_from_dict`: {"format": "sailor-islands", "version": 1, "sync": {...},
  "islands": [sailor-plan dicts]} (docs/formats.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sailor_core.domain import ParallelPlan
from sailor_core.errors import PlanFormatError, ValidationError
from sailor_core.plan_format import plan_from_dict, plan_to_dict

COMPRESSIONS = ("none", "bf16", "int8")
BYTES_PER_ELEMENT = {"none": 4, "bf16": 2, "int8": 1}  # what one parameter of a pseudo-gradient sends
FORMAT_NAME = "sailor-islands"
FORMAT_VERSION = 1
# DiLoCo's outer optimizer (Douillard et al. 2023, section 3): SGD with Nesterov momentum 0.9, lr 0.7.
DILOCO_OUTER_LR = 0.7
DILOCO_MOMENTUM = 0.9


@dataclass(frozen=True, kw_only=True)
class OuterSync:
    """The outer loop's knobs (see the module's contract)."""

    inner_steps: int
    outer_lr: float = DILOCO_OUTER_LR
    momentum: float = DILOCO_MOMENTUM
    compression: str = "none"
    fragments: int = 1

    def __post_init__(self) -> None:
        problems = []
        if self.inner_steps < 1:
            problems.append(f"inner_steps must be >= 1, got {self.inner_steps}")
        if not self.outer_lr > 0:
            problems.append(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.momentum < 1:
            problems.append(f"momentum must be in [0, 1), got {self.momentum}")
        if self.compression not in COMPRESSIONS:
            problems.append(f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.fragments < 1 or self.inner_steps % self.fragments:
            problems.append(f"fragments must be >= 1 and divide inner_steps {self.inner_steps}, got {self.fragments}")
        if problems:
            raise ValidationError("invalid outer sync: " + "; ".join(problems)
                                  + "; to fix: e.g. inner_steps 100, compression none, fragments 1")

    @property
    def bytes_per_element(self) -> int:
        """Bytes one parameter of a pseudo-gradient puts on the wire."""
        return BYTES_PER_ELEMENT[self.compression]

    @property
    def sync_every(self) -> int:
        """Inner steps between two outer synchronisations (of one fragment each when streaming)."""
        return self.inner_steps // self.fragments

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> OuterSync:
        known = set(OuterSync.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValidationError(f"unknown outer sync fields {unknown}; to fix: use only {sorted(known)}")
        return OuterSync(**d)


Shape = tuple[tuple[int, int, int], ...]  # per stage: (first layer, last layer, tp)


def shape_of(plan: ParallelPlan) -> Shape | None:
    """(first, last, tp) per stage, or None when a stage's replicas differ in TP degree."""
    out = []
    for st in plan.stages:
        tps = {r.tp for r in st.replicas}
        if len(tps) != 1:
            return None
        out.append((st.first_layer, st.last_layer, tps.pop()))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class IslandPlan:
    """Islands, each an ordinary plan, and the outer loop that joins them (see the module's contract)."""

    islands: tuple[ParallelPlan, ...]
    sync: OuterSync

    def __post_init__(self) -> None:
        problems = self.violations()
        if problems:
            raise ValidationError("invalid island plan: " + "; ".join(problems)
                                  + "; to fix: give every island the same stages and one TP degree per stage")

    def violations(self) -> list[str]:
        if not self.islands:
            return ["no islands"]
        out = []
        if len({p.model for p in self.islands}) != 1:
            out.append(f"islands train different models {sorted({p.model for p in self.islands})}")
        shapes = [shape_of(p) for p in self.islands]
        for i, s in enumerate(shapes):
            if s is None:
                out.append(f"island {i}: replicas of one stage differ in TP degree")
        if len(set(shapes)) > 1 and None not in shapes:
            out.append(f"islands differ in shape (stage layers, tp): {sorted(set(map(str, shapes)))}")
        return out

    @property
    def model(self) -> str:
        return self.islands[0].model

    @property
    def global_batch_size(self) -> int:
        return sum(p.global_batch_size for p in self.islands)

    @property
    def num_gpus(self) -> int:
        return sum(p.num_gpus for p in self.islands)

    def batch_offset(self, island: int) -> int:
        """Where island `island`'s samples start in each global batch of the whole plan."""
        return sum(p.global_batch_size for p in self.islands[:island])


def islands_to_dict(ip: IslandPlan) -> dict[str, Any]:
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "sync": ip.sync.to_dict(),
            "islands": [plan_to_dict(p) for p in ip.islands]}


def islands_from_dict(d: dict[str, Any]) -> IslandPlan:
    if d.get("format") != FORMAT_NAME:
        raise PlanFormatError(f"not an island plan (format={d.get('format')!r}, expected {FORMAT_NAME!r}); to fix: "
                              f"make one with `sailor plan --sync semi`")
    if d.get("version", FORMAT_VERSION) != FORMAT_VERSION:
        raise PlanFormatError(f"island plan version {d.get('version')} is not supported (this sailor reads "
                              f"{FORMAT_VERSION}); to fix: re-create it with this version's `sailor plan`")
    try:
        return IslandPlan(islands=tuple(plan_from_dict(p) for p in d["islands"]),
                          sync=OuterSync.from_dict(dict(d["sync"])))
    except (KeyError, TypeError) as e:
        raise PlanFormatError(f"island plan is missing or mistypes field {e}; to fix: see docs/formats.md") from None
    except ValidationError as e:
        raise PlanFormatError(str(e)) from None
