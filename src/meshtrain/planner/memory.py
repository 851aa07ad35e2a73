"""Per-rank memory estimate of the model states (parameters, gradients, optimizer).

Counts come from the model's real parameter shapes. What a rank holds: its
tensor-parallel share of every sharded parameter (KV projections counted
with their replicated heads), all of every replicated one (norms), divided
over pipeline stages; gradients of the same size; AdamW's two moments,
divided by dp when ZeRO-1 shards them. Activations are left to the measured
planner (a later piece).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtrain.models.llama_family import is_kv_projection, is_tensor_parallel_sharded

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


def local_parameter_count(
    shapes: dict[str, tuple[int, ...]], *, tp: int, kv_replication: int = 1
) -> int:
    """Elements of all parameters one tensor-parallel rank holds."""
    local = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if tp > 1 and is_tensor_parallel_sharded(name):
            copies = kv_replication if is_kv_projection(name) else 1
            local += math.ceil(numel * copies / tp)
        else:
            local += numel
    return local


def estimate_model_states(
    shapes: dict[str, tuple[int, ...]],
    *,
    dp: int,
    tp: int,
    pp: int,
    zero_1: bool,
    kv_replication: int = 1,
) -> MemoryEstimate:
    """Bytes per rank of fp32 parameters, fp32 gradients and AdamW moments.

    Parameters are fp32 in both precisions (bf16 runs under autocast), so the
    master copy is the parameter itself. ZeRO-1 pads the flat buffer to a
    multiple of dp before it shards, as the optimizer does.
    """
    local = math.ceil(local_parameter_count(shapes, tp=tp, kv_replication=kv_replication) / pp)
    owned = math.ceil(local / dp) if zero_1 else local
    return MemoryEstimate(
        parameters=local * BYTES_FP32,
        gradients=local * BYTES_FP32,
        optimizer_states=owned * BYTES_FP32 * ADAM_MOMENTS,
    )
