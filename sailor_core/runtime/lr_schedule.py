"""Learning-rate schedules: linear warmup, then constant, cosine or linear decay (Megatron's, nanoGPT's).

Contract: `learning_rate(opt_step, base_lr=..., schedule=..., warmup_steps=..., total_steps=...,
min_lr_ratio=...)` is the rate of optimizer step number `opt_step` (0 for the first step): during
warmup `base_lr * (opt_step + 1) / (warmup_steps + 1)`; after it, `constant` keeps `base_lr`,
`cosine` follows half a cosine and `linear` a straight line from `base_lr` down to
`base_lr * min_lr_ratio` at `total_steps`, and stays there after. A pure function of the step, so
a run resumed from a checkpoint (which stores the optimizer step) continues on the same curve under
any plan.
"""

from __future__ import annotations

import math

from sailor_core.errors import SailorError

SCHEDULES = ("constant", "cosine", "linear")


def check_schedule(schedule: str, warmup_steps: int, min_lr_ratio: float) -> None:
    if schedule not in SCHEDULES:
        raise SailorError(f"lr schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}; to fix: e.g. cosine")
    if warmup_steps < 0:
        raise SailorError(f"warmup steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise SailorError(f"the minimum learning rate ratio must be in [0, 1], got {min_lr_ratio}")


def learning_rate(opt_step: int, *, base_lr: float, schedule: str = "constant", warmup_steps: int = 0,
                  total_steps: int = 1, min_lr_ratio: float = 0.0) -> float:
    if schedule not in SCHEDULES:
        check_schedule(schedule, warmup_steps, min_lr_ratio)  # raises, naming the schedules
    if opt_step < warmup_steps:
        return base_lr * (opt_step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return base_lr
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (opt_step - warmup_steps) / span)
    floor = base_lr * min_lr_ratio
    if schedule == "cosine":
        return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (base_lr - floor) * (1.0 - progress)
