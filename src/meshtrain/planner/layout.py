"""Plan one layout: run every check, refuse it with all their reasons, or estimate it.

`meshtrain.planner.search` calls this once per `Candidate` it weighs (every `auto`
already resolved); each axis of `planner.axes.AXES` and the run-wide checks run before
any refusal is raised, so one run of the planner reports every problem.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtrain.config import Layout, RunConfig
from meshtrain.models.config_file import ArchitectureConfig
from meshtrain.models.converters import converter_names
from meshtrain.planner.axes import AXES, local_share
from meshtrain.planner.axes.expert import expert_degree
from meshtrain.planner.candidate import Candidate
from meshtrain.planner.checks import (
    check_activation_checkpointing,
    check_batch_vs_data,
    check_experts_beside_tensor_parallelism,
    check_model_vs_data,
    check_routing,
    global_batch_size,
)
from meshtrain.planner.cost import estimate_step_time
from meshtrain.planner.devices import DeviceProfile
from meshtrain.planner.flops import model_flops_per_token
from meshtrain.planner.lora_memory import (
    lora_activation_terms,
    merged_weight_bytes,
    vocabulary_adapter_bytes,
)
from meshtrain.planner.memory import estimate_memory
from meshtrain.planner.parameters import ParameterShapes, gather_units
from meshtrain.planner.shapes import BYTES_BF16, BYTES_FP32, ModelShape, StepShape
from meshtrain.planner.types import LayoutError, Plan, Refusal


@dataclass(frozen=True)
class PlanContext:
    """What every layout of one planner run is weighed against (the model, the data, the
    machine): built once by `plan_run` and handed down whole, so that a new fact about
    the run is added here rather than threaded through each function as a keyword."""

    model_config: ArchitectureConfig
    shapes: ParameterShapes  # every parameter's shape (`llama_family_shapes`)
    # A LoRA run's adapters (their Hugging Face shapes; empty: full fine-tuning).
    adapter_shapes: ParameterShapes
    num_train_blocks: int
    num_validation_blocks: int
    tokenizer_size: int | None
    cuda: bool
    cuda_devices: int
    device: DeviceProfile
    # The run's own `auto`s, resolved once by the search: the backend (and its refusals,
    # reported with every layout's) and whether the blocks hold packed examples.
    backend: str
    backend_refusals: list[Refusal]
    packed: bool


def plan_one_layout(run: RunConfig, candidate: Candidate, context: PlanContext) -> Plan:
    """Validate one candidate layout of `run` and estimate its memory and step time."""
    layout, backend, notes = resolve_layout(run, candidate, context)
    model_config, shapes, device = context.model_config, context.shapes, context.device
    train, block_size = run.training, run.data.block_size
    shape = ModelShape.from_config(model_config)
    step = _step_shape(run, candidate, layout, context)
    adapters = context.adapter_shapes
    tensors = estimate_memory(shapes, shape, step, adapters)
    memory = dataclasses.replace(
        tensors,
        runtime=device.runtime_bytes,
        allocator=int(tensors.total * device.allocator_share),
    )
    time_estimate = estimate_step_time(
        shape,
        step,
        device,
        accumulation=train.gradient_accumulation_steps,
        memory=memory,
        overlap_grad_reduce=train.overlap_grad_reduce,
        overlap_param_gather=train.gathers_under_forward,
        bucket_bytes=train.grad_bucket_mb * 2**20,
        units=gather_units(shapes, shape, step, local_share(shape, step), adapters)
        if step.sharded > 1
        else None,
    )
    if layout.activation_offloading and device.name == "cpu":
        notes.append(
            "parallel.activation_offloading has no effect on CPU (activations already live in "
            "host memory); it is kept for accelerators."
        )
    global_batch = global_batch_size(train, candidate.dp)
    return Plan(
        layout=layout,
        world_size=run.launch.world_size,
        backend=backend,
        global_batch_size=global_batch,
        tokens_per_step=global_batch * block_size,
        num_parameters=shapes.numel,
        num_trainable_parameters=(adapters or shapes).numel,
        memory_estimate_per_rank=memory.to_dict(),
        model_config=model_config.to_dict(),
        num_train_blocks=context.num_train_blocks,
        num_validation_blocks=context.num_validation_blocks,
        notes=notes,
        device=device.name,
        per_device_train_batch_size=train.per_device_train_batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        time_estimate={
            **time_estimate.to_dict(),
            "tokens_per_s": global_batch * block_size / time_estimate.step_s,
        },
        model_flops_per_token=model_flops_per_token(
            shape, block_size, frozen_base=step.frozen_base
        ),
        peak_tflops_per_rank=device.peak_tflops(step.bf16),
    )


def resolve_layout(
    run: RunConfig, c: Candidate, context: PlanContext
) -> tuple[Layout, str, list[str]]:
    """The layout, its backend and the notes; every check runs, then all refusals are raised
    (each axis's degree first, then the pipeline's split, then each axis's options)."""
    model_config, train = context.model_config, run.training
    checks = [axis.check(c, run, model_config) for axis in AXES]
    refusals = [r for found in checks for r in found.degree]
    refusals += [r for found in checks for r in found.split]
    refusals += [r for found in checks for r in found.options]
    notes = [note for found in checks for note in found.notes]
    refusals += check_activation_checkpointing(c.activation_checkpointing)
    refusals += check_experts_beside_tensor_parallelism(
        model_config, c.tp, c.choice("sequence_parallel")
    )
    refusals += check_routing(model_config)
    found, found_notes = check_batch_vs_data(
        train,
        c.dp,
        num_train_blocks=context.num_train_blocks,
        num_validation_blocks=context.num_validation_blocks,
    )
    refusals += found
    notes += found_notes
    refusals += check_model_vs_data(run.data, model_config, context.tokenizer_size)
    refusals += context.backend_refusals
    if refusals:
        raise LayoutError(refusals)
    fields = {name: value for found in checks for name, value in found.layout.items()}
    layout = Layout(
        **fields,
        activation_checkpointing=c.activation_checkpointing,
        activation_offloading=run.parallel.activation_offloading,
        lora_rank=lora.r if (lora := run.model.lora) else 0,
        loss_chunk_tokens=c.loss_chunk_tokens,
    )
    return layout, context.backend, notes


def _step_shape(run: RunConfig, c: Candidate, layout: Layout, context: PlanContext) -> StepShape:
    """What one rank runs per step under `layout`, as the memory and time models read it
    (with LoRA's frozen base and adapters)."""
    step = _layout_step_shape(run, c, layout, context)
    lora = run.model.lora
    if lora is None:
        return step
    adapter_bytes, unsaved = lora_activation_terms(
        context.adapter_shapes,
        ModelShape.from_config(context.model_config),
        tp=step.tp,
        dropout=lora.lora_dropout > 0,
        value_bytes=step.parameter_bytes,
        mask_bytes=step.parameter_bytes if context.device.name == "cpu" else 1,
    )
    vocabulary = vocabulary_adapter_bytes(
        context.adapter_shapes,
        ModelShape.from_config(context.model_config),
        chunked_loss=layout.loss_chunk_tokens > 0,
        dropout=lora.lora_dropout > 0,
        value_bytes=step.parameter_bytes,
        mask_bytes=step.parameter_bytes if context.device.name == "cpu" else 1,
    )
    merged = merged_weight_bytes(
        context.adapter_shapes,
        context.model_config.num_hidden_layers,
        ep=expert_degree(layout),
        value_bytes=BYTES_BF16 if step.bf16 else BYTES_FP32,
    )
    return dataclasses.replace(
        step,
        frozen_base=True,
        adapter_bytes_per_token=adapter_bytes,
        unsaved_elements=unsaved,
        merged_weight_bytes=merged,
        vocabulary_adapter_bytes=vocabulary,
    )


def preference_reference(run: RunConfig) -> str:
    """DPO's reference as the engine resolves it; "" for the language-model loss."""
    training = run.training
    if training.objective != "dpo":
        return ""
    return training.dpo.resolved_reference(lora=run.model.lora is not None)


def _layout_step_shape(
    run: RunConfig, c: Candidate, layout: Layout, context: PlanContext
) -> StepShape:
    """The candidate's degrees, with what the axes resolved from them (`layout`)."""
    pp, microbatches = c.pp, layout.pipeline_parallel_num_microbatches
    return StepShape(
        layout=layout,
        dp=c.dp,
        tp=c.tp,
        pp=pp,
        sequence_parallel=layout.sequence_parallel,
        activation_checkpointing=layout.activation_checkpointing,
        activation_offloading=layout.activation_offloading,
        microbatch_size=run.training.per_device_train_batch_size // microbatches,
        microbatches=microbatches,
        schedule=layout.pipeline_schedule if pp > 1 else "none",
        virtual_stages=layout.pipeline_parallel_virtual_stages,
        stage_layers=tuple(
            layout.pipeline_parallel_layers or [context.model_config.num_hidden_layers]
        ),
        seq_len=run.data.block_size,
        bf16=run.training.mixed_precision in ("bf16", "bf16_master"),
        master_weights=run.training.mixed_precision == "bf16_master",
        grad_reduce_bf16=run.training.grad_reduce_dtype == "bf16",
        offload_effective=layout.activation_offloading and context.device.name != "cpu",
        sharded=c.sdp,
        loss_chunk_tokens=layout.loss_chunk_tokens,
        preference_reference=preference_reference(run),
        cp=c.cp,
        packed=context.packed,
        # The engine's fused CPU backward (distributed/gathered_attention.py).
        cp_fused_backward=context.device.name == "cpu",
        moe_imbalance=run.planner.moe_imbalance,
        accumulation=run.training.gradient_accumulation_steps,
        # The profile times the layers a converter runs on that converter's table.
        converters=converter_names(
            run.training, on_cpu=context.device.name == "cpu", tensor_parallel=c.tp > 1
        ),
    )
