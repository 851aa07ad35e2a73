"""Compose the parallelisms on one rank's model, in a fixed and documented order.

1. activation checkpointing flags (on the whole model, so every layer has them),
2. pipeline parallelism: keep only this rank's stages,
3. tensor / sequence parallelism inside each stage,
4. (then the caller lays the parameters into the flat buffer for data
   parallelism and ZeRO-1).

`ParallelModel` hides which of them are on: the training loop asks it to
run a batch forward and backward, or forward only, and gets the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from transformers import PretrainedConfig

from meshtrain.config import TrainingConfig
from meshtrain.models.llama_family import LlamaStage, decoder_layers, kv_replication_factor
from meshtrain.parallel.activation_memory import apply_activation_checkpointing, offload_context
from meshtrain.parallel.flat_buffer import FlatParameters
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.parallel.pipeline_parallel import (
    PipelineRunner,
    stage_ids_of_rank,
    stage_layer_ranges,
)
from meshtrain.parallel.tensor_parallel import (
    ParameterLayout,
    TensorParallelGradSync,
    apply_tensor_parallel,
    plain_layouts,
)
from meshtrain.parallel.zero import ShardedAdamW
from meshtrain.planner import Layout


def causal_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch, in fp32.

    The labels are shifted (the last position ignored) rather than the logits
    sliced, so vocabulary-sharded DTensor logits go through unchanged.
    """
    labels = F.pad(input_ids[:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def as_local(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as a plain tensor (plain tensors pass through)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


@dataclass
class ParallelModel:
    modules: list[nn.Module]  # this rank's stages (one module without pipeline parallelism)
    parameters: dict[str, torch.Tensor]  # Hugging Face name -> parameter (maybe a DTensor)
    layouts: dict[str, ParameterLayout]
    hf_config: PretrainedConfig
    dims: ParallelDims
    tp_sync: TensorParallelGradSync | None
    runner: PipelineRunner | None
    autocast: Callable[[], AbstractContextManager]
    layout: Layout
    offload: Callable[[], AbstractContextManager] = nullcontext

    def loss_context(self) -> AbstractContextManager:
        # Cross-entropy on vocabulary-sharded logits: the full logits never exist on one rank.
        return loss_parallel() if self.dims.tp > 1 else nullcontext()

    def set_training(self, training: bool) -> None:
        for module in self.modules:
            module.train(training)

    def train_batch(self, input_ids: torch.Tensor, accumulation_steps: int) -> torch.Tensor:
        """Forward and backward; returns the batch's mean loss / accumulation steps.

        Under pipeline parallelism only the last stage knows the loss (0 elsewhere).
        """
        with self.loss_context(), self.offload():
            if self.runner is not None:
                with self.autocast():
                    return self.runner.train_step(input_ids, accumulation_steps)
            loss = self._loss(input_ids) / accumulation_steps
            loss.backward()
        return as_local(loss.detach())

    def _loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The logits go out of scope here: backward needs only log-softmax's output, so
        # not holding them saves a (batch x sequence x vocabulary) tensor at the peak.
        with self.autocast():
            logits = self.modules[0](input_ids=input_ids).logits
        return causal_lm_loss(logits, input_ids)

    @torch.no_grad()
    def eval_batch(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Mean loss of the batch, forward only (0 off the last pipeline stage)."""
        with self.loss_context(), self.autocast():
            if self.runner is not None:
                return self.runner.eval_step(input_ids)
            logits = self.modules[0](input_ids=input_ids).logits
            return as_local(causal_lm_loss(logits, input_ids))

    @property
    def backward_passes_per_batch(self) -> int:
        """How often one `train_batch` accumulates into each gradient."""
        return self.layout.pipeline_parallel_num_microbatches if self.runner else 1

    def synchronize_tensor_parallel_gradients(self) -> None:
        if self.tp_sync is not None:
            self.tp_sync()


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    layout: Layout,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager],
    *,
    compile_layers: bool = False,
) -> ParallelModel:
    """Apply the layout to a freshly built (identical on every rank) model.

    `compile_layers`: torch.compile every decoder layer last, in place (parameter
    names, and so checkpoints, stay those of the Hugging Face model), once its
    tensor-parallel sharding and checkpointing are set.
    """
    hf_config = model.config
    apply_activation_checkpointing(model, layout.activation_checkpointing)

    if dims.pp > 1:
        stage_ids = stage_ids_of_rank(
            dims.pp_rank, dims.pp, layout.pipeline_parallel_virtual_stages
        )
        ranges = stage_layer_ranges(layout.pipeline_parallel_layers)
        last = layout.num_stages - 1
        modules = [
            LlamaStage(model, ranges[i], is_first=i == 0, is_last=i == last) for i in stage_ids
        ]
    else:
        stage_ids, modules = [], [model]

    kv_replication = 1
    if dims.tp > 1:
        kv_replication = kv_replication_factor(hf_config.num_key_value_heads, dims.tp)
        layouts: dict[str, ParameterLayout] = {}
        for module in modules:
            layouts.update(
                apply_tensor_parallel(
                    module,
                    dims.mesh["tp"],
                    sequence_parallel=layout.sequence_parallel,
                    kv_replication=kv_replication,
                )
            )
            if isinstance(module, LlamaStage):
                module.tp_mesh = dims.mesh["tp"]
                module.sequence_parallel = layout.sequence_parallel
    else:
        layouts = {n: lay for m in modules for n, lay in plain_layouts(m).items()}
    if compile_layers:
        for module in modules:
            for _, layer in decoder_layers(module):
                layer.compile()
    parameters = {n: p for m in modules for n, p in m.named_parameters()}
    tp_sync = (
        TensorParallelGradSync(parameters, layouts, dims.mesh, kv_replication)
        if dims.tp > 1
        else None
    )

    runner = None
    if dims.pp > 1:
        tp_mesh = dims.mesh["tp"]

        def last_stage_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
            if dims.tp > 1:  # the stage handed over its vocabulary shard of the logits
                logits = DTensor.from_local(logits, tp_mesh, [Shard(-1)], run_check=False)
            return as_local(causal_lm_loss(logits, input_ids))

        runner = PipelineRunner(
            modules,
            stage_ids,
            layout.num_stages,
            dims.mesh,
            device,
            schedule=layout.pipeline_schedule,
            num_microbatches=layout.pipeline_parallel_num_microbatches,
            loss_fn=last_stage_loss,
        )
    return ParallelModel(
        modules,
        parameters,
        layouts,
        hf_config,
        dims,
        tp_sync,
        runner,
        autocast,
        layout,
        offload=offload_context(layout.activation_offloading, device),
    )


def build_optimizer(
    pm: ParallelModel, *, zero_1: bool, overlap: bool, training: TrainingConfig
) -> tuple[FlatParameters, ShardedAdamW]:
    """The flat buffer over this rank's parameters and AdamW on it (ZeRO-1 over dp),
    with the global gradient norm summed over the tp and pp groups."""
    dims = pm.dims
    flat = FlatParameters(pm.parameters.items(), num_shards=dims.dp, layouts=pm.layouts)
    norm_groups = tuple(
        dims.mesh.get_group(name) for name in ("tp", "pp") if dims.mesh[name].size() > 1
    )
    optimizer = ShardedAdamW(
        flat,
        dims.dp_group,
        zero_1=zero_1,
        overlap_reduction=overlap,
        bucket_bytes=int(training.grad_bucket_mb * 2**20),
        reduce_after_backward=pm.tp_sync.parameter_names if pm.tp_sync else (),
        norm_groups=norm_groups,
        lr=training.learning_rate,
        betas=(training.adam_beta1, training.adam_beta2),
        eps=training.adam_epsilon,
        weight_decay=training.weight_decay,
        max_grad_norm=training.max_grad_norm,
    )
    return flat, optimizer
