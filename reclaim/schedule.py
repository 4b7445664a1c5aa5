"""Learning-rate schedules, as transformers defines them (`lr_scheduler_type` names).

The factor multiplies the optimizer's learning rate before step `step` (0-based); warm-up rises
linearly from 0 over `warmup_steps` steps, as in transformers' `get_linear_schedule_with_warmup`.
Every trainer (ssm-train now; GRPO and the drafter next) builds its scheduler here.
"""

from __future__ import annotations

import functools
import math

import torch

SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


def lr_factor(step: int, *, name: str, warmup_steps: int, total_steps: int,
              num_cycles: float = 0.5) -> float:
    """The learning-rate multiplier at 0-based `step` (transformers' lr lambdas, same formulas)."""
    if name == "constant":
        return 1.0
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if name == "constant_with_warmup":
        return 1.0
    span = float(max(1, total_steps - warmup_steps))
    if name == "linear":
        return max(0.0, float(total_steps - step) / span)
    if name == "cosine":
        progress = float(step - warmup_steps) / span
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))
    raise ValueError(f"lr_scheduler_type {name!r} is not one of {list(SCHEDULES)}")


def lr_scheduler(optimizer: torch.optim.Optimizer, name: str, *, warmup_steps: int,
                 total_steps: int, num_cycles: float = 0.5) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR with `lr_factor` (its state_dict saves and resumes like transformers')."""
    if name not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type {name!r} is not one of {list(SCHEDULES)}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1; got {warmup_steps}, {total_steps}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, name=name, warmup_steps=warmup_steps, total_steps=total_steps,
        num_cycles=num_cycles))
