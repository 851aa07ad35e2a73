"""Apply a layout to one rank's Llama-family model, in one fixed order for every layout.

On the meta device, the model goes through the run's converters, is split into
this rank's pipeline stages (each built knowing its tp mesh and which of its
weights are tied copies), and each stage is then sharded for tensor / sequence
parallelism, given its share of the experts (expert parallelism), activation
checkpointing, compiled and wrapped by FSDP2, in
that order (torchtitan's); only then are this rank's shards allocated and filled,
and the runtime that drives them (`ParallelModel`) built. The flat buffer of
plain data parallelism and ZeRO-1 comes after, with the optimizer
(`meshtrain.components.optimizer`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import PretrainedConfig

from meshtrain.config import Layout
from meshtrain.device import compile_backend
from meshtrain.distributed.activation_checkpoint import (
    apply_activation_checkpointing,
    offload_context,
)
from meshtrain.distributed.context_parallel import ContextParallel
from meshtrain.distributed.expert_parallel import shard_experts
from meshtrain.distributed.fsdp import apply_fully_shard, shard_experts_data_parallel
from meshtrain.distributed.kv_heads import kv_replication_factor
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.pipeline_parallel import (
    PipelineRunner,
    SharedWeightSync,
    stage_layer_ranges,
)
from meshtrain.distributed.tensor_parallel import (
    ParameterSharding,
    TensorParallelGradSync,
    unsharded,
)
from meshtrain.models.converters import ModelConverter
from meshtrain.models.head_loss import score_in_chunks
from meshtrain.models.llama.parameter_names import EMBEDDING, LM_HEAD, stored_name
from meshtrain.models.llama.stage import LlamaStage, WholeModel
from meshtrain.models.llama.tensor_parallel import apply_tensor_parallel, decoder_layers
from meshtrain.models.llama.weights import WeightSource, materialize
from meshtrain.models.parallel_model import ParallelModel
from meshtrain.pipeline_schedules import ZERO_BUBBLE, last_stage_rank, stage_ids_of_rank


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    layout: Layout,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager],
    *,
    weights: WeightSource | None = None,
    compile_layers: bool = False,
    converters: Sequence[ModelConverter] = (),
    converted: bool = False,
    fsdp_policy: MixedPrecisionPolicy | None = None,
) -> ParallelModel:
    """Apply the layout to a model built identically on every rank: converters, pipeline
    stages, then per stage TP -> activation checkpointing -> compile -> FSDP, then the
    weights, then the runtime.

    `weights`: the model is on the meta device; once it is cut into this rank's stages
    and shards, only those are allocated on `device` and filled from `weights`
    (without, the model already holds its weights, on `device`).
    `compile_layers`: torch.compile every decoder layer in place (parameter names, and
    so checkpoints, stay those of the Hugging Face model).
    `converters`: the run's model converters (`models.converters`), applied first
    (`converted`: they already converted `model`; their weights still apply).
    `fsdp_policy`: FSDP2's mixed precision under sharded data parallelism (its default,
    no dtype change, when None).
    """
    for converter in converters:
        if not converted:
            converter.convert(model)
        if weights is not None:
            weights = converter.weights(weights)  # with what the converter added (adapters)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    splits_backward = layout.pipeline_parallel_size > 1 and layout.pipeline_schedule in ZERO_BUBBLE
    score_in_chunks(model.lm_head, layout.loss_chunk_tokens, backward_twice=splits_backward)
    stage_ids, modules = pipeline_stages(model, dims, layout)
    tied = tied_embedding_names(model.config, modules, dims)
    kv_replication = (
        kv_replication_factor(model.config.num_key_value_heads, dims.tp) if dims.tp > 1 else 1
    )
    sharding = shard_tensor_parallel(modules, dims, layout, kv_replication, tied=tied)
    if dims.ep > 1:
        sharding = shard_experts(modules, sharding, dims.ep_group, dims.ep_rank)
    keep_frozen(modules, frozen)
    saved_ops = frozenset().union(*(converter.saved_ops for converter in converters))
    apply_activation_checkpointing(model, layout.activation_checkpointing, saved_ops)
    if compile_layers:
        compile_decoder_layers(modules, compile_backend(device))
    if layout.sharded:
        shard_data_parallel(modules, dims, layout, fsdp_policy or MixedPrecisionPolicy())
    if weights is not None:
        materialize(
            modules,
            sharding,
            weights,
            device,
            tp_rank=dims.tp_rank,
            tp=dims.tp,
            dp_shard=dims.fsdp_shards()[:2],
            expert_shard=dims.fsdp_shards(experts=True)[:2],
        )
    return _runtime(
        model.config,
        modules,
        stage_ids,
        sharding,
        dims,
        layout,
        device,
        autocast=autocast,
        tied=tied,
        tied_trained=_tied(model.config) and EMBEDDING not in frozen,
        kv_replication=kv_replication,
    )


def _runtime(
    config: PretrainedConfig,
    modules: list[nn.Module],
    stage_ids: list[int],
    sharding: dict[str, ParameterSharding],
    dims: ParallelDims,
    layout: Layout,
    device: torch.device,
    *,
    autocast: Callable[[], AbstractContextManager],
    tied: frozenset[str],
    tied_trained: bool,
    kv_replication: int,
) -> ParallelModel:
    """What drives the parallelised stages: the gradient sums the backward leaves to do
    (tensor parallelism's, the tied copies'), the pipeline schedule, the loss. Only the
    trained parameters are the optimizer's and the checkpoint's (a LoRA run's adapters).
    `tied`: this rank's copies of a tied embedding; `tied_trained`: whether the tied
    embedding trains (not under LoRA), the same on every rank."""
    parameters = {n: p for m in modules for n, p in m.named_parameters() if p.requires_grad}
    sharding = {n: spec for n, spec in sharding.items() if n in parameters}
    tp_sync = (
        TensorParallelGradSync(parameters, sharding, dims.mesh, kv_replication)
        if dims.tp > 1
        else None
    )
    copies = {name: parameters[name] for name in tied if tied_trained}
    return ParallelModel(
        modules=modules,
        parameters=parameters,
        sharding=sharding,
        hf_config=config,
        dims=dims,
        layout=layout,
        autocast=autocast,
        tp_sync=tp_sync,
        runner=pipeline_runner(modules, stage_ids, dims, layout, device) if dims.pp > 1 else None,
        offload=offload_context(layout.activation_offloading, device),
        # A frozen tied embedding (LoRA) has no gradient to sum: every rank knows it alike.
        shared_sync=shared_weight_sync(copies, dims, layout) if tied_trained else None,
        tied_copies=stored_elsewhere(parameters, config),
        context=context_of(dims),
    )


def shared_weight_sync(
    copies: dict[str, torch.Tensor], dims: ParallelDims, layout: Layout
) -> SharedWeightSync | None:
    """The sum of a tied embedding's two copies' gradients (pipeline stages only)."""
    if dims.pp == 1:
        return None
    return SharedWeightSync(copies, dims.mesh, last_stage_rank(dims.pp, layout.pipeline_schedule))


def keep_frozen(modules: list[nn.Module], frozen: set[str]) -> None:
    """Freeze `frozen` again: DTensor's SequenceParallel style makes new parameters of the
    norms without carrying `requires_grad` over."""
    for module in modules:
        for name, parameter in module.named_parameters():
            if name in frozen:
                parameter.requires_grad_(False)


def compile_decoder_layers(modules: list[nn.Module], backend: str) -> None:
    """torch.compile every decoder layer in place with the device's compile backend."""
    for module in modules:
        for _, layer in decoder_layers(module):
            layer.compile(backend=backend)


def shard_data_parallel(
    modules: list[nn.Module], dims: ParallelDims, layout: Layout, policy: MixedPrecisionPolicy
) -> None:
    """FSDP2 over each stage: without a pipeline the layers are resharded after their
    forward (ZeRO-3); with one they stay gathered through the step's microbatches."""
    for module in modules:
        layers = [layer for _, layer in decoder_layers(module)]
        if dims.ep > 1:
            shard_experts_data_parallel(
                module, dims, reshard_after_forward=dims.pp == 1, policy=policy
            )
        apply_fully_shard(module, layers, dims, reshard_after_forward=dims.pp == 1, policy=policy)


def stored_elsewhere(
    parameters: dict[str, torch.Tensor], config: PretrainedConfig
) -> dict[str, str]:
    """This rank's parameters that checkpoints store under another name (the last stage's
    copy of a tied embedding) -> that name."""
    names = {name: stored_name(name, config) for name in parameters}
    return {name: stored for name, stored in names.items() if stored != name}


def _tied(config: PretrainedConfig) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def tied_embedding_names(
    config: PretrainedConfig, modules: list[nn.Module], dims: ParallelDims
) -> frozenset[str]:
    """With tied embeddings cut over pipeline stages, this rank's copies of the one weight:
    the embedding on the first stage, the LM head on the last, none in between (nor
    without a pipeline, or with untied embeddings)."""
    if dims.pp == 1 or not _tied(config):
        return frozenset()
    names = {name for module in modules for name, _ in module.named_parameters()}
    return frozenset(name for name in (EMBEDDING, LM_HEAD) if name in names)


def pipeline_stages(
    model: nn.Module, dims: ParallelDims, layout: Layout
) -> tuple[list[int], list[nn.Module]]:
    """This rank's stage ids and modules (the whole model, id-less, without pp)."""
    context = context_of(dims)
    if dims.pp == 1:
        return [], [WholeModel(model, context)]
    stage_ids = stage_ids_of_rank(
        dims.pp_rank, dims.pp, layout.pipeline_schedule, layout.pipeline_parallel_virtual_stages
    )
    ranges = stage_layer_ranges(layout.pipeline_parallel_layers)
    last = layout.num_stages - 1
    tp_mesh = dims.mesh["tp"] if dims.tp > 1 else None
    modules = [
        LlamaStage(
            model,
            ranges[i],
            is_first=i == 0,
            is_last=i == last,
            tp_mesh=tp_mesh,
            sequence_parallel=layout.sequence_parallel,
            context=context,
        )
        for i in stage_ids
    ]
    return stage_ids, modules


def context_of(dims: ParallelDims) -> ContextParallel | None:
    """This rank's place in its context-parallel group (None: cp is off)."""
    if dims.cp == 1:
        return None
    return ContextParallel(dims.cp_group, dims.cp, dims.cp_rank)


def shard_tensor_parallel(
    modules: list[nn.Module],
    dims: ParallelDims,
    layout: Layout,
    kv_replication: int,
    *,
    tied: frozenset[str] = frozenset(),
) -> dict[str, ParameterSharding]:
    """Shard every stage over the tp mesh (in place); each parameter's sharding by name,
    a tied copy counting half in the gradient norm (the weight counts once)."""
    sharding: dict[str, ParameterSharding] = {}
    for module in modules:
        if dims.tp == 1:
            sharding.update(unsharded(module))
            continue
        sharding.update(
            apply_tensor_parallel(
                module,
                dims.mesh["tp"],
                sequence_parallel=layout.sequence_parallel,
                kv_replication=kv_replication,
            )
        )
    for name in tied:
        sharding[name] = dataclasses.replace(sharding[name], copies=sharding[name].copies * 2)
    return sharding


def pipeline_runner(
    modules: list[nn.Module],
    stage_ids: list[int],
    dims: ParallelDims,
    layout: Layout,
    device: torch.device,
) -> PipelineRunner:
    """The schedule over this rank's stages; the last stage's output is its summed loss."""
    return PipelineRunner(
        modules,
        stage_ids,
        layout.num_stages,
        dims.mesh,
        device,
        schedule=layout.pipeline_schedule,
        num_microbatches=layout.pipeline_parallel_num_microbatches,
    )
