"""Per-rank memory model: model states, saved activations, the loss, in-flight microbatches.

Every term is counted from what meshtrain's own step keeps alive, checked against the
measured peak of live tensors (`components.memory_probe`, `meshtrain.dryrun`):

- model states, from the real (meta-device) parameter shapes: this rank's tp share
  (KV heads replicated) on its stages; gradients in the flat buffer; AdamW's two
  moments, divided by dp under ZeRO-1;
- the activations autograd saves in a Llama-family decoder layer (Hugging
  Face's, with SDPA: no sequence x sequence matrix), per token and layer, with and
  without tensor and sequence parallelism (`layer_activation_elements`; Korthikanti et
  al. (2022)'s accounting redone for this layer);
- full activation checkpointing keeps each layer's input and, in backward, one layer's
  activations at a time; selective keeps the matmul and attention outputs;
- the loss, counted in `planner.loss_memory` (chunked, or over the whole logits);
- tied embeddings over pipeline stages: the last stage's LM head is a copy of
  the embedding, with its own gradient and AdamW moments;
- pipeline schedules: GPipe keeps every microbatch's activations, 1F1B at
  most `pp - stage` on a stage, interleaved 1F1B its warm-up depth in model
  chunks (torch's schedule); the last stage keeps the loss's share of each
  microbatch in flight until its backward (`planner.axes.pipeline`);
- context parallelism: per-token terms at the rank's block / cp tokens, the gathered
  K/V and packed examples' masks (`planner.axes.context`); ZeRO-1 and FSDP2 over x cp;
- expert parallelism (ep > 1): E/ep experts per rank in a flat buffer of their own, ZeRO-1
  over the dp/ep ranks holding the same experts; each sparse layer's dispatch buffers,
  at the routing imbalance `planner.axes.expert` assumes.

`process_total`, fitted into the device, adds the profile's runtime and allocator share;
offloaded activations are counted apart (host memory).

Precisions: `no` and `bf16` (autocast) keep fp32 parameters and gradients (bf16
matmul outputs); `bf16_master` bf16 parameters and activations, fp32 gradients (or
bf16) and an fp32 master in AdamW. Sharded (`StepShape.sharded` = N > 1, FSDP2): fp32
shards over N, what is gathered counted apart (`axes.data.gathered_bytes`). Each term with its
bytes: docs/planner.md, "Memory model" and "Sharded data parallelism".
"""

from __future__ import annotations

import dataclasses

from meshtrain.pipeline_schedules import ZERO_BUBBLE
from meshtrain.planner.axes import AXES, local_share
from meshtrain.planner.axes.context import context_breakdown
from meshtrain.planner.axes.data import lora_model_states, replicated_model_states
from meshtrain.planner.axes.expert import dispatch_breakdown, expert_degree, expert_stage_counts
from meshtrain.planner.axes.pipeline import (
    in_flight_microbatches,
    last_stage_in_flight,
    split_backward_peak,
)
from meshtrain.planner.axes.sharding import (
    at_backward_end,
    gathered_bytes,
    sharded_model_states,
)
from meshtrain.planner.layer_memory import (
    backward_working_set,
    layer_activation_elements,
    layer_matmul_elements,
    weight_gradient_inputs,
)
from meshtrain.planner.loss_memory import head_keeps_its_input, loss_bytes
from meshtrain.planner.parameters import local_counts
from meshtrain.planner.shapes import (
    BYTES_BF16,
    BYTES_FP32,
    INT64,
    GatherUnits,
    MemoryEstimate,
    ModelShape,
    StepShape,
)


def estimate_memory(
    shapes: dict[str, tuple[int, ...]],
    m: ModelShape,
    step: StepShape,
    adapter_shapes: dict[str, tuple[int, ...]] | None = None,
) -> MemoryEstimate:
    """Peak bytes of live tensors on the most loaded rank, with its breakdown
    (`adapter_shapes`: a LoRA run's adapters, the only parameters it trains)."""
    share = local_share(m, step)
    counts, layer = local_counts(shapes, m, step, share)
    experts = expert_stage_counts(shapes, step, share)
    stages = len(step.stage_layers)
    adapters, adapter_layer = (
        local_counts(adapter_shapes, m, step, share) if adapter_shapes else ([0] * stages, 0)
    )
    # The stages each rank holds: `StepShape.stages_of` (the schedule's placement).
    per_rank: list[MemoryEstimate] = []
    for rank in range(step.pp):
        mine = step.stages_of(rank)
        local = sum(counts[s] for s in mine)
        activations, loss = _activations_on_rank(m, step, rank, mine)  # saved, at the peak
        if step.frozen_base:
            trained = GatherUnits(
                sum(adapters[s] for s in mine),
                adapter_layer,
                sum(step.stage_layers[s] for s in mine),
            )
            base = GatherUnits(local, layer, trained.layers)
            states = lora_model_states(base, trained, step, rank)
            per_rank.append(dataclasses.replace(states, activations=activations, loss=loss))
            continue
        mine_experts = sum(experts[s] for s in mine)
        if step.sharded > 1:
            layers = sum(step.stage_layers[s] for s in mine)
            gathered = gathered_bytes(step, local=local, layer=layer, layers=layers, rank=rank)
            # ep's experts are sharded over the ranks holding them (full sharding).
            split = {
                "experts": mine_experts,
                "expert_shards": step.shard_ranks // expert_degree(step.layout),
            }
            states = sharded_model_states(
                local, step, gathered=gathered, activations=activations, loss=loss, **split
            )
            if step.pp == 1 and m.sparse_layers:  # measured on mixtures of experts only
                end = at_backward_end(
                    local,
                    layer,
                    layers,
                    step,
                    layer_activations=activations // max(1, layers),
                    **split,
                )
                states = max(states, end, key=lambda moment: moment.total)
            per_rank.append(states)
            continue
        per_rank.append(
            replicated_model_states(
                local, step, activations=activations, loss=loss, experts=mine_experts
            )
        )
    if step.preference_reference == "model":
        per_rank = [
            dataclasses.replace(e, reference=_reference_bytes(counts, step, rank))
            for rank, e in enumerate(per_rank)
        ]
    worst = max(range(step.pp), key=lambda r: per_rank[r].total)
    mine = step.stages_of(worst)
    chunk_layers = sum(step.stage_layers[s] for s in mine) / len(mine)
    in_flight = in_flight_microbatches(step, worst)
    context_kv, context_mask = context_breakdown(m, step, layers=chunk_layers, in_flight=in_flight)
    return dataclasses.replace(
        per_rank[worst],
        context_kv=context_kv,
        context_mask=context_mask,
        expert_dispatch=dispatch_breakdown(m, step, layers=chunk_layers, in_flight=in_flight),
        pipeline_rank=worst,
        per_pipeline_rank=tuple(e.total for e in per_rank),
        offloaded=_offloaded(m, step, [e.activations for e in per_rank]),
    )


def _reference_bytes(counts: list[int], step: StepShape, rank: int) -> int:
    """DPO's frozen reference on pipeline rank `rank`: the policy's parameters, laid out
    and sharded as the policy's, without gradients or optimizer states."""
    local = sum(counts[s] for s in step.stages_of(rank))
    return local * step.parameter_bytes // max(1, step.sharded)


def _offloaded(m: ModelShape, step: StepShape, on_device: list[int]) -> int:
    """Host bytes of the rank that offloads the most: the activations it would keep on
    the device without offloading, less those it keeps (`on_device`, per pipeline rank)."""
    if not step.offload_effective:
        return 0
    kept = dataclasses.replace(step, offload_effective=False)
    return max(
        _activations_on_rank(m, kept, rank, step.stages_of(rank))[0] - device
        for rank, device in enumerate(on_device)
    )


def _held_at_peak(
    m: ModelShape,
    step: StepShape,
    rank: int,
    held: float,
    chunk_layers: float,
    layer: tuple[int, float],
) -> int:
    """The rank's activations at its peak: `held` bytes per chunk x microbatch in flight.
    Under a zero-bubble schedule one whose weight gradient waits also keeps its weighted
    ops' output gradients, and under full checkpointing every layer its input pass
    recomputed (the pass keeps the graph for the weight pass). `chunk_layers`: decoder
    layers per chunk; `layer`: (a microbatch's tokens, a layer's full activations for
    them in bytes)."""
    if step.pp == 1 or step.schedule not in ZERO_BUBBLE:
        return int(held * in_flight_microbatches(step, rank))
    tokens, layer_bytes = layer
    matmul_bytes = BYTES_BF16 if step.bf16 else BYTES_FP32
    waits = tokens * weight_gradient_inputs(m, step) * matmul_bytes
    if step.activation_checkpointing == "full":
        waits += layer_bytes
    waits *= chunk_layers
    peak = split_backward_peak(step, rank, held=held, held_waiting=waits)
    return int(held * peak.in_flight + waits * peak.waiting)


def _activations_on_rank(
    m: ModelShape, step: StepShape, rank: int, stages: list[int]
) -> tuple[int, int]:
    """(activation bytes at the peak, loss bytes at the peak) for one pipeline rank."""
    t, h = step.tp, m.hidden
    tokens = step.microbatch_size * step.local_seq_len  # per microbatch, this rank's
    matmul_bytes = BYTES_BF16 if step.bf16 else BYTES_FP32
    # The residual stream's dtype: bf16 with bf16 parameters, else fp32.
    stream = step.parameter_bytes
    kept, matmul = layer_activation_elements(m, step)
    shard = t if step.sequence_parallel else 1
    if step.frozen_base and step.activation_checkpointing == "none":
        # Frozen norm weights: each norm's final product keeps no normed input for them.
        kept -= 2 * h / shard
        matmul -= step.unsaved_elements
    # bf16 parameters: each norm keeps its fp32 upcast input and its bf16 normed value.
    kept_bytes = (BYTES_FP32 + BYTES_BF16) / 2 if step.master_weights else BYTES_FP32
    if step.master_weights and step.activation_checkpointing == "selective":
        kept_bytes = BYTES_BF16  # only the layer's input is kept
    terms = [axis.memory_terms(m, step) for axis in AXES]
    layer_bytes = tokens * (kept * kept_bytes + matmul * matmul_bytes)
    for extra in (v for t in terms for v in t.layer.values()):
        layer_bytes += extra
    recomputes_merged = step.activation_checkpointing != "none"  # not a matmul: recomputed
    if not recomputes_merged:
        layer_bytes += step.merged_weight_bytes  # LoRA's merged expert weights, kept
    # LoRA's adapters keep their own (their dropped inputs, rank-r intermediates): saved
    # with every layer, or only by the layer being recomputed under full checkpointing.
    layer_bytes += tokens * step.adapter_bytes_per_token
    holds_first = 0 in stages
    holds_last = len(step.stage_layers) - 1 in stages
    layers = sum(step.stage_layers[s] for s in stages)
    chunks = len(stages)

    if step.activation_checkpointing == "full":
        saved_per_layer = tokens * h / shard * stream  # the layer's input
        recomputed = layer_bytes  # backward re-runs one layer at a time
    else:
        saved_per_layer = layer_bytes
        recomputed = 0
    if step.offload_effective:
        saved_per_layer = 0  # saved tensors wait in host memory

    per_microbatch = saved_per_layer * layers / chunks
    # Rotary cos/sin for the rank's positions, and the axes' (packed cp's masks): shared
    # by the layers.
    shared = 2 * step.local_seq_len * m.head_dim * stream
    per_microbatch += shared + sum(v for t in terms for v in t.microbatch.values())
    first_adapter, last_adapter = step.vocabulary_adapter_bytes
    if holds_first:
        per_microbatch += tokens * (INT64 + (h / shard * stream + first_adapter) / chunks)
    if step.pp > 1:
        # The stage output kept by the schedule until its backward (a copy of the residual).
        per_microbatch += tokens * h / shard * stream
    if holds_last:
        # Final norm: its input and normed input (sharded under SP), and its output whole
        # where the LM head's matmul keeps it.
        norm_bytes = 2 * kept_bytes * h / shard + (stream * h if head_keeps_its_input(step) else 0)
        per_microbatch += tokens * (norm_bytes + last_adapter) / chunks
    layer = (tokens, layer_bytes)
    activations = _held_at_peak(m, step, rank, per_microbatch, layers / chunks, layer)
    if step.bf16 and not step.master_weights and step.activation_checkpointing == "none":
        # autocast's bf16 copy of each matmul weight, cached and kept by the backward
        # (without recomputation the trainer keeps the cache: one copy per weight).
        ep = expert_degree(step.layout)
        activations += layers * layer_matmul_elements(m, t, ep) * BYTES_BF16

    # Two moments of the backward, whichever is higher: its start at the loss (what the
    # loss keeps per microbatch in flight, plus its working set), or inside a layer (a
    # recomputed layer and the gradients of its activations, one microbatch's loss share
    # gone).
    kept_loss, at_loss = loss_bytes(m, step, tokens) if holds_last else (0, 0)
    in_layer = int(recomputed + backward_working_set(m, step, tokens)) - kept_loss
    # The merged expert weights' gradient in a layer's backward (and the weights again
    # where recomputed).
    in_layer += int(step.merged_weight_bytes * (2 if recomputes_merged else 1))
    in_layer += sum(v for t in terms for v in t.backward.values())  # cp's K/V gradient, ...
    kept_losses = kept_loss * last_stage_in_flight(step)
    return activations + max(0, in_layer - at_loss), kept_losses + at_loss
