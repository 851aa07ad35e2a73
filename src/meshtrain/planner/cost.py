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
- the optimizer's elementwise AdamW update over the owned parameters.

Everything else runs one after the other, as meshtrain does.
"""

from __future__ import annotations

import math

from meshtrain.planner.context_memory import gathered_kv_bytes
from meshtrain.planner.devices import DeviceProfile
from meshtrain.planner.shapes import (
    BYTES_BF16,
    BYTES_FP32,
    ContextTime,
    GatherUnits,
    MemoryEstimate,
    ModelShape,
    ShardingTime,
    StepShape,
    TimeEstimate,
)


def _layer_matmul_weights(m: ModelShape) -> int:
    """The weights of one decoder layer's matmuls: q, o (hidden x heads' width), k, v
    (hidden x KV heads' width), and the MLP's three."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return m.hidden * (2 * q + 2 * kv) + 3 * m.hidden * m.intermediate


def _layer_forward_flops(m: ModelShape, seq_len: int, excess: float = 1.0) -> float:
    """Forward FLOPs per token of one decoder layer (`excess`: the attention computed
    beyond the causal share, `attention_excess`)."""
    attention_scores = 2 * seq_len * m.heads * m.head_dim  # QK^T and AV, causal half
    return 2 * _layer_matmul_weights(m) + attention_scores * excess


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
    forward = m.layers * _layer_forward_flops(m, seq_len, excess) + 2 * h * m.vocab
    extra = 0.0
    if checkpointing == "full":
        extra = forward - 2 * h * m.vocab  # every layer's forward again, not the head
    elif checkpointing == "selective":
        extra = 0.05 * forward  # norms, rotary and gating again: elementwise, cheap
    if frozen_base:
        matmuls = 2 * (m.layers * _layer_matmul_weights(m) + h * m.vocab)
        return 3 * forward - matmuls + extra
    return 3 * forward + extra


def model_flops_per_token(m: ModelShape, seq_len: int, *, frozen_base: bool = False) -> float:
    """Model FLOPs per trained token, the usual base of MFU (PaLM, torchtitan): 6 x every
    matmul weight a token passes (the decoder layers' and the LM head's; the input
    embedding is a lookup) + 12 x layers x attention width x sequence for the scores and
    their weighted sum, counted whole. Recomputation is not counted: checkpointing does
    more work for the same model FLOPs."""
    weights = m.layers * _layer_matmul_weights(m) + m.hidden * m.vocab
    # A frozen base (LoRA) needs no weight gradients: 4 x its weights, not 6.
    return (4 if frozen_base else 6) * weights + 12 * m.layers * m.heads * m.head_dim * seq_len


def stage_shares(m: ModelShape, step: StepShape) -> list[float]:
    """Each pipeline rank's share of the model's FLOPs: its stages' layers, and the LM head
    on the rank of the last stage ([1.0] without pp)."""
    if step.pp == 1:
        return [1.0]
    layer = _layer_forward_flops(m, step.seq_len, attention_excess(step))
    head = 2 * m.hidden * m.vocab
    stages = len(step.stage_layers)
    shares = []
    for rank in range(step.pp):
        mine = range(rank, stages, step.pp)
        layers = sum(step.stage_layers[s] for s in mine)
        shares.append(layers * layer + (head if stages - 1 in mine else 0.0))
    return [share / (m.layers * layer + head) for share in shares]


def fill_and_drain(shares: list[float], virtual_stages: int) -> float:
    """The pipeline bubble in microbatch times of the busiest rank (`shares`: each rank's,
    from `stage_shares`): the busiest rank sets the pace, and the other ranks' microbatch
    (forwards before its first, backwards after its last) is the fill and drain around
    it, over the virtual stages. With balanced stages this is the textbook `(p - 1) / v`;
    with the LM head making the last rank the busiest, less (tiny pp2: 0.43, not 1, as
    its schedule's picture shows)."""
    return (sum(shares) - max(shares)) / max(shares) / virtual_stages


def matmul_width(m: ModelShape, step: StepShape) -> float:
    """The width class of a rank's matmuls, as `DeviceProfile.tflops_fp32_by_shape` is
    keyed (measured on unsharded models of hidden sizes w, whose projections are w x w):
    the side of the square matmul as large as a rank's projection, hidden / sqrt(tp),
    since a tp shard keeps the hidden size on one side (hidden x hidden/tp). Keyed at
    hidden / tp instead, tp2 at 27M read the rate of a 256-wide model and came out 1.4x
    slow on the faster table (docs/planner.md)."""
    return m.hidden / math.sqrt(step.tp)


def _ring(bytes_: float, ranks: int, gbps: float, latency_us: float, factor: float) -> float:
    """Seconds of a ring collective: `factor` (2 for all-reduce, 1 for gather/scatter)."""
    if ranks <= 1:
        return 0.0
    return factor * (ranks - 1) / ranks * bytes_ / (gbps * 1e9) + factor * (ranks - 1) * (
        latency_us * 1e-6
    )


def _link(device: DeviceProfile, span: int) -> float:
    """GB/s of a group whose ranks span `span` consecutive devices (tp innermost)."""
    return device.intra_node_gbps if span <= device.devices_per_node else device.inter_node_gbps


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

    activation_bytes = tokens_per_microbatch * m.hidden * (BYTES_BF16 if step.bf16 else BYTES_FP32)
    tp_link = _link(device, step.tp)
    layers_per_rank = m.layers / step.pp
    # Four all-reduce-sized collectives per layer (two forward, two backward), plus the
    # embedding's and the vocabulary-parallel head's.
    per_microbatch = (4 * layers_per_rank + 2) * _ring(
        activation_bytes, step.tp, tp_link, device.latency_us, 2.0
    )
    tensor_parallel = per_microbatch * microbatches

    pipeline = 0.0
    if step.pp > 1:
        pp_link = _link(device, step.tp * step.pp)
        send = activation_bytes / step.tp / (pp_link * 1e9) + device.send_latency_us * 1e-6
        per_microbatch_time = (compute + tensor_parallel) / microbatches
        bubble = fill_and_drain(shares, step.virtual_stages) * per_microbatch_time * accumulation
        pipeline = bubble + 2 * send * microbatches
        if m.tied_embeddings:
            # The first and last stages sum their copies' gradients once per step.
            tied_grad = m.vocab * m.hidden / step.tp * step.gradient_bytes
            pipeline += _ring(tied_grad, 2, pp_link, device.latency_us, 2.0)

    data_parallel = 0.0
    sharding = None
    if step.sharded > 1:
        sharding = estimate_sharding_time(
            step, device, units or GatherUnits(0, 0, 0), compute=compute, accumulation=accumulation
        )
        data_parallel = sharding.exposed_s
    elif step.grad_ranks > 1:
        data_parallel = _replicated_dp_time(
            step,
            device,
            memory,
            microbatch_compute=compute / microbatches,
            bucket_bytes=bucket_bytes,
            overlap_grad_reduce=overlap_grad_reduce,
            overlap_param_gather=overlap_param_gather,
        )

    # AdamW reads parameter, gradient and two moments and writes three: ~28 bytes each.
    owned = memory.optimizer_states / step.optimizer_bytes
    optimizer = owned * 28 / (device.memory_gbps * 1e9)
    context = (
        estimate_context_time(m, step, device, microbatches=microbatches) if step.cp > 1 else None
    )
    return TimeEstimate(
        compute, tensor_parallel, pipeline, data_parallel, optimizer, sharding, context
    )


def _replicated_dp_time(
    step: StepShape,
    device: DeviceProfile,
    memory: MemoryEstimate,
    *,
    microbatch_compute: float,
    bucket_bytes: float,
    overlap_grad_reduce: bool,
    overlap_param_gather: bool,
) -> float:
    """Exposed seconds of the gradient averaging and, under ZeRO-1, the parameter gather.

    Overlapped, each hides behind compute (the averaging behind the last backward, two
    thirds of a microbatch; the gather behind the next first forward, one third) scaled
    by `collective_overlap` (0 on CPU, where the same cores compute and run gloo), except
    its edge bucket: the last one reduced, the first one gathered."""
    ranks = step.grad_ranks  # dp x cp: the ranks holding the same parameters
    dp_link = _link(device, ranks * step.tp * step.pp)

    def exposed(seconds: float, total_bytes: float, hidden_behind: float) -> float:
        edge_bucket = seconds * min(1.0, bucket_bytes / max(1, total_bytes))
        return max(seconds - hidden_behind * device.collective_overlap, edge_bucket)

    factor = 1.0 if step.zero_1 else 2.0
    averaging = _ring(memory.gradients, ranks, dp_link, device.latency_us, factor)
    if overlap_grad_reduce:
        averaging = exposed(averaging, memory.gradients, 2 / 3 * microbatch_compute)
    if not step.zero_1:
        return averaging
    gather = _ring(memory.parameters, ranks, dp_link, device.latency_us, 1.0)
    if overlap_param_gather:
        gather = exposed(gather, memory.parameters, microbatch_compute / 3)
    return averaging + gather


def estimate_sharding_time(
    step: StepShape,
    device: DeviceProfile,
    units: GatherUnits,
    *,
    compute: float,
    accumulation: int,
) -> ShardingTime:
    """FSDP2's all-gathers and reduce-scatters in one step, and what compute cannot hide."""
    n, lat = step.shard_ranks, device.latency_us  # sharded x cp
    replicas = step.grad_ranks // n
    shard_link = _link(device, n * step.tp)
    replica_link = _link(device, step.grad_ranks * step.tp)

    def gather(elements: int) -> float:
        return _ring(elements * step.parameter_bytes, n, shard_link, lat, 1.0)

    def scatter(elements: int) -> float:
        return _ring(elements * step.gradient_bytes, n, shard_link, lat, 1.0)

    def replicate(elements: int) -> float:
        return _ring(elements * step.gradient_bytes / n, replicas, replica_link, lat, 2.0)

    layers = units.layers
    pp = step.pp > 1
    rounds = accumulation if pp else step.microbatches * accumulation
    gathers = (1 if pp else 2) * layers * gather(units.layer) + gather(units.root)
    scatters = layers * scatter(units.layer) + scatter(units.root)
    all_reduces = layers * replicate(units.layer) + replicate(units.root)
    first = gather(units.root) + gather(units.layer)
    last = scatter(units.root) + replicate(units.root)
    per_round = compute / rounds * device.collective_overlap
    if pp:
        # Gathers hide behind the first microbatch's forward, reductions behind the
        # last one's backward (a third and two thirds of a microbatch's compute).
        microbatch = per_round / step.microbatches
        exposed = (
            first
            + max(0.0, gathers - first - microbatch / 3)
            + last
            + max(0.0, scatters + all_reduces - last - 2 * microbatch / 3)
        )
    else:
        exposed = (
            first + last + max(0.0, gathers + scatters + all_reduces - first - last - per_round)
        )
    return ShardingTime(
        all_gather_per_layer_s=gather(units.layer),
        reduce_scatter_per_layer_s=scatter(units.layer),
        rounds=rounds,
        all_gather_s=gathers * rounds,
        reduce_scatter_s=scatters * rounds,
        replica_all_reduce_s=all_reduces * rounds,
        exposed_s=exposed * rounds,
    )


def estimate_context_time(
    m: ModelShape, step: StepShape, device: DeviceProfile, *, microbatches: int
) -> ContextTime:
    """The K/V all-gather (forward; again in full checkpointing's recomputation, and on
    CPU in the backward, which keeps no gathered pair) and the reduce-scatter of their
    gradient (backward), per layer and microbatch, over the cp group: cp x tp
    consecutive devices (mesh order pp, dp, cp, tp). Nothing hides."""
    kv_bytes = gathered_kv_bytes(m, step)  # the whole sequence's pair, one microbatch
    link = _link(device, step.cp * step.tp)
    gather = _ring(kv_bytes, step.cp, link, device.latency_us, 1.0)
    scatter = _ring(kv_bytes, step.cp, link, device.latency_us, 1.0)
    gathers = 1 + int(step.activation_checkpointing == "full") + int(step.cp_fused_backward)
    stages = len(step.stage_layers)
    layers = max(
        sum(step.stage_layers[s] for s in range(rank, stages, step.pp)) for rank in range(step.pp)
    )
    rounds = layers * microbatches
    excess = attention_excess(step)
    attention = 2 * step.seq_len * m.heads * m.head_dim * excess
    share = (
        m.layers
        * attention
        / (m.layers * _layer_forward_flops(m, step.seq_len, excess) + 2 * m.hidden * m.vocab)
    )
    return ContextTime(
        all_gather_per_layer_s=gather,
        reduce_scatter_per_layer_s=scatter,
        gathers_per_layer=gathers,
        exchanges_per_step=rounds * (gathers + 1),
        total_s=rounds * (gathers * gather + scatter),
        attention_share=share,
    )
