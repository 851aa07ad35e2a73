"""What one decoder layer of a Llama-family model keeps per token for its backward, and
what its backward and autocast add (the per-layer terms of `planner.memory`)."""

from __future__ import annotations

from meshtrain.planner.shapes import ModelShape, StepShape


def local_kv_heads(m: ModelShape, t: int) -> int:
    """The KV heads on one tp rank: a share, or one at least (replicated past kv_heads)."""
    return max(m.kv_heads // t, 1)


def layer_activation_elements(m: ModelShape, step: StepShape) -> tuple[float, float]:
    """(fp32-kept, matmul-output) elements one decoder layer saves per token on one rank.

    Split in two so bf16 autocast can count matmul outputs at 2 bytes while the
    residual stream and the norms stay fp32.
    """
    t = step.tp
    h, i, a = m.hidden, m.intermediate, m.heads
    kv = local_kv_heads(m, t) * m.head_dim
    q_and_out = 2 * h / t  # q after rotary, attention output (= o_proj input)
    mlp = mlp_activation_elements(m, t)
    per_head = a / t  # log-sum-exp
    if step.activation_checkpointing == "selective":
        # Kept: the layer input and the outputs of every matmul, the attention and every
        # collective (no collective runs twice): q, k, v, attention, gate, up, and
        # o_proj's and down_proj's whole-width partial sums; under tp also those sums
        # all-reduced (or reduce-scattered under SP, which also keeps the two all-gathered
        # norm outputs). Norms, rotary, SiLU and the gating product are recomputed. A
        # sparse layer keeps its router's logits and recomputes its experts (grouped
        # matmuls are not kept; what an exchange under ep keeps: `axes.expert`).
        core = 2 * h / t + 2 * kv + m.per_layer(2 * i / t, m.experts) + per_head + 2 * h
        if t == 1:
            return h, core
        if step.sequence_parallel:
            return h / t, core + 2 * h + 2 * h / t
        return h, core + 2 * h
    # fp32: input, normed input, residual, normed residual (sequence-sharded under SP,
    # which needs tp > 1); matmul side: the two norm outputs as the matmuls keep them
    # (whole: all-gathered under SP), q, attention output, k, v, the MLP.
    kept = 4 * h / t if step.sequence_parallel else 4 * h
    if m.head_norms:
        kept += _head_norm_elements(m, t)
    # bf16 autocast casts the fp32 norm output once per matmul that reads it and each
    # keeps its own copy: q, k, v and gate, up (dry runs); one each otherwise.
    norm_copies = 5 * h if step.bf16 and not step.master_weights else 2 * h
    return kept, norm_copies + q_and_out + 2 * kv + mlp + per_head


def weight_gradient_inputs(m: ModelShape, step: StepShape) -> float:
    """Elements per token and decoder layer of the gradients a split backward's input pass
    leaves for the weight pass (zero-bubble pipeline schedules): those of every weighted
    op's output, q, k, v, gate and up (tp-sharded), o_proj's and down_proj's (whole, or
    sequence-sharded under SP), and the two norms'."""
    t = step.tp
    shard = t if step.sequence_parallel else 1
    kv = local_kv_heads(m, t) * m.head_dim
    return m.hidden / t + 2 * kv + 2 * m.intermediate / t + 4 * m.hidden / shard


def mlp_activation_elements(m: ModelShape, t: int) -> float:
    """What the MLP keeps per token, averaged over the layers: the dense MLP's gate, up,
    SiLU(gate) and their product; a sparse layer's router logits and probabilities, and
    for each of the token's experts its gathered input, gate and up, SiLU(gate), their
    product and the expert's output, with its routing weight, expert index and place in
    the sort (5 elements: two int64s and a weight). That is what transformers' grouped-
    matmul experts save, counted with saved-tensor hooks: within 0.1% at three shapes
    (docs/moe.md). Tensor parallelism does not split a sparse layer: it runs whole on
    the rank's 1/t of the sequence (sequence parallelism, which it needs)."""
    per_expert = 2 * m.hidden + 4 * m.expert_intermediate + 5
    sparse = 2 * m.experts + m.experts_per_token * per_expert
    return m.per_layer(4 * m.intermediate / t, sparse / t)


def _mlp_weights(m: ModelShape, t: int, ep: int = 1) -> float:
    """A layer's MLP weights on a tp rank, averaged over the layers: a sparse layer's
    router and every expert it holds (autocast casts the whole 3-D parameters; E/ep of
    them under expert parallelism)."""
    sparse = m.hidden * (m.experts + m.experts // ep * 3 * m.expert_intermediate)
    return m.per_layer(3 * m.hidden * m.intermediate / t, sparse)


def _head_norm_elements(m: ModelShape, t: int) -> float:
    """What per-head query and key norms keep per token in fp32: each norm's input and its
    normalised output, and one inverse root mean square per head."""
    return (m.heads / t + local_kv_heads(m, t)) * (2 * m.head_dim + 1)


def layer_matmul_elements(m: ModelShape, t: int, ep: int = 1) -> int:
    """One decoder layer's matmul weights on a tp rank (a KV head at least) holding E/ep
    of each sparse layer's experts."""
    kv = local_kv_heads(m, t) * m.head_dim
    return int(2 * m.hidden * m.heads * m.head_dim / t + 2 * m.hidden * kv) + int(
        _mlp_weights(m, t, ep)
    )


def backward_working_set(m: ModelShape, step: StepShape, tokens: int) -> int:
    """Gradients of a layer's activations alive at once during its backward."""
    t = step.tp
    mlp = mlp_activation_elements(m, t) / 2  # the gradients of gate and up (or the experts')
    return int(tokens * (2 * m.hidden + mlp) * step.parameter_bytes)
