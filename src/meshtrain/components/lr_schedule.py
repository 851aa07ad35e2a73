"""The learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math
from functools import partial

import torch

from meshtrain.config import TrainingConfig


def warmup_cosine(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, training: TrainingConfig, *, start_step: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule positioned at `start_step` (a resumed run's rate follows from the step
    alone, so checkpoints need not store the scheduler)."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        partial(
            warmup_cosine,
            warmup_steps=training.warmup_steps,
            max_steps=training.max_steps,
            min_ratio=training.min_learning_rate_ratio,
        ),
        last_epoch=start_step - 1,
    )
