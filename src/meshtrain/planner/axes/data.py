"""Data parallelism (dp) with ZeRO-1 and sharded data parallelism (FSDP2): dp takes the
rest of the world; the model states per rank (parameters, gradients, AdamW's moments,
divided by ZeRO-1 or sharding); the gradient averaging, ZeRO-1's gather and FSDP2's
collectives in the step time; and what sharding buys and costs, in words.
"""

from __future__ import annotations

import dataclasses
import math

from transformers import PretrainedConfig

from meshtrain.config import AUTO, LaunchConfig, Layout, RunConfig
from meshtrain.planner.axes import context, pipeline, tensor
from meshtrain.planner.axes.base import AxisChecks
from meshtrain.planner.axes.pipeline import pipeline_parallel_degrees
from meshtrain.planner.axes.tensor import tensor_parallel_degrees
from meshtrain.planner.candidate import Candidate
from meshtrain.planner.collectives import link, ring
from meshtrain.planner.devices import GIB, DeviceProfile
from meshtrain.planner.parameters import local_parameter_count
from meshtrain.planner.ranking import model_states, peak, speed, versus
from meshtrain.planner.shapes import (
    BYTES_BF16,
    BYTES_FP32,
    FP32,
    GatherUnits,
    MemoryEstimate,
    ShardingTime,
    StepShape,
)
from meshtrain.planner.types import Plan, Refusal, divisors, format_values

# The parameter (and `config.Layout` field) this axis owns; other modules name it here.
PARAMETER = "data_parallel_size"
# Its options: ZeRO-1, and sharding over groups of this many dp ranks.
ZERO_1 = "zero_1"
SHARDING = "sharded_data_parallel_degree"


def check_data_parallel(
    c: Candidate, launch: LaunchConfig, model_config: PretrainedConfig
) -> list[Refusal]:
    """dp (the rest of the world at `auto`), which must make dp x tp x pp x cp the world."""
    tp, pp, cp = c.tp, c.pp, c.cp
    world, others = launch.world_size, tp * pp * cp
    ranks = f"launch.nproc_per_node={launch.nproc_per_node} x launch.nnodes={launch.nnodes}"
    sizes = f"{tensor.PARAMETER} x {pipeline.PARAMETER}" + (
        f" x {context.PARAMETER}" if cp > 1 else ""
    )
    if c.chosen("dp"):
        if world % others == 0:
            return []
        tp_ok = tensor_parallel_degrees(world, model_config)
        pp_ok = pipeline_parallel_degrees(world, model_config)
        also = f", and {context.PARAMETER} among {format_values(divisors(world))}"
        refusal = Refusal(
            "parallel.data_parallel_size",
            AUTO,
            f"world size {world} ({ranks}) is not a multiple of {sizes} = {others}",
            f"Choose {tensor.PARAMETER} among {format_values(tp_ok)} and "
            f"{pipeline.PARAMETER} among {format_values(pp_ok)}{also if cp > 1 else ''}.",
        )
        return [refusal]
    dp = c.dp
    if dp * others == world:
        return []
    fit = world // others if world % others == 0 else None
    fix = (
        f"Use data_parallel_size={fit} (or auto), or change launch.nproc_per_node."
        if fit
        else f"Use launch.nproc_per_node={dp * others // launch.nnodes or 1} or change the sizes."
    )
    names = "dp x tp x pp x cp" if cp > 1 else "dp x tp x pp"
    values = " x ".join(str(v) for v in (dp, tp, pp, cp)[: 4 if cp > 1 else 3])
    refusal = Refusal(
        "parallel.data_parallel_size",
        dp,
        f"{names} = {values} = {dp * others} must equal the world size {world} ({ranks})",
        fix,
    )
    return [refusal]


def resolve_zero_1(c: Candidate) -> tuple[bool, list[str]]:
    """Off, with a note, when there is nothing to shard (it shards over the dp x cp ranks,
    which hold the same parameters). At `auto` the search plans it off, and on only where
    memory needs it (`search`)."""
    if c.zero_1 and c.dp * c.cp == 1:
        return False, ["parallel.zero_1 has nothing to shard at data_parallel_size=1; off."]
    return c.zero_1, []


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


def check_sharded_data_parallel(c: Candidate) -> tuple[int, list[Refusal]]:
    """The degree N of sharded data parallelism; N must divide data_parallel_size, and
    ZeRO-1 on top of it is refused (it is already included). The search expands `auto`
    into `sharded_data_parallel_degrees` and plans each; a layout planned alone at `auto`
    is not sharded."""
    degree, dp = c.sdp, c.dp
    if degree < 1 or dp % degree:
        works = format_values(divisors(dp))
        return 1, [
            Refusal(
                "parallel.sharded_data_parallel_degree",
                degree,
                f"the parameters are sharded over groups of that many of the "
                f"data_parallel_size={dp} ranks, so it must divide {dp}",
                f"Use one of {works} (1: off; {dp}: full sharding).",
            )
        ]
    if degree > 1 and c.zero_1:
        return degree, [
            Refusal(
                "parallel.zero_1",
                True,
                f"sharded_data_parallel_degree={degree} already shards the optimizer "
                "states (and the gradients and parameters) over the data-parallel ranks",
                "Set parallel.zero_1=false (or auto) with sharded data parallelism.",
            )
        ]
    return degree, []


def replicated_dp_time(
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
    dp_link = link(device, ranks * step.tp * step.pp)

    def exposed(seconds: float, total_bytes: float, hidden_behind: float) -> float:
        edge_bucket = seconds * min(1.0, bucket_bytes / max(1, total_bytes))
        return max(seconds - hidden_behind * device.collective_overlap, edge_bucket)

    factor = 1.0 if step.zero_1 else 2.0
    averaging = ring(memory.gradients, ranks, dp_link, device.latency_us, factor)
    if overlap_grad_reduce:
        averaging = exposed(averaging, memory.gradients, 2 / 3 * microbatch_compute)
    if not step.zero_1:
        return averaging
    gather = ring(memory.parameters, ranks, dp_link, device.latency_us, 1.0)
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


def sharding_clause(p: Plan, planned: list[Plan], budget: float) -> str:
    """What sharding did for (or cost) this layout, when that is part of why it lost."""
    if p.layout.sharded:
        if peak(p) > budget:
            return ""
        t = p.time_estimate
        return (
            f"; sdp{p.layout.sharded_data_parallel_degree}: model states "
            f"{model_states(p) / GIB:.2f} GiB + "
            f"{p.memory_estimate_per_rank.get('gathered', 0) / GIB:.2f} GiB gathered, "
            f"collectives {_collectives(t):.2f} s per step "
            f"({t.get('sdp_exposed_s', 0.0):.2f} s exposed)"
        )
    sibling = _sharded_sibling(p.layout, planned, budget)
    if sibling is not None and peak(p) > budget:
        return (
            f"; sharded as {sibling.layout.name} it needs "
            f"{sibling.memory_estimate_per_rank['total'] / GIB:.2f} GiB"
        )
    return ""


def sharding_note(chosen: Plan, planned: list[Plan], budget: float) -> str | None:
    """Why the chosen layout does or does not shard, against its own twin the other way."""
    lay = chosen.layout
    if lay.sharded:
        twin = _twin(lay, planned, sharded=1)
        verdict = f"sharded data parallelism ({_kind(lay)}) is chosen: {_sharding_cost(chosen)}"
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
    sibling = _sharded_sibling(lay, planned, budget)
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
        f"sdp{p.layout.sharded_data_parallel_degree} holds "
        f"{model_states(p) / GIB:.2f} GiB of model states and "
        f"{p.memory_estimate_per_rank.get('gathered', 0) / GIB:.2f} GiB gathered, and its "
        f"all-gathers and reduce-scatters take {_collectives(t):.2f} s per step, "
        f"{t.get('sdp_exposed_s', 0.0):.2f} s of it not hidden behind compute"
    )


def _kind(lay: Layout) -> str:
    n, dp, cp = lay.sharded_data_parallel_degree, lay.data_parallel_size, context.AXIS.degree(lay)
    over = f" x {cp} context-parallel" if cp > 1 else ""
    if n == dp:
        return f"full sharding over the {dp} data-parallel{over} ranks, which includes ZeRO-1"
    return f"hybrid: sharded within groups of {n}{over} ranks, {dp // n} replicas"


def _sharded_sibling(lay: Layout, planned: list[Plan], budget: float) -> Plan | None:
    """The fastest sharded layout fitting the budget that differs from `lay` only there."""
    twins = [
        p
        for p in planned
        if p.layout.sharded and peak(p) <= budget and _same_but_sharding(p.layout, lay)
    ]
    return max(twins, key=speed, default=None)


def _twin(lay: Layout, planned: list[Plan], *, sharded: int) -> Plan | None:
    return next(
        (
            p
            for p in planned
            if p.layout.sharded_data_parallel_degree == sharded
            and _same_but_sharding(p.layout, lay)
        ),
        None,
    )


def _same_but_sharding(a: Layout, b: Layout) -> bool:
    return (
        a.data_parallel_size,
        tensor.AXIS.degree(a),
        pipeline.AXIS.degree(a),
        context.AXIS.degree(a),
        a.activation_checkpointing,
    ) == (
        b.data_parallel_size,
        tensor.AXIS.degree(b),
        pipeline.AXIS.degree(b),
        context.AXIS.degree(b),
        b.activation_checkpointing,
    )


def _collectives(t: dict[str, float]) -> float:
    return (
        t.get("sdp_all_gather_s", 0.0)
        + t.get("sdp_reduce_scatter_s", 0.0)
        + t.get("sdp_replica_all_reduce_s", 0.0)
    )


def sharding_line(plan: Plan) -> str:
    """The sharded layout's collectives: per layer, per step, and the share hidden."""
    t, lay = plan.time_estimate, plan.layout
    n, dp = lay.sharded_data_parallel_degree, lay.data_parallel_size
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


def estimate_model_states(
    shapes: dict[str, tuple[int, ...]],
    *,
    dp: int,
    tp: int,
    pp: int,
    zero_1: bool,
    kv_replication: int = 1,
    precision: StepShape | None = None,
    sharded: int = 1,
) -> MemoryEstimate:
    """Bytes per rank of parameters, gradients and optimizer states, stages averaged
    (`precision`: a step shape whose precision fields apply; default fp32; `sharded`:
    the sharded data parallel degree, which divides all three)."""
    local = math.ceil(local_parameter_count(shapes, tp=tp, kv_replication=kv_replication) / pp)
    step = dataclasses.replace(precision or FP32, sharded=sharded)
    if sharded > 1:
        return sharded_model_states(local, step)
    owned = math.ceil(local / dp) if zero_1 else local
    return with_model_states(local, owned, step)


def with_model_states(
    held: int, owned: int, step: StepShape, *, activations: int = 0, loss: int = 0
) -> MemoryEstimate:
    """Parameters and gradients of `held` elements, optimizer states of the `owned` ones,
    at the step's precision."""
    return MemoryEstimate(
        parameters=held * step.parameter_bytes,
        gradients=held * step.gradient_bytes,
        optimizer_states=owned * step.optimizer_bytes,
        activations=activations,
        loss=loss,
    )


def sharded_model_states(
    local: int, step: StepShape, *, gathered: int = 0, activations: int = 0, loss: int = 0
) -> MemoryEstimate:
    """The rank's 1/N of `local` elements: fp32 parameters (the master weights under
    bf16_master), fp32 gradients (FSDP2 casts the reduced gradient to the parameter's
    dtype) and the two moments, padded to a multiple of N."""
    shard = math.ceil(local / step.shard_ranks)
    return MemoryEstimate(
        parameters=shard * BYTES_FP32,
        gradients=shard * BYTES_FP32,
        optimizer_states=shard * step.optimizer_bytes,
        activations=activations,
        loss=loss,
        gathered=gathered,
        gradients_at_peak=False,
    )


def gathered_bytes(
    step: StepShape, *, local: int, layer: int, layers: int, gradients: bool = True
) -> int:
    """Bytes of gathered parameters and unsharded gradients at the step's peak, for a rank
    holding `local` elements of which `layers` decoder layers of `layer` elements each.

    Without pp the peak is the backward's start (dry runs, docs/dry_run.md): the root
    group (embedding, final norm, LM head) gathered for the whole step, the last layer
    gathered again; no gradient unsharded yet (the LM head's is the loss's, the
    embedding's comes last). Under pp the stage stays gathered and accumulates unsharded
    gradients until the schedule's last microbatch, whose backward copies the first group
    into a flat reduce-scatter buffer while the others are still gathered; interleaved,
    only the last chunk's gradients exist at the warm-up's peak. (Sharding only.)"""
    grad = step.gradient_bytes if gradients else 0  # a frozen base has none
    root = local - layers * layer
    if step.pp > 1 and step.schedule == "interleaved_1f1b":
        # A rank's gradients are made by its chunks' first backwards: at the warm-up's
        # peak only the last chunk has had one, and nothing is reduced yet (dry runs).
        return local * step.parameter_bytes + local // step.virtual_stages * grad
    if step.pp > 1:
        return local * (step.parameter_bytes + grad) + max(root, layer) * grad
    return (root + min(1, layers) * layer) * step.parameter_bytes


def lora_model_states(base: GatherUnits, trained: GatherUnits, step: StepShape) -> MemoryEstimate:
    """The frozen base's parameters alone (fp32 shards under sharding, else the compute
    dtype: bf16 under bf16 autocast too), and the adapters' full states (`trained`)."""
    if step.sharded > 1:
        adapters = sharded_model_states(trained.local, step)
        gathered = gathered_bytes(
            step, local=base.local, layer=base.layer, layers=base.layers, gradients=False
        ) + gathered_bytes(step, local=trained.local, layer=trained.layer, layers=trained.layers)
        frozen = math.ceil(base.local / step.shard_ranks) * BYTES_FP32
        return dataclasses.replace(
            adapters, parameters=adapters.parameters + frozen, gathered=gathered
        )
    ranks = step.grad_ranks
    padded = math.ceil(trained.local / ranks) * ranks if step.zero_1 else trained.local
    owned = padded // ranks if step.zero_1 else padded
    adapters = with_model_states(padded, owned, step)
    frozen = base.local * (BYTES_BF16 if step.bf16 else BYTES_FP32)
    return dataclasses.replace(adapters, parameters=adapters.parameters + frozen)


def sharding_degree(layout: Layout) -> int:
    """The sharded data parallel degree of a resolved layout (1: not sharded)."""
    return layout.sharded_data_parallel_degree


class DataAxis:
    """Data parallelism, ZeRO-1 and sharded data parallelism."""

    name = "data"
    short = "dp"

    def degree(self, layout: Layout) -> int:
        """This axis's degree in a resolved layout."""
        return layout.data_parallel_size

    def options(self, run: RunConfig, model_config: PretrainedConfig) -> list[int]:
        """dp as given, or at `auto` whatever the other axes leave of the world (the search
        derives it per layout)."""
        degree = run.parallel.data_parallel_size
        return [] if degree == AUTO else [degree]

    def check(self, c: Candidate, run: RunConfig, model_config: PretrainedConfig) -> AxisChecks:
        sharded, refusals = check_sharded_data_parallel(c)
        zero_1, notes = resolve_zero_1(c)
        return AxisChecks(
            degree=check_data_parallel(c, run.launch, model_config),
            options=refusals,
            notes=notes,
            layout={
                "data_parallel_size": c.dp,
                "zero_1": zero_1,
                "sharded_data_parallel_degree": sharded,
            },
        )

    def describe(self, plan: Plan, seq_len: int) -> str | None:
        return sharding_line(plan) if plan.layout.sharded else None


AXIS = DataAxis()
