"""Parameters of a `sailor` flow run, validated before anything is provisioned.

Contract: `SailorParams` is the one declaration of the `sailor` flow's parameters: names, defaults,
limits and descriptions. `validate_params(raw)` builds it and raises `InvalidParameters`, whose
message lists each bad field with its value and the reason, and how to fix it.
`takes_params(Model)` gives a flow function written as `fn(deps=None, **parameters)` the flat
signature Prefect reads (one keyword parameter per field, with its default): the deployment's
parameters, its schedules' overrides, `prefect deployment run --param` and the UI's form stay flat,
and stay the model's. Nothing here touches the outside world.
"""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sailor_core.domain import MAX_PLAIN_GLOBAL_BATCH, Market
from sailor_core.errors import InvalidParameters as InvalidParameters  # re-exported for tests
from sailor_core.planner.request import Objective
from sailor_core.uris import redact_text

PROVIDERS = ("local", "aws", "gcp")


class SailorParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_name: str = Field(default="sailor", min_length=1, max_length=80, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: str = Field(default="gpt-tiny", min_length=1)
    global_batch_size: int = Field(default=8, ge=1)
    objective: Objective = Objective.MIN_COST
    max_usd_per_iteration: float | None = Field(default=None, gt=0)
    max_usd_per_hour: float | None = Field(default=None, gt=0)
    min_iterations_per_s: float | None = Field(default=None, gt=0)
    deadline_s: float | None = Field(default=None, gt=0, description="wall-clock limit of the training phase")
    clouds: list[str] | None = None
    regions: list[str] | None = None
    gpu_types: list[str] | None = None
    markets: list[str] | None = None
    max_gpus: int | None = Field(default=None, ge=1)
    max_stages: int | None = Field(default=None, ge=1, description="most pipeline stages a plan may have")
    max_search_s: float = Field(default=5.0, gt=0, le=3600, description=(
        "time budget of each plan the run makes, the first and every replan (the planner keeps the best it "
        "found and proves a gap): a replan sits on the recovery path of a preempted job"))
    spot_preemptions_per_vm_hour: float = Field(
        default=0.0, ge=0, description="expected preemptions per spot VM-hour where the store's run history has not "
                                       "watched a market long enough (what max-goodput weighs; 0: none expected)")
    provider: Literal["local", "aws", "gcp"] = "local"
    store_uri: str | None = Field(default=None, description="profile store URI; None: $SAILOR_STORE or .sailor/store")
    workdir: str = Field(default=".sailor", min_length=1,
                         description="local folder for checkpoints, worker metrics and local worker slots")
    dataset: str | None = Field(default=None, description="data URI; None uses the runtime's built-in corpus")
    steps: int | None = Field(default=None, ge=1)
    token_budget: int | None = Field(default=None, ge=1)
    checkpoint_interval: int = Field(default=0, ge=0, description="steps between checkpoints; 0: chosen for each plan "
                                     "by the Young/Daly rule from the checkpoint's measured time, the preemption rate "
                                     "and the notice (tasks/checkpointing.py)")
    spot_notice_s: float | None = Field(default=None, gt=0, description="seconds of notice before a spot VM is taken "
                                        "back; None: the provider's documented notice (AWS 120, GCP 30) or the "
                                        "local scenario's shortest grace")
    scenario: str | None = Field(default=None, description="local provider: YAML file scripting events")
    workers: int = Field(default=4, ge=1, le=64, description="local provider: most devices a plan may use")
    isolation: Literal["auto", "netns", "process"] = Field(
        default="auto", description="local provider: netns (isolated testbed VMs, needs root), process, or auto")
    seed: int = 0
    # Replanning: a new plan is adopted only when it saves more than this many seconds (max-throughput)
    # or dollars (cost objectives) over the remaining work, net of the reconfiguration cost.
    min_gain: float = Field(default=0.0, ge=0)
    heartbeat_timeout_s: float = Field(default=20.0, gt=0)
    calibration_tolerance: float = Field(default=0.25, gt=0, lt=10,
                                         description="relative departure of measured from estimated "
                                                     "iteration time that triggers a correction")
    resume: bool = Field(default=False, description="continue the newest run of this name from its checkpoint "
                                                   "(the scheduled cost-aware rerun sets this); fails when no valid "
                                                   "checkpoint is left unless resume_or_start")
    resume_or_start: bool = Field(default=False, description="with resume: start at step 0 when no earlier run left "
                                                             "a valid checkpoint (the schedule's first run)")
    large_batch: bool = Field(default=False, description=f"allow a global batch above {MAX_PLAIN_GLOBAL_BATCH} "
                                                          f"sequences (refused without it)")
    dry_run: bool = False
    what_if_trace: str | None = Field(default=None, description="before renting anything, replay the job over this "
                                                                "availability and price trace (a file sailor replay "
                                                                "reads, or 'synthetic') under each policy; the "
                                                                "result is the run's what-if artifact")

    @field_validator("markets")
    @classmethod
    def _markets(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("an empty list allows nothing; omit it to allow every market")
        return [Market.parse(m).value for m in v]

    @field_validator("clouds", "regions", "gpu_types")
    @classmethod
    def _non_empty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or any(not s for s in v)):
            raise ValueError("must be omitted or a list of non-empty names")
        return v

    @field_validator("scenario")
    @classmethod
    def _scenario(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"scenario file {v!r} does not exist")
        return v

    @field_validator("what_if_trace")
    @classmethod
    def _what_if_trace(cls, v: str | None) -> str | None:
        if v is not None and v != "synthetic" and not Path(v).is_file():
            raise ValueError(f"trace file {v!r} does not exist (or use 'synthetic')")
        return v

    @model_validator(mode="after")
    def _budget(self) -> SailorParams:
        if (self.steps is None) == (self.token_budget is None):
            raise ValueError("give exactly one of steps or token_budget")
        if self.token_budget is not None and self.global_batch_size > self.token_budget:
            raise ValueError(f"global_batch_size {self.global_batch_size} sequences is more than the whole token "
                             f"budget ({self.token_budget} tokens): one step would overrun it")
        if self.global_batch_size > MAX_PLAIN_GLOBAL_BATCH and not self.large_batch:
            raise ValueError(f"global_batch_size {self.global_batch_size:.3g} sequences is more than "
                             f"{MAX_PLAIN_GLOBAL_BATCH} (published large runs use 1-4 thousand); set large_batch "
                             f"if you mean it")
        if self.scenario and self.provider != "local":
            raise ValueError("scenario files script the local provider only; drop scenario or use provider=local")
        return self

    def total_steps(self, sequence_length: int) -> int:
        """Steps to train: given, or enough iterations to consume the token budget."""
        if self.steps is not None:
            return self.steps
        assert self.token_budget is not None
        return max(1, math.ceil(self.token_budget / (self.global_batch_size * sequence_length)))


def validate_params(raw: dict[str, object]) -> SailorParams:
    """Build SailorParams or raise InvalidParameters naming every bad field."""
    try:
        return SailorParams.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"]) or "parameters"
            msg = str(err["msg"]).removeprefix("Value error, ")
            value = err.get("input")
            shown = "" if isinstance(value, dict) else f" (got {redact_text(repr(value))[:200]})"
            problems.append(f"{field}: {msg}{shown}")
        # Cross-field rules run only once every field is valid; say them now too, so one try fixes all.
        if (raw.get("steps") is None) == (raw.get("token_budget") is None) and not any(
            "steps or" in p for p in problems
        ):
            problems.append("parameters: give exactly one of steps or token_budget")
        raise InvalidParameters(
            "invalid parameters: " + "; ".join(problems) + "; to fix: correct these fields and run again"
        ) from None


F = TypeVar("F", bound=Callable[..., object])


def _as_sent(annotation: object) -> object:
    """The type a flow parameter is declared with: choices (enums, Literals) as the text the UI, the CLI
    and a deployment's YAML send, so the model checks them with every other field in one message."""
    if get_origin(annotation) is Literal or (isinstance(annotation, type) and issubclass(annotation, enum.Enum)):
        return str
    return annotation


def flat_signature(model: type[BaseModel], fn: Callable[..., object]) -> inspect.Signature:
    """`fn`'s signature with its `**parameters` replaced by one keyword parameter per field of `model`."""
    own = inspect.signature(fn)
    fields = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=_as_sent(f.annotation),
                                default=f.default.value if isinstance(f.default, enum.Enum) else f.default)
              for name, f in model.model_fields.items()]
    # The rest of fn's parameters (test hooks such as `deps`) go after, typed `object`: Prefect
    # validates parameters against this signature, and must not rebuild a live object it is handed.
    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=object) for p in own.parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return own.replace(parameters=fields + rest, return_annotation=inspect.Signature.empty)


def takes_params(model: type[BaseModel]) -> Callable[[F], F]:
    """Declare `fn(**parameters)`'s parameters to be `model`'s fields (see the module's contract)."""

    def declare(fn: F) -> F:
        fn.__signature__ = flat_signature(model, fn)  # type: ignore[attr-defined]
        return fn

    return declare
