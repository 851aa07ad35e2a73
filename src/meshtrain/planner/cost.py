"""Step-time model: compute, tensor/pipeline/data-parallel communication, the bubble.

- compute: training FLOPs per token (6 per matmul parameter, plus causal
  attention's `6 s h` per layer; full checkpointing adds a forward, 2 per
  parameter) over the device's sustained rate, split over tp and, under pp,
  those of the busiest pipeline rank (its layers, plus the LM head on the
  last stage's rank); where the
  profile measures the rate per matmul size (CPU cores), at the rank's width
  (hidden / sqrt(tp): a tp shard is hidden x hidden/tp) and tokens per forward,
  from the table of the run's model converter where the profile has one;
- tensor parallelism: per layer and microbatch, two collectives of the
  activations forward and two backward (all-reduces; all-gathers and
  reduce-scatters under sequence parallelism, the same bytes), ring cost
  `2 (t-1)/t` bytes per all-reduce over the link, plus a latency per hop;
- pipeline parallelism: the bubble, the other ranks' microbatch time around
  the busiest rank's (`(p-1)/v` microbatch times when the stages are balanced),
  and one activation send and one gradient send per microbatch and stage
  boundary, at the device's point-to-point latency;
- data parallelism: the gradient averaging (an all-reduce, or under ZeRO-1 a
  reduction to each range's owner: half the bytes), and under ZeRO-1 the
  parameter all-gather after the update. With `overlap_grad_reduce` the
  averaging runs in buckets during the backward of the step's last
  microbatch: only what does not fit in that backward (scaled by the device's
  `collective_overlap`), or at least the last bucket, is exposed; with
  `overlap_param_gather` the all-gather runs bucket by bucket under the
  next step's first forward, of which it exposes what does not fit (scaled
  the same way), or at least the first bucket; without it, all of it;
- sharded data parallelism (FSDP2 over groups of N dp ranks) replaces the
  gradient averaging: per decoder layer an all-gather of its parameters (in
  the compute dtype) and a reduce-scatter of its gradients (in the reduce
  dtype), each `(N-1)/N` of the layer's bytes over the link of N x tp
  consecutive devices, and under hybrid sharding an all-reduce of the 1/N
  gradient shard over the dp/N replicas; the root group (embedding, final
  norm, LM head) once each. Without pp every microbatch gathers each layer
  twice (forward, and again for backward) and reduce-scatters once; under pp
  the stage is gathered once and reduced once per schedule step. The
  collectives overlap compute (one layer is prefetched ahead) except the
  first gather (the root's and the first layer's) and the last reduction
  (the root's): only those and what exceeds the compute they hide behind
  (the whole microbatch without pp; under pp the first microbatch's forward
  for the gathers and the last one's backward for the reductions), scaled by
  the device's `collective_overlap` (0 on CPU, where the same cores compute
  and run gloo), count;
- context parallelism (`cp` > 1): each rank computes block / cp tokens of every row and
  its exact causal share of attention: one sequence per row runs each query chunk over
  the earlier chunks whole and its own causally, no masked pair computed. Packed
  examples' masked call computes each chunk's whole rectangle of keys [0, its end):
  (2cp + 1) c^2 pairs per head and row (c = block / 2cp), `1 + 1/(2cp)` times the causal
  share. Per layer and microbatch the K and V are all-gathered over the cp group in the
  forward (again in full checkpointing's recomputation, and on CPU again in the
  backward, whose fused kernel keeps no gathered pair) and their gradient
  reduce-scattered in the backward, each `(cp-1)/cp` of the gathered pair, over the
  link of cp x tp consecutive devices. The exchange runs right before attention,
  synchronously: none of it hides behind compute. The gradients are averaged (or
  sharded) over the dp x cp ranks that hold the parameters;
- expert parallelism (`ep` > 1, `planner.axes.expert`): per sparse layer and microbatch two
  all-to-alls of the routed pairs' hidden states forward, two backward (two more under full
  checkpointing), `(ep-1)/ep` of each leaving the rank, on the link of ep x tp devices,
  at the busiest rank's rows (the routing imbalance it assumes), none hidden; and that
  rank's extra expert compute. The experts' gradients are averaged (and under ZeRO-1
  gathered) over the dp x cp / ep ranks holding the same experts, after the dense part;
- the optimizer's elementwise AdamW update over the owned parameters.

Everything else runs one after the other, as meshtrain does.
"""

from __future__ import annotations

from meshtrain.planner.axes import AXES
from meshtrain.planner.axes.pipeline import stage_shares
from meshtrain.planner.devices import DeviceProfile
from meshtrain.planner.flops import attention_excess, matmul_width, training_flops_per_token
from meshtrain.planner.shapes import (
    BYTES_BF16,
    BYTES_FP32,
    AxisTime,
    GatherUnits,
    MemoryEstimate,
    ModelShape,
    StepShape,
    StepTiming,
    TimeEstimate,
)


def estimate_step_time(
    m: ModelShape,
    step: StepShape,
    device: DeviceProfile,
    *,
    accumulation: int,
    memory: MemoryEstimate,
    overlap_grad_reduce: bool,
    bucket_bytes: float,
    units: GatherUnits | None = None,
    overlap_param_gather: bool = False,
) -> TimeEstimate:
    """Seconds of one optimizer step on the slowest rank (`memory`: its estimate, whose
    gradient buffer dp reduces and whose optimizer states AdamW updates; `units`: what
    sharded data parallelism gathers, needed when `step.sharded` > 1)."""
    tokens_per_microbatch = step.microbatch_size * step.local_seq_len  # this rank's
    microbatches = step.microbatches * accumulation  # forwards per step per rank
    tokens = tokens_per_microbatch * microbatches
    checkpointing, excess = step.activation_checkpointing, attention_excess(step)
    flops = tokens * training_flops_per_token(
        m, step.seq_len, checkpointing, frozen_base=step.frozen_base, excess=excess
    )
    rate = device.tflops(
        step.bf16,
        width=matmul_width(m, step),
        tokens=tokens_per_microbatch,
        converters=step.converters,
    )
    shares = stage_shares(m, step)
    compute = flops * max(shares) / step.tp / (rate * 1e12)  # the busiest pipeline rank

    timing = StepTiming(
        compute_s=compute,
        microbatches=microbatches,
        accumulation=accumulation,
        activation_bytes=tokens_per_microbatch
        * m.hidden
        * (BYTES_BF16 if step.bf16 else BYTES_FP32),
        shares=tuple(shares),
        memory=memory,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        bucket_bytes=bucket_bytes,
        units=units,
    )
    terms: list[AxisTime] = []
    for axis in AXES:
        earlier = {k: v for t in terms for k, v in t.seconds.items()}
        terms.append(axis.time_terms(m, step, device, timing, earlier))

    # AdamW reads parameter, gradient and two moments and writes three: ~28 bytes each.
    owned = memory.optimizer_states / step.optimizer_bytes
    optimizer = owned * 28 / (device.memory_gbps * 1e9)
    return TimeEstimate(compute, optimizer, tuple(terms))
