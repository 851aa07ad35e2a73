"""Tensor parallelism (tp) and sequence parallelism over its ranks: the degrees the
model's heads allow, their checks and refusals, and sequence parallelism's resolution.
"""

from __future__ import annotations

from meshtrain.config import RunConfig
from meshtrain.distributed.kv_heads import kv_replication_factor
from meshtrain.models.config_file import ArchitectureConfig
from meshtrain.planner.axes import context
from meshtrain.planner.axes.base import AxisBase, AxisChecks
from meshtrain.planner.candidate import Candidate
from meshtrain.planner.collectives import link, ring
from meshtrain.planner.devices import DeviceProfile
from meshtrain.planner.parameters import tensor_parallel_numel
from meshtrain.planner.shapes import AxisTime, ModelShape, StepShape, StepTiming
from meshtrain.planner.types import Refusal, divisors, format_values

# The parameter (and `config.Layout` field) this axis owns; other modules name it here.
PARAMETER = "tensor_parallel_size"


def tensor_parallel_degrees(world: int, model_config: ArchitectureConfig) -> list[int]:
    """tp degrees the model and this engine accept: they divide the world and the attention
    heads, and the KV heads divide tp or tp divides them (then KV heads are replicated)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    return [
        d for d in divisors(world) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)
    ]


def check_tensor_parallel(tp: int, world: int, model_config: ArchitectureConfig) -> list[Refusal]:
    tp_ok = tensor_parallel_degrees(world, model_config)
    if tp in tp_ok:
        return []
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    why = []
    if heads % tp:
        why.append(f"it must divide num_attention_heads={heads}")
    if kv_heads % tp and tp % kv_heads:
        why.append(
            f"it must divide num_key_value_heads={kv_heads} or be a multiple of it "
            "(then each KV head is replicated)"
        )
    if world % tp:
        why.append(f"it must divide the world size {world}")
    return [
        Refusal(
            "parallel.tensor_parallel_size",
            tp,
            "; ".join(why) or "this degree is not supported",
            f"Values that work here: {format_values(tp_ok)}.",
        )
    ]


def check_sequence_parallel(c: Candidate, block_size: int) -> list[Refusal]:
    """Sequence parallelism needs tp ranks to shard over, and a rank's share of each
    block (block / cp tokens) must split over them."""
    refusals: list[Refusal] = []
    tp, cp, sequence_parallel = c.tp, c.cp, c.choice("sequence_parallel")
    if sequence_parallel and tp == 1:
        chosen = " (the only size auto can choose here)" if c.chosen("tp") else ""
        refusals.append(
            Refusal(
                "parallel.sequence_parallel",
                True,
                f"it needs parallel.tensor_parallel_size > 1, and that is 1{chosen}: "
                "sequence parallelism shards activations over the tensor-parallel ranks",
                "Use sequence_parallel=auto (on whenever tp > 1) or false, or "
                "parallel.tensor_parallel_size=2 or more.",
            )
        )
    step = tp * cp  # under cp each rank's block / cp tokens are split over tp
    if sequence_parallel and block_size % step and (cp == 1 or block_size % (2 * cp) == 0):
        over = f" x {context.PARAMETER}={cp}" if cp > 1 else ""
        refusals.append(
            Refusal(
                "data.block_size",
                block_size,
                f"sequence parallelism splits each block over tensor_parallel_size={tp}{over} "
                "ranks",
                f"Use a block size divisible by {step} (e.g. "
                f"{block_size - block_size % step or step}), "
                "or parallel.sequence_parallel=false.",
            )
        )
    return refusals


def tensor_parallel_time(
    m: ModelShape,
    step: StepShape,
    device: DeviceProfile,
    *,
    activation_bytes: float,
    microbatches: int,
) -> float:
    """Seconds of tp's collectives in one step: per layer and microbatch four all-reduce-
    sized collectives of the activations (two forward, two backward; all-gathers and
    reduce-scatters under sequence parallelism, the same bytes), plus the embedding's and
    the vocabulary-parallel head's."""
    tp_link = link(device, step.tp)
    layers_per_rank = m.layers / step.pp
    per_microbatch = (4 * layers_per_rank + 2) * ring(
        activation_bytes, step.tp, tp_link, device.latency_us, 2.0
    )
    return per_microbatch * microbatches


class TensorAxis(AxisBase):
    """Tensor parallelism and sequence parallelism over its ranks."""

    name = "tensor"
    short = "tp"
    time_parts = ("tensor_parallel_s",)
    parameter = PARAMETER
    splits_model = True

    def degrees(self, run: RunConfig, model_config: ArchitectureConfig) -> list[int]:
        return tensor_parallel_degrees(run.launch.world_size, model_config)

    def check(self, c: Candidate, run: RunConfig, model_config: ArchitectureConfig) -> AxisChecks:
        return AxisChecks(
            degree=check_tensor_parallel(c.tp, run.launch.world_size, model_config),
            options=check_sequence_parallel(c, run.data.block_size),
            layout={
                "tensor_parallel_size": c.tp,
                "sequence_parallel": c.choice("sequence_parallel"),
            },
        )

    def local_numel(self, name: str, numel: int, m: ModelShape, step: StepShape) -> int:
        return tensor_parallel_numel(
            name, numel, step.tp, kv_replication_factor(m.kv_heads, step.tp)
        )

    def time_terms(
        self,
        m: ModelShape,
        step: StepShape,
        device: DeviceProfile,
        timing: StepTiming,
        earlier: dict[str, float],
    ) -> AxisTime:
        seconds = tensor_parallel_time(
            m,
            step,
            device,
            activation_bytes=timing.activation_bytes,
            microbatches=timing.microbatches,
        )
        return AxisTime({"tensor_parallel_s": seconds})


AXIS = TensorAxis()
