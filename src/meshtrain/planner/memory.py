"""Per-rank memory estimate of the model states (parameters, gradients, optimizer).

Counts come from the model's real parameter shapes. What a rank holds:
parameters and gradients for its share of the model (all of it while tp = pp
= 1), and AdamW's two moments, divided by dp when ZeRO-1 shards them.
Activations are left to the measured planner (a later piece).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BYTES_FP32 = 4
ADAM_MOMENTS = 2


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    def to_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_states": self.optimizer_states,
            "total": self.total,
        }


def estimate_model_states(num_parameters: int, *, dp: int, tp: int, pp: int, zero_1: bool):
    """Bytes per rank of fp32 parameters, fp32 gradients and AdamW moments.

    Parameters are fp32 in both precisions (bf16 runs under autocast), so the
    master copy is the parameter itself. ZeRO-1 pads the flat buffer to a
    multiple of dp before it shards, as the optimizer does.
    """
    local = math.ceil(num_parameters / (tp * pp))
    owned = math.ceil(local / dp) if zero_1 else local
    return MemoryEstimate(
        parameters=local * BYTES_FP32,
        gradients=local * BYTES_FP32,
        optimizer_states=owned * BYTES_FP32 * ADAM_MOMENTS,
    )
