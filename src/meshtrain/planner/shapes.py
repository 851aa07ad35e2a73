"""The planner's shapes: what a model and one rank's step look like, and the estimate's
breakdown (bytes, seconds), as every planner module reads and writes them.

A leaf: it imports nothing of the planner, so the memory terms of each parallelism
axis (`planner.axes`) and `planner.memory`, which sums them, can both import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshtrain.config import Layout
from meshtrain.models.llama.parameter_names import HEAD_NORMS
from meshtrain.models.moe_config import (
    expert_intermediate,
    experts_per_token,
    num_experts,
    sparse_layers,
)
from meshtrain.pipeline_schedules import rank_of_stage, stage_ids_of_rank

if TYPE_CHECKING:
    from meshtrain.models.config_file import ArchitectureConfig


BYTES_FP32 = 4
BYTES_BF16 = 2
ADAM_MOMENTS = 2
INT64 = 8


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family model (or its mixture of experts) that memory and time
    depend on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    head_norms: bool = False  # an RMSNorm over each query and key head (Qwen3)
    # A mixture of experts (`models.moe_config`): `sparse_layers` of the decoder layers
    # route each token to `experts_per_token` of their `experts` (each an MLP of
    # `expert_intermediate`) instead of the dense MLP; 0: a dense model.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    sparse_layers: int = 0

    def per_layer(self, dense: float, sparse: float) -> float:
        """A per-layer quantity averaged over the decoder layers: `dense` in the dense ones,
        `sparse` in a mixture of experts' sparse ones."""
        if not self.sparse_layers:
            return dense
        mixed = dense * (self.layers - self.sparse_layers) + sparse * self.sparse_layers
        return mixed / self.layers

    @classmethod
    def from_config(cls, config: ArchitectureConfig) -> ModelShape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            head_norms=getattr(config, "model_type", "") in HEAD_NORMS,
            experts=num_experts(config),
            experts_per_token=experts_per_token(config),
            expert_intermediate=expert_intermediate(config) if num_experts(config) else 0,
            sparse_layers=len(sparse_layers(config)),
        )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank at its peak (the largest over the pipeline stages)."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    loss: int
    pipeline_rank: int = 0
    per_pipeline_rank: tuple[int, ...] = ()
    # Outside the step: what the process holds before the model (libraries, runtime).
    runtime: int = 0
    # What the device's caching allocator reserves beyond the step's tensors (its rounding
    # and fragmentation: the profile's `allocator_share` of `total`).
    allocator: int = 0
    # Sharded data parallelism: parameters gathered for compute and unsharded gradients.
    gathered: int = 0
    # In host memory, not the device's: the saved activations offloading moves there.
    offloaded: int = 0
    # Whether the gradients are alive at the step's peak: not FSDP2's sharded ones, made
    # by the reduce-scatters late in the backward and cleared after the update, while the
    # peak comes at the backward's start (measured by the dry run, docs/dry_run.md).
    gradients_at_peak: bool = True
    # Context parallelism, parts of `activations`: the gathered K/V at the peak and packed
    # examples' attention masks (planner/axes/context.py).
    context_kv: int = 0
    context_mask: int = 0
    # Expert parallelism (ep > 1), parts of the model states: the experts' own flat buffer
    # (planner/axes/expert.py); and of `activations`: the dispatch buffers at the peak.
    expert_parameters: int = 0
    expert_gradients: int = 0
    expert_optimizer_states: int = 0
    expert_dispatch: int = 0
    # DPO with `reference=model`: the frozen copy's weights on this rank.
    reference: int = 0

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total(self) -> int:
        """The step's peak of live tensors (what the memory probe measures)."""
        states = self.model_states - (0 if self.gradients_at_peak else self.gradients)
        return states + self.gathered + self.activations + self.loss + self.reference

    @property
    def process_total(self) -> int:
        """What the rank's process (or device) holds at its peak over the run: the runtime,
        the allocator's share and the step's peak (start-up allocates only the rank's
        shards, one full tensor at a time, and checkpoints stream from the tensors' own
        memory, so neither adds a peak of its own)."""
        return self.runtime + self.allocator + self.total

    def to_dict(self) -> dict[str, int | list[int]]:
        """The breakdown plan.json holds; `gathered` only under sharded data parallelism, the
        experts' parts only under expert parallelism."""
        gathered = {"gathered": self.gathered} if self.gathered else {}
        offloaded = {"offloaded_to_host": self.offloaded} if self.offloaded else {}
        experts = (
            {
                "expert_parameters": self.expert_parameters,
                "expert_gradients": self.expert_gradients,
                "expert_optimizer_states": self.expert_optimizer_states,
            }
            if self.expert_parameters
            else {}
        )
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_states": self.optimizer_states,
            **experts,
            **gathered,
            "activations": self.activations,
            **({"context_kv": self.context_kv} if self.context_kv else {}),
            **({"context_mask": self.context_mask} if self.context_mask else {}),
            **({"expert_dispatch": self.expert_dispatch} if self.expert_dispatch else {}),
            "loss": self.loss,
            "total": self.total,
            "runtime": self.runtime,
            **({"allocator": self.allocator} if self.allocator else {}),
            "process_total": self.process_total,
            "peak_pipeline_rank": self.pipeline_rank,
            "total_per_pipeline_rank": list(self.per_pipeline_rank),
            **offloaded,
        }


@dataclass(frozen=True)
class StepShape:
    """What one rank runs per optimizer step.

    Its fields are what several planner modules compose (degrees, batch, precision, the
    pipeline's cut); an option only its own axis weighs (ZeRO-1) is read from `layout`,
    the plan's resolved layout, so that an axis's options need no field here."""

    layout: Layout
    dp: int
    tp: int
    pp: int
    sequence_parallel: bool
    activation_checkpointing: str
    activation_offloading: bool
    microbatch_size: int  # sequences per forward (the per-device batch / pp microbatches)
    microbatches: int  # per pipeline schedule step (1 without pp)
    schedule: str
    virtual_stages: int
    stage_layers: tuple[int, ...]  # decoder layers of each stage, in order
    seq_len: int
    bf16: bool = False  # matmuls in bf16 (autocast, or bf16 parameters)
    offload_effective: bool = False  # activations really leave the device (accelerators)
    master_weights: bool = False  # bf16 parameters and activations, fp32 master in AdamW
    grad_reduce_bf16: bool = False  # bf16 gradients (only with master_weights)
    sharded: int = 1  # sharded data parallel degree N (1: off; dp: full; else hybrid)
    converters: tuple[str, ...] = ()  # the run's model converters (`models/converters.py`)
    # LoRA: the base is frozen (no gradients, no optimizer states; held in the compute
    # dtype). Per token and decoder layer, what the adapters keep (their inputs' dropout
    # copies and masks, their rank-r intermediates), in bytes, and the matmul-side
    # elements a frozen layer without an adapter no longer keeps (a frozen weight's
    # product needs no saved input).
    frozen_base: bool = False
    adapter_bytes_per_token: float = 0.0
    unsaved_elements: float = 0.0
    # A LoRA run's merged expert weights per decoder layer (`planner.lora_memory`).
    merged_weight_bytes: float = 0.0
    # Bytes per token the embedding's and the head's adapters keep (first, last stage).
    vocabulary_adapter_bytes: tuple[float, float] = (0.0, 0.0)
    # The loss over chunks of this many tokens (0: over the whole logits; planner/loss_memory).
    loss_chunk_tokens: int = 0
    # DPO (`training.objective=dpo`): its reference as resolved (model, precompute, base);
    # "": the language-model loss.
    preference_reference: str = ""
    # Context parallelism: each row's tokens split over `cp` ranks holding the same
    # parameters; `packed`: packed examples, whose attention masks are made per row;
    # `cp_fused_backward`: the CPU's, which gathers K/V again instead of keeping them.
    cp: int = 1
    packed: bool = False
    cp_fused_backward: bool = False
    # Under expert parallelism, the busiest rank's dispatched rows over the mean.
    moe_imbalance: float = 1.25
    # Forwards and backwards per optimizer step on the rank, outside a pipeline's own.
    accumulation: int = 1

    def stages_of(self, rank: int) -> list[int]:
        """The pipeline stages pipeline rank `rank` holds (the schedule's placement)."""
        return stage_ids_of_rank(rank, self.pp, self.schedule, self.virtual_stages)

    @property
    def last_stage_rank(self) -> int:
        """The pipeline rank holding the last stage (the LM head)."""
        return rank_of_stage(len(self.stage_layers) - 1, self.pp, self.schedule)

    @property
    def local_seq_len(self) -> int:
        """Tokens of each row this rank holds."""
        return self.seq_len // self.cp

    @property
    def grad_ranks(self) -> int:
        """Ranks holding the same parameters, whose gradients are averaged and over which
        ZeRO-1 shards: dp x cp."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks FSDP2 shards one model copy over: sharded x cp (1: not sharded)."""
        return self.sharded * self.cp if self.sharded > 1 else 1

    @property
    def parameter_bytes(self) -> int:
        """The compute dtype's bytes (under sharding: of the gathered parameters)."""
        return BYTES_BF16 if self.master_weights else BYTES_FP32

    @property
    def gradient_bytes(self) -> int:
        return BYTES_BF16 if self.grad_reduce_bf16 else BYTES_FP32

    @property
    def optimizer_bytes(self) -> int:
        """Per owned element: AdamW's moments, the fp32 master, its fp32 gradient copy
        (under sharding only the moments: the fp32 shard is its own master and gradient)."""
        if self.sharded > 1:
            return BYTES_FP32 * ADAM_MOMENTS
        master = BYTES_FP32 if self.master_weights else 0
        gradient_copy = BYTES_FP32 if self.grad_reduce_bf16 else 0
        return BYTES_FP32 * ADAM_MOMENTS + master + gradient_copy


@dataclass(frozen=True)
class GatherUnits:
    """What FSDP2 gathers and reduces on the busiest pipeline rank, in local elements."""

    local: int  # all the rank's parameters
    layer: int  # one decoder layer's
    layers: int  # decoder layers on the rank

    @property
    def root(self) -> int:
        """The root group: embedding, final norm, LM head (those on the rank's stages)."""
        return self.local - self.layer * self.layers


FP32 = StepShape(
    layout=Layout.one_process(),
    dp=1,
    tp=1,
    pp=1,
    sequence_parallel=False,
    activation_checkpointing="none",
    activation_offloading=False,
    microbatch_size=1,
    microbatches=1,
    schedule="none",
    virtual_stages=1,
    stage_layers=(1,),
    seq_len=1,
)


@dataclass(frozen=True)
class ShardingTime:
    """Sharded data parallelism's collectives in one optimizer step, in seconds."""

    all_gather_per_layer_s: float
    reduce_scatter_per_layer_s: float
    rounds: int  # gather/reduce rounds per step: microbatches (no pp) or schedule steps (pp)
    all_gather_s: float
    reduce_scatter_s: float
    replica_all_reduce_s: float  # hybrid sharding only
    exposed_s: float

    @property
    def total_s(self) -> float:
        return self.all_gather_s + self.reduce_scatter_s + self.replica_all_reduce_s

    @property
    def overlapped_share(self) -> float:
        """The share of the collectives' time hidden behind compute."""
        return 1.0 - self.exposed_s / self.total_s if self.total_s else 1.0

    def to_dict(self) -> dict[str, float]:
        return {
            "sdp_all_gather_per_layer_s": self.all_gather_per_layer_s,
            "sdp_reduce_scatter_per_layer_s": self.reduce_scatter_per_layer_s,
            "sdp_rounds_per_step": float(self.rounds),
            "sdp_all_gather_s": self.all_gather_s,
            "sdp_reduce_scatter_s": self.reduce_scatter_s,
            "sdp_replica_all_reduce_s": self.replica_all_reduce_s,
            "sdp_exposed_s": self.exposed_s,
            "sdp_overlapped_share": self.overlapped_share,
        }


@dataclass(frozen=True)
class ContextTime:
    """Context parallelism's K/V exchange in one optimizer step, in seconds (cp > 1)."""

    all_gather_per_layer_s: float  # one layer's K and V, one microbatch
    reduce_scatter_per_layer_s: float  # their gradient
    gathers_per_layer: int  # forward, full checkpointing's recomputation, CPU's backward
    exchanges_per_step: int  # layers on the busiest rank x microbatches x passes
    total_s: float  # all exposed: the exchange runs right before attention, synchronously
    attention_share: float  # of the rank's compute, the attention scores' part

    def to_dict(self) -> dict[str, float]:
        return {
            "context_parallel_s": self.total_s,
            "cp_kv_all_gather_per_layer_s": self.all_gather_per_layer_s,
            "cp_kv_reduce_scatter_per_layer_s": self.reduce_scatter_per_layer_s,
            "cp_kv_all_gathers_per_layer": float(self.gathers_per_layer),
            "cp_exchanges_per_step": float(self.exchanges_per_step),
            "cp_overlapped_share": 0.0,
            "cp_attention_share": self.attention_share,
        }


@dataclass(frozen=True)
class StepTiming:
    """What the axes' time terms read beside the step's shape: the step's compute on the
    busiest pipeline rank, the forwards it runs, its estimate's bytes and the run's
    overlap settings (`units`: what sharded data parallelism gathers, when it is on)."""

    compute_s: float
    microbatches: int  # forwards per step per rank
    accumulation: int
    activation_bytes: float  # one microbatch's hidden states on this rank
    shares: tuple[float, ...]  # each pipeline rank's share of the model's compute
    memory: MemoryEstimate
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    bucket_bytes: float
    units: GatherUnits | None = None


@dataclass(frozen=True)
class MemoryTerms:
    """One axis's extra bytes in a rank's activations, named, by how often they are held:
    per decoder layer and microbatch (`layer`, saved with the layer's activations), once
    per microbatch in flight (`microbatch`, shared by the layers), and transiently inside
    one layer's backward (`backward`, part of its working set)."""

    layer: dict[str, float] = field(default_factory=dict)
    microbatch: dict[str, int] = field(default_factory=dict)
    backward: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class AxisTime:
    """One axis's seconds in a step: its parts, which the step adds up (plan.json writes a
    part before `optimizer_s` unless the axis's `report` holds it), and its breakdown,
    written after `step_s`."""

    seconds: dict[str, float]
    report: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds of one optimizer step: compute, the optimizer, and each axis's parts."""

    compute_s: float
    optimizer_s: float
    axes: tuple[AxisTime, ...] = ()

    @property
    def parts(self) -> dict[str, float]:
        """Every axis's seconds by name, in the registry's order."""
        return {k: v for a in self.axes for k, v in a.seconds.items()}

    @property
    def step_s(self) -> float:
        """The parts added one by one in the order plan.json writes them."""
        total = 0.0
        for seconds in self.to_dict(with_step=False).values():
            total += seconds  # not sum(): it compensates, and the order is the estimate's
        return total

    def to_dict(self, *, with_step: bool = True) -> dict[str, float]:
        """plan.json's `time_estimate` (`with_step=False`: only the parts, which `step_s`
        adds: the reports' other entries are breakdowns, not parts)."""
        parts = self.parts
        reported = {k: v for a in self.axes for k, v in a.report.items()}
        headline = {k: v for k, v in parts.items() if k not in reported}
        if not with_step:
            late = {k: v for k, v in reported.items() if k in parts}
            return {"compute_s": self.compute_s, **headline, "optimizer_s": self.optimizer_s} | late
        return {
            "compute_s": self.compute_s,
            **headline,
            "optimizer_s": self.optimizer_s,
            "step_s": self.step_s,
            **reported,
        }
