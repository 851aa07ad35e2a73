"""Training FLOPs per token of a Llama-family model, and the width class of a rank's
matmuls (what the compute time and each axis's share of it are counted from).
"""

from __future__ import annotations

import math

from meshtrain.planner.shapes import ModelShape, StepShape


def layer_matmul_weights(m: ModelShape) -> int:
    """The weights a token passes in one decoder layer's matmuls: q, o (hidden x heads'
    width), k, v (hidden x KV heads' width), and the MLP's three (averaged over the
    layers of a mixture of experts: `mlp_matmul_weights`)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return m.hidden * (2 * q + 2 * kv) + mlp_matmul_weights(m)


def mlp_matmul_weights(m: ModelShape) -> int:
    """The MLP weights a token passes per decoder layer: the dense MLP's three matrices;
    in a sparse layer the router (experts x hidden) and its `experts_per_token` experts'
    three (the active parameters, not all the experts), averaged over the layers."""
    dense = 3 * m.hidden * m.intermediate
    sparse = m.experts * m.hidden + m.experts_per_token * 3 * m.hidden * m.expert_intermediate
    return int(m.per_layer(dense, sparse))


def layer_forward_flops(m: ModelShape, seq_len: int, excess: float = 1.0) -> float:
    """Forward FLOPs per token of one decoder layer (`excess`: the attention computed
    beyond the causal share, `attention_excess`)."""
    attention_scores = 2 * seq_len * m.heads * m.head_dim  # QK^T and AV, causal half
    return 2 * layer_matmul_weights(m) + attention_scores * excess


def attention_excess(step: StepShape) -> float:
    """A rank's attention work over its causal share. Only packed examples under cp do
    more: each masked query chunk of c = s / 2cp is computed against every key up to its
    end, (2cp + 1) c^2 pairs in all against s^2 / 2cp, so 1 + 1/(2cp). One sequence per
    row runs the earlier chunks whole and its own causally: exactly the causal share."""
    return 1.0 + 1.0 / (2 * step.cp) if step.cp > 1 and step.packed else 1.0


def training_flops_per_token(
    m: ModelShape,
    seq_len: int,
    checkpointing: str,
    *,
    frozen_base: bool = False,
    excess: float = 1.0,
) -> float:
    """Forward + backward FLOPs per token of the whole model. The backward of a matmul is
    two: the input's gradient and the weight's; a frozen base (LoRA) skips the weight's,
    so its matmuls cost twice their forward, not three times (the attention scores have
    no weight: their backward is two either way; the adapters' rank-r products are
    left out, a fraction r / hidden of the layers' own)."""
    h = m.hidden
    forward = m.layers * layer_forward_flops(m, seq_len, excess) + 2 * h * m.vocab
    extra = 0.0
    if checkpointing == "full":
        extra = forward - 2 * h * m.vocab  # every layer's forward again, not the head
    elif checkpointing == "selective":
        extra = 0.05 * forward  # norms, rotary and gating again: elementwise, cheap
    if frozen_base:
        matmuls = 2 * (m.layers * layer_matmul_weights(m) + h * m.vocab)
        return 3 * forward - matmuls + extra
    return 3 * forward + extra


def model_flops_per_token(m: ModelShape, seq_len: int, *, frozen_base: bool = False) -> float:
    """Model FLOPs per trained token, the usual base of MFU (PaLM, torchtitan): 6 x every
    matmul weight a token passes (the decoder layers' and the LM head's; the input
    embedding is a lookup) + 12 x layers x attention width x sequence for the scores and
    their weighted sum, counted whole. Recomputation is not counted: checkpointing does
    more work for the same model FLOPs."""
    weights = m.layers * layer_matmul_weights(m) + m.hidden * m.vocab
    # A frozen base (LoRA) needs no weight gradients: 4 x its weights, not 6.
    return (4 if frozen_base else 6) * weights + 12 * m.layers * m.heads * m.head_dim * seq_len


def matmul_width(m: ModelShape, step: StepShape) -> float:
    """The width class of a rank's matmuls, as `DeviceProfile.tflops_fp32_by_shape` is
    keyed (measured on unsharded models of hidden sizes w, whose projections are w x w):
    the side of the square matmul as large as a rank's projection, hidden / sqrt(tp),
    since a tp shard keeps the hidden size on one side (hidden x hidden/tp). Keyed at
    hidden / tp instead, tp2 at 27M read the rate of a 256-wide model and came out 1.4x
    slow on the faster table (docs/planner.md)."""
    return m.hidden / math.sqrt(step.tp)
