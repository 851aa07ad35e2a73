"""What context parallelism (`StepShape.cp` > 1) adds to a rank's memory, as
`distributed/context_parallel.py` and `models/context_attention.py` run it.

Each rank holds block / cp tokens of every row (chunks r and 2cp-1-r of 2 x cp), so
every per-token term of `planner.memory` is counted at those tokens. Attention sees the
whole sequence: before each layer's attention the K and V of the cp group are
all-gathered, in the compute dtype, and sdpa keeps the gathered pair for the backward
(it replaces the layer's own K and V, which are a part of it). The backward makes the
gathered pair's gradient one layer at a time and reorders it by rank for the
reduce-scatter. Each query chunk attends keys [0, its end) with a float additive mask,
built once per forward and shared by every layer: (2cp + 1) c^2 elements per rank
(c = block / 2cp), times the rows when packed examples make a mask per row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshtrain.planner.memory import ModelShape, StepShape

BYTES_FP32, BYTES_BF16 = 4, 2


def compute_bytes(step: StepShape) -> int:
    """The dtype attention runs in: bf16 under autocast or bf16 parameters, else fp32."""
    return BYTES_BF16 if step.bf16 else BYTES_FP32


def gathered_kv_bytes(m: ModelShape, step: StepShape) -> int:
    """One layer's K and V for the whole sequence, one microbatch (the tp rank's KV heads,
    a head at least: replicated where tp > KV heads). At cp 1, the layer's own K and V."""
    kv = max(m.kv_heads // step.tp, 1) * m.head_dim
    return 2 * step.microbatch_size * step.seq_len * kv * compute_bytes(step)


def extra_kv_bytes(m: ModelShape, step: StepShape) -> float:
    """What one layer keeps beyond the per-token count of its own K and V: the other
    ranks' share of the gathered pair ((cp - 1) / cp of it; 0 without cp)."""
    return gathered_kv_bytes(m, step) * (step.cp - 1) / step.cp


def mask_bytes(step: StepShape) -> int:
    """The additive masks of one forward (0 without cp): per rank, its two query chunks of
    c tokens over keys [0, (i + 1) c), (2cp + 1) c^2 elements, per row when packed."""
    if step.cp == 1:
        return 0
    c = step.seq_len // (2 * step.cp)
    rows = step.microbatch_size if step.packed else 1
    return (2 * step.cp + 1) * c * c * rows * compute_bytes(step)


def kv_gradient_bytes(m: ModelShape, step: StepShape) -> int:
    """Transient in a layer's backward (0 without cp): the gathered K/V's gradient and its
    copy in rank order for the reduce-scatter."""
    return 2 * gathered_kv_bytes(m, step) if step.cp > 1 else 0


def context_breakdown(
    m: ModelShape, step: StepShape, *, layers: float, in_flight: int
) -> tuple[int, int]:
    """(gathered K/V, masks) at a rank's peak, both part of its activations: the K/V every
    layer keeps for each microbatch in flight (under full checkpointing or offloading only
    the one layer recomputed or running), and one forward's masks per microbatch."""
    if step.cp == 1:
        return 0, 0
    kept = step.activation_checkpointing != "full" and not step.offload_effective
    kv = gathered_kv_bytes(m, step) * (layers * in_flight if kept else 1)
    return int(kv), mask_bytes(step) * in_flight
