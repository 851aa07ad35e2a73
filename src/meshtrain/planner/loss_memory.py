"""The loss's share of a rank's memory, and the chunk `training.loss_chunk_tokens: auto`
takes (`models.head_loss` is what is counted).

Over the whole logits (chunk 0), autograd keeps the fp32 log-softmax of each microbatch
in flight until its backward, and the backward's start adds the gradient of the fp32
logits and of the compute-dtype logits (one vocabulary-wide tensor under tensor
parallelism, whose fused loss writes the gradient once).

Chunked, a microbatch in flight keeps only what the backward would make anyway, made in
the forward: the gradient of the final hidden states and of the LM head's weight (none
for a frozen head). The loss's forward adds one chunk's working set on top: its fp32
logits overwritten by their gradient, beside their bf16 form under bf16; and under bf16
weight-sized buffers: autocast's bf16 copy of fp32 weights, each chunk's bf16 weight
gradient before it is added to the fp32 accumulator (itself transient beside bf16
weights), and under tensor parallelism the hidden states gathered whole.
"""

from __future__ import annotations

import math

from meshtrain.planner.shapes import BYTES_BF16, BYTES_FP32, ModelShape, StepShape

# auto: chunks whose fp32 logits stay near this size, but never fewer tokens than the
# floor, which keeps the head's matmuls large enough to run at speed (bench/large_vocab.py).
AUTO_CHUNK_LOGITS_BYTES = 256 * 2**20
AUTO_CHUNK_MIN_TOKENS = 1024


def auto_loss_chunk_tokens(vocab: int, tp: int, microbatch_tokens: int) -> int:
    """`training.loss_chunk_tokens: auto`: a power of two of at least 1,024 tokens whose
    fp32 logits (this rank's vocabulary share) stay within 256 MiB, or the whole
    microbatch where that is fewer tokens."""
    per_token = math.ceil(vocab / tp) * BYTES_FP32
    fits = max(1, AUTO_CHUNK_LOGITS_BYTES // per_token)
    chunk = max(AUTO_CHUNK_MIN_TOKENS, 2 ** int(math.log2(fits)))
    return min(chunk, microbatch_tokens)


def loss_bytes(m: ModelShape, step: StepShape, tokens: int) -> tuple[int, int]:
    """(bytes kept per microbatch in flight until its backward, bytes only while the loss
    runs) for a microbatch of `tokens` tokens on the rank holding the LM head."""
    vocab = math.ceil(m.vocab / step.tp)
    if step.loss_chunk_tokens == 0:
        logits = tokens * vocab * BYTES_FP32
        return logits, (1 if step.tp > 1 else 2) * logits
    if step.preference_reference:
        return _token_logps_bytes(m, step, tokens, vocab)
    compute = BYTES_BF16 if step.bf16 else BYTES_FP32
    weight = vocab * m.hidden
    kept = tokens * m.hidden * step.parameter_bytes  # the hidden states' gradient
    if not step.frozen_base:
        kept += weight * step.parameter_bytes
    chunk = min(step.loss_chunk_tokens, tokens)
    # The chunk's fp32 logits (overwritten by their gradient), beside the compute-dtype
    # logits before and their gradient after under bf16.
    transient = chunk * vocab * (BYTES_FP32 + (BYTES_BF16 if step.bf16 else 0))
    if compute != step.parameter_bytes:
        transient += weight * compute  # autocast's bf16 copy of the fp32 weight
    if not step.frozen_base and step.bf16:
        transient += weight * BYTES_BF16  # a chunk's bf16 weight gradient, before adding
    if not step.frozen_base and step.parameter_bytes != BYTES_FP32:
        transient += weight * BYTES_FP32  # the fp32 accumulator of bf16 weights' gradient
    if step.tp > 1:
        transient += tokens * m.hidden * step.parameter_bytes  # the gathered hidden states
    return kept, transient


def _token_logps_bytes(m: ModelShape, step: StepShape, tokens: int, vocab: int) -> tuple[int, int]:
    """DPO's head (`models.token_logps`): it keeps its input and each token's
    log-sum-exp and log-probability until the backward, which makes each chunk's logits
    again and then the gradients of its input and weight (in fp32, with a matmul's
    output beside each) and a copy of the chunk's rows."""
    kept = tokens * m.hidden * step.parameter_bytes + 2 * tokens * BYTES_FP32
    chunk = min(step.loss_chunk_tokens, tokens)
    transient = chunk * vocab * (BYTES_FP32 + (BYTES_BF16 if step.bf16 else 0))
    transient += 3 * tokens * m.hidden * BYTES_FP32  # input gradient, its product, the rows
    if not step.frozen_base:
        transient += 2 * vocab * m.hidden * BYTES_FP32  # the weight's gradient and product
    if step.tp > 1:
        transient += tokens * m.hidden * step.parameter_bytes  # the gathered hidden states
    return kept, transient


def head_keeps_its_input(step: StepShape) -> bool:
    """Whether the LM head's matmul keeps the final norm's output for its backward (the
    chunked loss keeps gradients instead)."""
    return step.loss_chunk_tokens == 0
