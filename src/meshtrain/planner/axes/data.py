"""Data parallelism (dp) with ZeRO-1 and sharded data parallelism (FSDP2): dp takes the
rest of the world; ZeRO-1 at `auto` is turned on only where memory needs it; the model
states per rank (parameters, gradients, AdamW's moments, divided by ZeRO-1 or sharding);
the gradient averaging, ZeRO-1's gather and FSDP2's collectives in the step time; and
what ZeRO-1 and sharding buy and cost, in words (sharding's own: `axes.sharding`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from meshtrain.config import AUTO, LaunchConfig, Layout, ParallelConfig, RunConfig
from meshtrain.models.config_file import ArchitectureConfig
from meshtrain.planner.axes import context, pipeline, tensor
from meshtrain.planner.axes.base import AxisBase, AxisChecks
from meshtrain.planner.axes.expert import expert_degree
from meshtrain.planner.axes.pipeline import pipeline_parallel_degrees
from meshtrain.planner.axes.sharding import (
    SHARDING,
    estimate_sharding_time,
    gathered_bytes,
    sharded_model_states,
    sharding_clause,
    sharding_line,
    sharding_note,
)
from meshtrain.planner.axes.tensor import tensor_parallel_degrees
from meshtrain.planner.candidate import Candidate
from meshtrain.planner.collectives import link, ring
from meshtrain.planner.devices import GIB, DeviceProfile
from meshtrain.planner.layer_memory import layer_matmul_elements
from meshtrain.planner.parameters import local_parameter_count
from meshtrain.planner.shapes import (
    BYTES_BF16,
    BYTES_FP32,
    FP32,
    AxisTime,
    GatherUnits,
    MemoryEstimate,
    MemoryTerms,
    ModelShape,
    StepShape,
    StepTiming,
)
from meshtrain.planner.types import Plan, Refusal, divisors, format_values

# The parameter (and `config.Layout` field) this axis owns; other modules name it here.
PARAMETER = "data_parallel_size"
ZERO_1 = "zero_1"  # the optimizer states sharded over the dp x cp ranks


def check_data_parallel(
    c: Candidate, launch: LaunchConfig, model_config: ArchitectureConfig
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


def check_sharded_data_parallel(c: Candidate) -> tuple[int, list[Refusal]]:
    """The degree N of sharded data parallelism; N must divide data_parallel_size, and
    ZeRO-1 on top of it is refused (it is already included). The search expands `auto`
    into `options.sharding_options` and plans each; a layout planned alone at `auto`
    is not sharded."""
    degree, dp = c.sdp, c.dp
    if degree < 1 or dp % degree:
        works = format_values(divisors(dp))
        return 1, [
            Refusal(
                f"parallel.{SHARDING}",
                degree,
                f"the parameters are sharded over groups of that many of the "
                f"data_parallel_size={dp} ranks, so it must divide {dp}",
                f"Use one of {works} (1: off; {dp}: full sharding).",
            )
        ]
    if degree > 1 and c.choice(ZERO_1):
        return degree, [
            Refusal(
                "parallel.zero_1",
                True,
                f"{SHARDING}={degree} already shards the optimizer "
                "states (and the gradients and parameters) over the data-parallel ranks",
                "Set parallel.zero_1=false (or auto) with sharded data parallelism.",
            )
        ]
    return degree, []


def resolve_zero_1(c: Candidate) -> tuple[bool, list[str]]:
    """Off, with a note, when there is nothing to shard (it shards over the dp x cp ranks,
    which hold the same parameters). At `auto` the search plans it off, and on only where
    memory needs it (`search`)."""
    if c.choice(ZERO_1) and c.dp * c.cp == 1:
        return False, ["parallel.zero_1 has nothing to shard at data_parallel_size=1; off."]
    return c.choice(ZERO_1), []


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

    factor = 1.0 if step.layout.zero_1 else 2.0

    def over_replicas(dense: int, experts: int, factor: float) -> float:
        """The dense part over the dp x cp ranks; ep's experts (their own buffer, 0 at ep 1)
        over the dp x cp / ep ranks holding the same experts, one after the other."""
        seconds = ring(dense, ranks, dp_link, device.latency_us, factor)
        if experts:
            replicas = ranks // expert_degree(step.layout)
            seconds += ring(experts, replicas, dp_link, device.latency_us, factor)
        return seconds

    experts = memory.expert_gradients
    averaging = over_replicas(memory.gradients - experts, experts, factor)
    if overlap_grad_reduce:
        averaging = exposed(averaging, memory.gradients, 2 / 3 * microbatch_compute)
    if not step.layout.zero_1:
        return averaging
    experts = memory.expert_parameters
    gather = over_replicas(memory.parameters - experts, experts, 1.0)
    if overlap_param_gather:
        gather = exposed(gather, memory.parameters, microbatch_compute / 3)
    return averaging + gather


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


def replicated_model_states(
    local: int, step: StepShape, *, activations: int = 0, loss: int = 0, experts: int = 0
) -> MemoryEstimate:
    """The states of a rank holding `local` elements whole: under ZeRO-1 the flat buffer
    padded to a multiple of the dp x cp ranks, each owning the optimizer states of 1/ranks.
    `experts`: of `local`, the experts ep > 1 splits, in a flat buffer of their own that
    ZeRO-1 splits over the dp x cp / ep ranks holding the same experts (0: one buffer)."""
    ranks = step.grad_ranks
    held, owned = _flat_buffer(local - experts, ranks, step.layout.zero_1)
    states = with_model_states(held, owned, step, activations=activations, loss=loss)
    if not experts:
        return states
    replicas = ranks // expert_degree(step.layout)
    mine = with_model_states(*_flat_buffer(experts, replicas, step.layout.zero_1), step)
    return dataclasses.replace(
        states,
        parameters=states.parameters + mine.parameters,
        gradients=states.gradients + mine.gradients,
        optimizer_states=states.optimizer_states + mine.optimizer_states,
        expert_parameters=mine.parameters,
        expert_gradients=mine.gradients,
        expert_optimizer_states=mine.optimizer_states,
    )


def _flat_buffer(elements: int, ranks: int, zero_1: bool) -> tuple[int, int]:
    """(held, owned) elements of a flat buffer: under ZeRO-1 padded to a multiple of the
    `ranks` it is split over, each owning 1/ranks of it; else all of it."""
    if not zero_1:
        return elements, elements
    padded = math.ceil(elements / ranks) * ranks
    return padded, padded // ranks


def lora_model_states(
    base: GatherUnits, trained: GatherUnits, step: StepShape, rank: int = 0
) -> MemoryEstimate:
    """The frozen base's parameters alone (fp32 shards under sharding, else the compute
    dtype: bf16 under bf16 autocast too), and the adapters' full states (`trained`), on
    pipeline rank `rank`."""
    if step.sharded > 1:
        adapters = sharded_model_states(trained.local, step)
        gathered = gathered_bytes(
            step,
            local=base.local,
            layer=base.layer,
            layers=base.layers,
            gradients=False,
            rank=rank,
        ) + gathered_bytes(
            step, local=trained.local, layer=trained.layer, layers=trained.layers, rank=rank
        )
        frozen = math.ceil(base.local / step.shard_ranks) * BYTES_FP32
        return dataclasses.replace(
            adapters, parameters=adapters.parameters + frozen, gathered=gathered
        )
    ranks = step.grad_ranks
    padded = math.ceil(trained.local / ranks) * ranks if step.layout.zero_1 else trained.local
    owned = padded // ranks if step.layout.zero_1 else padded
    adapters = with_model_states(padded, owned, step)
    frozen = base.local * (BYTES_BF16 if step.bf16 else BYTES_FP32)
    return dataclasses.replace(adapters, parameters=adapters.parameters + frozen)


class DataAxis(AxisBase):
    """Data parallelism, ZeRO-1 and sharded data parallelism."""

    name = "data"
    short = "dp"
    time_parts = ("data_parallel_s",)
    parameter = PARAMETER

    def degrees(self, run: RunConfig, model_config: ArchitectureConfig) -> list[int]:
        """None of its own at `auto`: dp is what the other axes leave of the world (the
        search derives it per layout)."""
        return []

    def check(self, c: Candidate, run: RunConfig, model_config: ArchitectureConfig) -> AxisChecks:
        sharded, refusals = check_sharded_data_parallel(c)
        zero_1, notes = resolve_zero_1(c)
        return AxisChecks(
            degree=check_data_parallel(c, run.launch, model_config),
            options=refusals,
            notes=notes,
            layout={
                "data_parallel_size": c.dp,
                "zero_1": zero_1,
                SHARDING: sharded,
            },
        )

    def describe(self, plan: Plan, seq_len: int) -> str | None:
        return sharding_line(plan, self.degree(plan.layout)) if plan.layout.sharded else None

    def settle(
        self, plan: Plan, c: Candidate, budget: float, replan: Callable[[Candidate], Plan]
    ) -> Plan:
        """`zero_1=auto`: the layout without ZeRO-1 where it fits the budget, with it where
        only that makes it fit: its parameter all-gather after every step is not free."""
        if not c.chosen(ZERO_1) or c.dp * c.cp == 1 or c.sdp > 1:  # it shards over dp x cp
            return plan
        need, name = plan.memory_estimate_per_rank["process_total"], plan.layout.name
        if need <= budget:
            note = f"parallel.zero_1=auto: off, {name} fits without it"
            return dataclasses.replace(plan, notes=[*plan.notes, note])
        with_zero_1 = replan(c.with_choice(ZERO_1, True))
        note = (
            f"parallel.zero_1=auto: on, without it {name} needs {_size(need)} per rank, "
            f"over the {_size(budget)} budget; with it "
            f"{_size(with_zero_1.memory_estimate_per_rank['process_total'])}"
        )
        return dataclasses.replace(with_zero_1, notes=[*with_zero_1.notes, note])

    def memory_relief(self, layout: Layout, parallel: ParallelConfig) -> list[str]:
        """ZeRO-1 or sharding, where there are replicas to split the states over."""
        if self.degree(layout) * context.AXIS.degree(layout) == 1 or layout.sharded:
            return []
        changes = []
        if not layout.zero_1 and parallel.zero_1 != AUTO:
            changes.append("ZeRO-1 (parallel.zero_1=true)")
        if getattr(parallel, SHARDING) != AUTO:
            changes.append(
                f"sharded data parallelism (parallel.{SHARDING}=auto, or a divisor of dp)"
            )
        return changes

    def note(self, chosen: Plan, planned: list[Plan], budget: float) -> str | None:
        return sharding_note(chosen, planned, budget, self.degree)

    def lost_clause(self, plan: Plan, planned: list[Plan], budget: float) -> str:
        return sharding_clause(plan, planned, budget, self.degree)

    def memory_terms(self, m: ModelShape, step: StepShape) -> MemoryTerms:
        if step.sharded == 1 or step.pp > 1:
            return MemoryTerms()
        # Inside a layer's backward FSDP2 holds two layers' all-gather buffers (the one
        # running and the one prefetched) beside their gathered parameters (dry runs).
        buffers = 2 * layer_matmul_elements(m, step.tp) * step.parameter_bytes
        return MemoryTerms(backward={"sharding_gather_buffers": buffers})

    def time_terms(
        self,
        m: ModelShape,
        step: StepShape,
        device: DeviceProfile,
        timing: StepTiming,
        earlier: dict[str, float],
    ) -> AxisTime:
        """The gradient averaging (and ZeRO-1's gather), or sharding's collectives."""
        if step.sharded > 1:
            units = timing.units or GatherUnits(0, 0, 0)
            sharding = estimate_sharding_time(
                step, device, units, compute=timing.compute_s, accumulation=timing.accumulation
            )
            return AxisTime({"data_parallel_s": sharding.exposed_s}, sharding.to_dict())
        if step.grad_ranks == 1:
            return AxisTime({"data_parallel_s": 0.0})
        seconds = replicated_dp_time(
            step,
            device,
            timing.memory,
            microbatch_compute=timing.compute_s / timing.microbatches,
            bucket_bytes=timing.bucket_bytes,
            overlap_grad_reduce=timing.overlap_grad_reduce,
            overlap_param_gather=timing.overlap_param_gather,
        )
        return AxisTime({"data_parallel_s": seconds})


def _size(bytes_: float) -> str:
    return f"{bytes_ / GIB:.2f} GiB" if bytes_ >= GIB else f"{bytes_ / 2**20:.1f} MiB"


AXIS = DataAxis()
