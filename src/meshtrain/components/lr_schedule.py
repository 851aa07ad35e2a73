"""The learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtrain.config import TrainingConfig


def warmup_cosine(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LearningRateSchedule:
    """The rate of every optimizer step, from the step alone: a resumed run needs no
    scheduler state in its checkpoint."""

    training: TrainingConfig

    def rate(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        t = self.training
        return t.learning_rate * warmup_cosine(
            step,
            warmup_steps=t.warmup_steps,
            max_steps=t.max_steps,
            min_ratio=t.min_learning_rate_ratio,
        )
