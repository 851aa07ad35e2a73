"""What context parallelism (`StepShape.cp` > 1) adds to a rank's memory, as
`distributed/context_parallel.py` and `distributed/gathered_attention.py` run it.

Each rank holds block / cp tokens of every row (chunks r and 2cp-1-r of 2 x cp), so
every per-token term of `planner.memory` is counted at those tokens. Attention sees the
whole sequence: before each layer's attention the K and V of the cp group are
all-gathered, in the compute dtype. What the backward finds depends on the device:

- CPU (`StepShape.cp_fused_backward`): the fused kernel's backward runs on the merged
  log-sum-exp, so the forward keeps only what the rank owns (its q, K, V, the output and
  the log-sum-exps: the per-token terms already) and the gathered pair is transient. The
  backward gathers it again, makes its gradient (zeros in the compute dtype) and a copy
  in rank order for the reduce-scatter: about three gathered pairs, one layer at a time.
- Accelerators: autograd through the gather and sdpa keeps every layer's gathered pair
  for the backward (it replaces the layer's own K and V, which are a part of it); the
  backward makes its gradient and the rank-order copy, one layer at a time.

One sequence per row needs no mask (the earlier chunks whole, the own chunk causal);
packed examples do: a float additive mask per row, built once per forward and shared by
every layer, (2cp + 1) c^2 elements (c = block / 2cp).
"""

from __future__ import annotations

from meshtrain.planner.layer_memory import local_kv_heads
from meshtrain.planner.shapes import BYTES_BF16, BYTES_FP32, ModelShape, StepShape


def compute_bytes(step: StepShape) -> int:
    """The dtype attention runs in: bf16 under autocast or bf16 parameters, else fp32."""
    return BYTES_BF16 if step.bf16 else BYTES_FP32


def gathered_kv_bytes(m: ModelShape, step: StepShape) -> int:
    """One layer's K and V for the whole sequence, one microbatch (the tp rank's KV heads,
    a head at least: replicated where tp > KV heads). At cp 1, the layer's own K and V."""
    kv = local_kv_heads(m, step.tp) * m.head_dim
    return 2 * step.microbatch_size * step.seq_len * kv * compute_bytes(step)


def keeps_gathered_kv(step: StepShape) -> bool:
    """Whether each layer keeps the gathered pair for its backward (accelerators' autograd
    through sdpa); the CPU's fused backward gathers it again instead."""
    return step.cp > 1 and not step.cp_fused_backward


def extra_kv_bytes(m: ModelShape, step: StepShape) -> float:
    """What one layer keeps beyond the per-token count of its own K and V: where it keeps
    the gathered pair, the other ranks' share of it ((cp - 1) / cp); else nothing."""
    if not keeps_gathered_kv(step):
        return 0.0
    return gathered_kv_bytes(m, step) * (step.cp - 1) / step.cp


def mask_bytes(step: StepShape) -> int:
    """The additive masks of one forward: only packed examples have them (one sequence
    per row runs unmasked kernels). Per row, its two query chunks of c tokens over keys
    [0, (i + 1) c): (2cp + 1) c^2 elements."""
    if step.cp == 1 or not step.packed:
        return 0
    c = step.seq_len // (2 * step.cp)
    return (2 * step.cp + 1) * c * c * step.microbatch_size * compute_bytes(step)


def kv_gradient_bytes(m: ModelShape, step: StepShape) -> int:
    """Transient in a layer's backward (0 without cp): the gathered pair's gradient and
    its rank-order copy; on CPU also the pair gathered again (three pairs in all)."""
    if step.cp == 1:
        return 0
    return (2 if keeps_gathered_kv(step) else 3) * gathered_kv_bytes(m, step)


def context_breakdown(
    m: ModelShape, step: StepShape, *, layers: float, in_flight: int
) -> tuple[int, int]:
    """(gathered K/V kept, masks) at a rank's peak, both part of its activations. K/V:
    where kept, every layer's for each microbatch in flight (under full checkpointing or
    offloading only the one layer recomputed or running); on CPU none (the backward's
    transient pairs are part of its working set, `kv_gradient_bytes`). Masks: one
    forward's per microbatch in flight."""
    if not keeps_gathered_kv(step):
        return 0, mask_bytes(step) * in_flight
    kept = step.activation_checkpointing != "full" and not step.offload_effective
    kv = gathered_kv_bytes(m, step) * (layers * in_flight if kept else 1)
    return int(kv), mask_bytes(step) * in_flight
