"""Sharded data parallelism (FSDP2, ZeRO-3): parameters, gradients and optimizer states
sharded over groups of N data-parallel (x cp) ranks, gathered a layer at a time. The
data axis's option (`axes.data`): its degrees and checks, the sharded model states and
what is gathered, its collectives' time, and what sharding buys and costs, in words.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from meshtrain.config import Layout
from meshtrain.planner.axes import context, pipeline, tensor
from meshtrain.planner.collectives import link, ring
from meshtrain.planner.devices import GIB, DeviceProfile
from meshtrain.planner.ranking import model_states, peak, speed, versus
from meshtrain.planner.shapes import (
    BYTES_FP32,
    GatherUnits,
    MemoryEstimate,
    ShardingTime,
    StepShape,
)
from meshtrain.planner.types import Plan

# Sharding's degree: the parameter and the `config.Layout` field.
SHARDING = "sharded_data_parallel_degree"

# How the words below read a layout's data-parallel degree (the data axis's `degree`).
DegreeOf = Callable[[Layout], int]


def sharded_data_parallel_degrees(
    dp: int, tp: int, devices_per_node: int, cp: int = 1
) -> list[int]:
    """The degrees `auto` weighs: 1 (off), dp (full sharding) and, when the dp group spans
    nodes, hybrid sharding within a node (N x cp x tp = devices per node: FSDP2 shards over
    the N x cp ranks), so the all-gathers and reduce-scatters stay on the fast link and
    only the replicas' all-reduce crosses."""
    options = {1, dp}
    spans_nodes = dp * cp * tp > devices_per_node
    hybrid = devices_per_node // (tp * cp)
    if spans_nodes and 1 < hybrid < dp and dp % hybrid == 0:
        options.add(hybrid)
    return sorted(options)


def sharding_degree(layout: Layout) -> int:
    """The sharded data parallel degree of a resolved layout (1: not sharded)."""
    return getattr(layout, SHARDING)


def sharded_model_states(
    local: int,
    step: StepShape,
    *,
    gathered: int = 0,
    activations: int = 0,
    loss: int = 0,
    experts: int = 0,
    expert_shards: int = 1,
) -> MemoryEstimate:
    """The rank's 1/N of `local` elements: fp32 parameters (the master weights under
    bf16_master), fp32 gradients (FSDP2 casts the reduced gradient to the parameter's
    dtype) and the two moments, padded to a multiple of N. `experts`: of `local`, the
    experts that expert parallelism splits, sharded over the `expert_shards` ranks that
    hold them instead. The sharded gradients are made by the first backward's reduce-
    scatters, after the peak at its start; with gradient accumulation (no pipeline) every
    later backward starts with all of them (Qwen3-30B-A3B on 8 x h100, 32 accumulation
    steps: the dry run's peak at the second backward's start holds them)."""
    experts_shard = math.ceil(experts / expert_shards) if experts else 0
    shard = math.ceil((local - experts) / step.shard_ranks) + experts_shard
    return MemoryEstimate(
        parameters=shard * BYTES_FP32,
        gradients=shard * BYTES_FP32,
        optimizer_states=shard * step.optimizer_bytes,
        activations=activations,
        loss=loss,
        gathered=gathered,
        gradients_at_peak=step.accumulation > 1 and step.pp == 1,
        expert_parameters=experts_shard * BYTES_FP32,
        expert_gradients=experts_shard * BYTES_FP32,
        expert_optimizer_states=experts_shard * step.optimizer_bytes,
    )


def at_backward_end(
    local: int,
    layer: int,
    layers: int,
    step: StepShape,
    *,
    layer_activations: int,
    experts: int = 0,
    expert_shards: int = 1,
) -> MemoryEstimate:
    """The other moment of a sharded step without a pipeline: the backward's end. Every
    layer's sharded gradient exists by then; the root group and the last layer to go
    backward are gathered, that layer makes its unsharded gradient and the reduce-scatter
    copies it into its input buffer; one layer's activations are left. A mixture of
    experts' layers, whose gradients are several times their activations, can peak here
    (a 6-layer Qwen3-MoE at sdp2: dry run 1,600 MiB, real 1,593, this 1,588; docs/moe.md);
    dense layers peak at the backward's start (`gathered_bytes`), where the dry runs hold
    the planner, and this moment is not applied to them."""
    root = local - layers * layer
    gathered = (root + min(1, layers) * layer) * step.parameter_bytes
    gathered += 2 * layer * step.gradient_bytes
    states = sharded_model_states(
        local,
        step,
        gathered=gathered,
        activations=layer_activations,
        experts=experts,
        expert_shards=expert_shards,
    )
    return dataclasses.replace(states, gradients_at_peak=True)


def gathered_bytes(
    step: StepShape,
    *,
    local: int,
    layer: int,
    layers: int,
    gradients: bool = True,
    rank: int = 0,
) -> int:
    """Bytes of gathered parameters and unsharded gradients at the step's peak, for
    pipeline rank `rank` holding `local` elements of which `layers` decoder layers of
    `layer` elements each.

    Without pp the peak is the backward's start (dry runs, docs/dry_run.md): the root
    group (embedding, final norm, LM head) gathered for the whole step, the last layer
    gathered again; no gradient unsharded yet (the LM head's is the loss's, the
    embedding's comes last). Under pp the stage stays gathered and accumulates unsharded
    gradients until the schedule's last microbatch, whose backward copies the first group
    into a flat reduce-scatter buffer while the others are still gathered; interleaved,
    the chunks that have started their backwards and not finished them at the peak
    (`pipeline.interleaved_gradient_chunks`). (Sharding only.)"""
    grad = step.gradient_bytes if gradients else 0  # a frozen base has none
    root = local - layers * layer
    if step.pp > 1 and step.schedule == "interleaved_1f1b":
        chunks = pipeline.interleaved_gradient_chunks(step, rank)
        return local * step.parameter_bytes + local * chunks // step.virtual_stages * grad
    if step.pp > 1:
        return local * (step.parameter_bytes + grad) + max(root, layer) * grad
    return (root + min(1, layers) * layer) * step.parameter_bytes


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
    shard_link = link(device, n * step.tp)
    replica_link = link(device, step.grad_ranks * step.tp)

    def gather(elements: int) -> float:
        return ring(elements * step.parameter_bytes, n, shard_link, lat, 1.0)

    def scatter(elements: int) -> float:
        return ring(elements * step.gradient_bytes, n, shard_link, lat, 1.0)

    def replicate(elements: int) -> float:
        return ring(elements * step.gradient_bytes / n, replicas, replica_link, lat, 2.0)

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


def sharding_clause(p: Plan, planned: list[Plan], budget: float, dp_of: DegreeOf) -> str:
    """What sharding did for (or cost) this layout, when that is part of why it lost
    (`dp_of`: the data-parallel degree of a layout)."""
    if p.layout.sharded:
        if peak(p) > budget:
            return ""
        t = p.time_estimate
        return (
            f"; sdp{sharding_degree(p.layout)}: model states "
            f"{model_states(p) / GIB:.2f} GiB + "
            f"{p.memory_estimate_per_rank.get('gathered', 0) / GIB:.2f} GiB gathered, "
            f"collectives {_collectives(t):.2f} s per step "
            f"({t.get('sdp_exposed_s', 0.0):.2f} s exposed)"
        )
    sibling = _sharded_sibling(p.layout, planned, budget, dp_of)
    if sibling is not None and peak(p) > budget:
        return (
            f"; sharded as {sibling.layout.name} it needs "
            f"{sibling.memory_estimate_per_rank['total'] / GIB:.2f} GiB"
        )
    return ""


def sharding_note(chosen: Plan, planned: list[Plan], budget: float, dp_of: DegreeOf) -> str | None:
    """Why the chosen layout does or does not shard, against its own twin the other way."""
    lay = chosen.layout
    if lay.sharded:
        twin = _twin(lay, planned, dp_of)
        kind = _kind(lay, dp_of(lay))
        verdict = f"sharded data parallelism ({kind}) is chosen: {_sharding_cost(chosen)}"
        if twin is None:
            return verdict
        if peak(twin) > budget:
            return (
                f"{verdict}; unsharded, {twin.layout.name} needs "
                f"{twin.memory_estimate_per_rank['total'] / GIB:.2f} GiB per rank, over the "
                f"{budget / GIB:.2f} GiB budget (model states "
                f"{model_states(twin) / GIB:.2f} GiB against {model_states(chosen) / GIB:.2f})"
            )
        return f"{verdict}; unsharded, {twin.layout.name} fits but is {versus(chosen, twin)}"
    sibling = _sharded_sibling(lay, planned, budget, dp_of)
    if sibling is None:
        return None
    return (
        f"not sharded: this layout fits without it, and {sibling.layout.name} would hold "
        f"{model_states(sibling) / GIB:.2f} GiB of model states instead of "
        f"{model_states(chosen) / GIB:.2f} at {versus(chosen, sibling)} "
        f"({_sharding_cost(sibling)})"
    )


def _sharding_cost(p: Plan) -> str:
    t = p.time_estimate
    return (
        f"sdp{sharding_degree(p.layout)} holds "
        f"{model_states(p) / GIB:.2f} GiB of model states and "
        f"{p.memory_estimate_per_rank.get('gathered', 0) / GIB:.2f} GiB gathered, and its "
        f"all-gathers and reduce-scatters take {_collectives(t):.2f} s per step, "
        f"{t.get('sdp_exposed_s', 0.0):.2f} s of it not hidden behind compute"
    )


def _kind(lay: Layout, dp: int) -> str:
    n, cp = sharding_degree(lay), context.AXIS.degree(lay)
    over = f" x {cp} context-parallel" if cp > 1 else ""
    if n == dp:
        return f"full sharding over the {dp} data-parallel{over} ranks, which includes ZeRO-1"
    return f"hybrid: sharded within groups of {n}{over} ranks, {dp // n} replicas"


def _sharded_sibling(
    lay: Layout, planned: list[Plan], budget: float, dp_of: DegreeOf
) -> Plan | None:
    """The fastest sharded layout fitting the budget that differs from `lay` only there."""
    twins = [
        p
        for p in planned
        if p.layout.sharded and peak(p) <= budget and _same_but_sharding(p.layout, lay, dp_of)
    ]
    return max(twins, key=speed, default=None)


def _twin(lay: Layout, planned: list[Plan], dp_of: DegreeOf) -> Plan | None:
    """The unsharded layout that differs from `lay` only there."""
    return next(
        (p for p in planned if not p.layout.sharded and _same_but_sharding(p.layout, lay, dp_of)),
        None,
    )


def _same_but_sharding(a: Layout, b: Layout, dp_of: DegreeOf) -> bool:
    def degrees(lay: Layout) -> tuple[int | str, ...]:
        return (
            dp_of(lay),
            tensor.AXIS.degree(lay),
            pipeline.AXIS.degree(lay),
            context.AXIS.degree(lay),
            lay.activation_checkpointing,
        )

    return degrees(a) == degrees(b)


def _collectives(t: dict[str, float]) -> float:
    return (
        t.get("sdp_all_gather_s", 0.0)
        + t.get("sdp_reduce_scatter_s", 0.0)
        + t.get("sdp_replica_all_reduce_s", 0.0)
    )


def sharding_line(plan: Plan, dp: int) -> str:
    """The sharded layout's collectives (over `dp` data-parallel ranks): per layer, per
    step, and the share hidden."""
    t, lay = plan.time_estimate, plan.layout
    n = sharding_degree(lay)
    if pipeline.AXIS.degree(lay) > 1:
        per, rounds, gathers = "schedule step", "schedule steps", "one all-gather"
    else:
        per, rounds, gathers = "microbatch", "microbatches", "two all-gathers (forward, backward)"
    hybrid = f", all-reduced over {dp // n} replicas" if n < dp else ""
    cp = context.AXIS.degree(lay)
    if cp > 1:  # FSDP2 shards over the sdp x cp ranks
        hybrid = f" x {cp} cp ranks{hybrid}"
    collectives = t["sdp_all_gather_s"] + t["sdp_reduce_scatter_s"] + t["sdp_replica_all_reduce_s"]
    return (
        f"  sharded over {n} of {dp} dp ranks{hybrid}: per layer and {per} {gathers} of "
        f"{t['sdp_all_gather_per_layer_s'] * 1e3:.2f} ms and a reduce-scatter of "
        f"{t['sdp_reduce_scatter_per_layer_s'] * 1e3:.2f} ms, {int(t['sdp_rounds_per_step'])} "
        f"{rounds} per step: {collectives:.2f} s of collectives per step, "
        f"{t['sdp_overlapped_share']:.0%} hidden behind compute"
    )
