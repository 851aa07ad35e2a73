"""Apply a layout to one rank's Llama-family model, in a fixed and documented order.

1. activation checkpointing flags (on the whole model, so every layer has them),
2. pipeline parallelism: keep only this rank's stages,
3. tensor / sequence parallelism inside each stage (all of it on the meta device),
   the Linear layers' CPU matmuls routed to oneDNN when asked (`models.cpu_linear`),
   then only this rank's shards are allocated and filled (`weights.materialize`),
4. torch.compile of each decoder layer, when asked,
   (tied embeddings over stages: the first and last stage each keep a copy, whose
   gradients `SharedWeightSync` sums after the backward),
5. (then the trainer lays the parameters into the flat buffer for data
   parallelism and ZeRO-1: `meshtrain.components.optimizer`),
   or, under sharded data parallelism, FSDP2 over the dp shard mesh between 3's
   sharding and its materialisation (`shard_data_parallel`), with 4 before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard
from transformers import PretrainedConfig

from meshtrain.config import Layout
from meshtrain.distributed.activation_checkpoint import (
    apply_activation_checkpointing,
    offload_context,
)
from meshtrain.distributed.fsdp import apply_fully_shard
from meshtrain.distributed.kv_heads import kv_replication_factor
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.pipeline_parallel import (
    PipelineRunner,
    SharedWeightSync,
    stage_ids_of_rank,
    stage_layer_ranges,
)
from meshtrain.distributed.tensor_parallel import (
    ParameterSharding,
    TensorParallelGradSync,
    unsharded,
)
from meshtrain.models.cpu_linear import route_linears_to_onednn
from meshtrain.models.llama.parameter_names import EMBEDDING, LM_HEAD, stored_name
from meshtrain.models.llama.stage import LlamaStage
from meshtrain.models.llama.tensor_parallel import apply_tensor_parallel, decoder_layers
from meshtrain.models.llama.weights import WeightSource, materialize
from meshtrain.models.parallel_model import ParallelModel, as_local, causal_lm_loss


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    layout: Layout,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager],
    *,
    weights: WeightSource | None = None,
    compile_layers: bool = False,
    onednn_linears: bool = False,
    fsdp_policy: MixedPrecisionPolicy | None = None,
) -> ParallelModel:
    """Apply the layout to a model built identically on every rank.

    `weights`: the model is on the meta device; once it is cut into this rank's stages
    and tensor-parallel shards, only those are allocated on `device` and filled from
    `weights` (without, the model already holds its weights, on `device`).
    `compile_layers`: torch.compile every decoder layer last, in place (parameter
    names, and so checkpoints, stay those of the Hugging Face model), once its
    tensor-parallel sharding and checkpointing are set.
    `onednn_linears`: the Linear layers' fp32 CPU matmuls run on oneDNN (`cpu_linear`).
    `fsdp_policy`: FSDP2's mixed precision under sharded data parallelism (its default,
    no dtype change, when None).
    """
    fsdp_policy = fsdp_policy or MixedPrecisionPolicy()
    apply_activation_checkpointing(model, layout.activation_checkpointing)
    stage_ids, modules = pipeline_stages(model, dims, layout)
    kv_replication = (
        kv_replication_factor(model.config.num_key_value_heads, dims.tp) if dims.tp > 1 else 1
    )
    sharding = shard_tensor_parallel(modules, dims, layout, kv_replication)
    if onednn_linears:
        route_linears_to_onednn(modules)
    if layout.sharded:
        # FSDP2 wraps the compiled layers (torchtitan's order); all of it on the meta
        # device, so materialising allocates only this rank's dp shard of its tp piece.
        if compile_layers:
            compile_decoder_layers(modules)
        shard_data_parallel(modules, dims, layout, fsdp_policy)
    if weights is not None:
        materialize(
            modules,
            sharding,
            weights,
            device,
            tp_rank=dims.tp_rank,
            tp=dims.tp,
            dp_shard=(dims.shard_rank, dims.sdp),
        )
    if compile_layers and not layout.sharded:
        compile_decoder_layers(modules)
    parameters = {n: p for m in modules for n, p in m.named_parameters()}
    tied = tied_embedding_copies(model.config, parameters, dims)
    for name in tied or {}:
        # Each copy counts half in the gradient norm: the weight counts once.
        sharding[name] = dataclasses.replace(sharding[name], copies=sharding[name].copies * 2)
    tp_sync = (
        TensorParallelGradSync(parameters, sharding, dims.mesh, kv_replication)
        if dims.tp > 1
        else None
    )
    runner = pipeline_runner(modules, stage_ids, dims, layout, device) if dims.pp > 1 else None
    return ParallelModel(
        modules,
        parameters,
        sharding,
        model.config,
        dims,
        tp_sync,
        runner,
        autocast,
        layout,
        offload=offload_context(layout.activation_offloading, device),
        shared_sync=SharedWeightSync(tied, dims.mesh) if tied is not None else None,
        tied_copies=stored_elsewhere(parameters, model.config),
    )


def compile_decoder_layers(modules: list[nn.Module]) -> None:
    for module in modules:
        for _, layer in decoder_layers(module):
            layer.compile()


def shard_data_parallel(
    modules: list[nn.Module], dims: ParallelDims, layout: Layout, policy: MixedPrecisionPolicy
) -> None:
    """FSDP2 over each stage: without a pipeline the layers are resharded after their
    forward (ZeRO-3); with one they stay gathered through the step's microbatches."""
    for module in modules:
        layers = [layer for _, layer in decoder_layers(module)]
        apply_fully_shard(module, layers, dims, reshard_after_forward=dims.pp == 1, policy=policy)


def stored_elsewhere(
    parameters: dict[str, torch.Tensor], config: PretrainedConfig
) -> dict[str, str]:
    """This rank's parameters that checkpoints store under another name (the last stage's
    copy of a tied embedding) -> that name."""
    names = {name: stored_name(name, config) for name in parameters}
    return {name: stored for name, stored in names.items() if stored != name}


def tied_embedding_copies(
    config: PretrainedConfig, parameters: dict[str, torch.Tensor], dims: ParallelDims
) -> dict[str, torch.Tensor] | None:
    """With tied embeddings cut over pipeline stages, this rank's copies of the one weight:
    the embedding on the first stage, the LM head on the last, none in between. None when
    nothing is shared across stages (no pipeline, or untied embeddings)."""
    if dims.pp == 1 or not getattr(config, "tie_word_embeddings", False):
        return None
    return {name: parameters[name] for name in (EMBEDDING, LM_HEAD) if name in parameters}


def pipeline_stages(
    model: nn.Module, dims: ParallelDims, layout: Layout
) -> tuple[list[int], list[nn.Module]]:
    """This rank's stage ids and modules (the whole model, id-less, without pp)."""
    if dims.pp == 1:
        return [], [model]
    stage_ids = stage_ids_of_rank(dims.pp_rank, dims.pp, layout.pipeline_parallel_virtual_stages)
    ranges = stage_layer_ranges(layout.pipeline_parallel_layers)
    last = layout.num_stages - 1
    modules = [LlamaStage(model, ranges[i], is_first=i == 0, is_last=i == last) for i in stage_ids]
    return stage_ids, modules


def shard_tensor_parallel(
    modules: list[nn.Module], dims: ParallelDims, layout: Layout, kv_replication: int
) -> dict[str, ParameterSharding]:
    """Shard every stage over the tp mesh (in place); each parameter's sharding by name."""
    if dims.tp == 1:
        return {name: spec for module in modules for name, spec in unsharded(module).items()}
    tp_mesh = dims.mesh["tp"]
    sharding: dict[str, ParameterSharding] = {}
    for module in modules:
        sharding.update(
            apply_tensor_parallel(
                module,
                tp_mesh,
                sequence_parallel=layout.sequence_parallel,
                kv_replication=kv_replication,
            )
        )
        if isinstance(module, LlamaStage):
            module.tp_mesh = tp_mesh
            module.sequence_parallel = layout.sequence_parallel
    return sharding


def pipeline_runner(
    modules: list[nn.Module],
    stage_ids: list[int],
    dims: ParallelDims,
    layout: Layout,
    device: torch.device,
) -> PipelineRunner:
    """The schedule over this rank's stages; the last stage scores its logits."""
    tp_mesh = dims.mesh["tp"]

    def last_stage_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if dims.tp > 1:  # the stage handed over its vocabulary shard of the logits
            logits = DTensor.from_local(logits, tp_mesh, [Shard(-1)], run_check=False)
        return as_local(causal_lm_loss(logits, input_ids))

    return PipelineRunner(
        modules,
        stage_ids,
        layout.num_stages,
        dims.mesh,
        device,
        schedule=layout.pipeline_schedule,
        num_microbatches=layout.pipeline_parallel_num_microbatches,
        loss_fn=last_stage_loss,
    )
