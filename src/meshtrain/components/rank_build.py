"""One rank of a planned run, built: the trainer's and the dry run's one way to it.

Every rank builds the same model on the meta device, puts it through the run's
converters and this rank's parallelisation (pipeline stages, tensor and sequence
parallelism, activation checkpointing, FSDP2), allocates and fills only its own
shards, then makes the optimizer over them. The trainer (`meshtrain.trainer`) adds
the data, the checkpoints and the loop around what `build_rank` returns; the dry run
(`meshtrain.dryrun`) adds only a fake world and fake tensors around the same call, so
what it measures is what the trainer builds, by construction.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PreTrainedModel

from meshtrain.checkpoint.checkpointer import OptimizerState
from meshtrain.components.lr_schedule import LearningRateSchedule
from meshtrain.components.optimizer import ModelOptimizer, build_optimizer
from meshtrain.config import RunConfig, TrainingConfig
from meshtrain.distributed.fsdp import mixed_precision_policy
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.models.builder import build_meta_model, config_from_dict, weight_source
from meshtrain.models.converters import ModelConverter, build_converters
from meshtrain.models.llama.parallelize import parallelize
from meshtrain.models.parallel_model import ParallelModel
from meshtrain.models.preference import PreferenceObjective
from meshtrain.models.routing import Routing
from meshtrain.planner import Plan


@dataclass(frozen=True)
class BatchSplit:
    """A rank's share of each global batch."""

    per_device: int  # sequences per forward (the planner's split of the batch)
    accumulation_steps: int  # forwards per optimizer step, their gradients accumulated


def batch_split(plan: Plan, training: TrainingConfig) -> BatchSplit:
    """The planner's per-device batch (it differs from the parameter when
    training.global_batch_size is set; plans older than that field lack it, and the
    parameter stands), and the accumulation that makes up the global batch over dp."""
    per_device = plan.per_device_train_batch_size or training.per_device_train_batch_size
    accumulation = plan.global_batch_size // (plan.layout.data_parallel_size * per_device)
    return BatchSplit(per_device, accumulation)


@dataclass
class RankParts:
    """What a rank trains with: its model, its optimizer, and how it steps."""

    pm: ParallelModel
    optimizer: ModelOptimizer
    optimizer_state: OptimizerState  # the optimizer's side of a checkpoint
    converters: list[ModelConverter]
    device: torch.device
    batch: BatchSplit
    lr_schedule: LearningRateSchedule


def build_rank(
    run: RunConfig,
    plan: Plan,
    dims: ParallelDims,
    device: torch.device,
    *,
    meta_model: PreTrainedModel | None = None,
    converters: list[ModelConverter] | None = None,
    seed_dropout: bool = True,
) -> RankParts:
    """This rank's model (`build_rank_model`) and optimizer, as the plan lays them out.

    `meta_model`: the plan's model already on the meta device (`plan_meta_model`; the dry
    run builds it before its tensors turn fake), and `converters` the run's converters
    that already converted it (`rank_converters`; before the tensors turn fake too: an
    adapter's init under fake tensors leaves references that moving it to the device
    cannot replace). `seed_dropout`: seed the global generator,
    which draws only dropout masks (LoRA's adapters'), for this rank: one stream per
    data-parallel and pipeline coordinate, the same on the tp ranks, whose replicated
    adapter inputs must drop alike. It is seeded after the converters (the CPU kernel
    check draws from it, once per process) and before the model, as training always did;
    the dry run, which draws no masks, leaves its process's generator alone."""
    training = run.training
    converted = converters is not None
    if converters is None:
        converters = rank_converters(run, plan, dims, device.type)
    if seed_dropout:
        torch.manual_seed(training.seed * 1_000_003 + dims.dp_rank * 1_009 + dims.pp_rank)
    pm = build_rank_model(run, plan, dims, device, converters, meta_model, converted=converted)
    batch = batch_split(plan, training)
    forwards = dims.dp * batch.accumulation_steps * pm.backward_passes_per_batch
    sequence = dims.sequence_group(plan.layout.sequence_parallel)
    pm.use_routing(Routing.of(pm.modules, pm.hf_config, forwards, sequence, dims.ep_group))
    pm.use_preference(preference_objective(run, plan, dims, device))
    optimizer, optimizer_state = build_optimizer(
        pm, training=training, accumulation_steps=batch.accumulation_steps
    )
    return RankParts(
        pm=pm,
        optimizer=optimizer,
        optimizer_state=optimizer_state,
        converters=converters,
        device=device,
        batch=batch,
        lr_schedule=LearningRateSchedule(training),
    )


def preference_objective(
    run: RunConfig, plan: Plan, dims: ParallelDims, device: torch.device
) -> PreferenceObjective | None:
    """DPO's objective (None for the language-model loss), with its frozen reference
    model where `training.dpo.reference` resolves to `model`."""
    training = run.training
    if training.objective != "dpo":
        return None
    reference = training.dpo.resolved_reference(lora=run.model.lora is not None)
    model = build_reference_model(run, plan, dims, device) if reference == "model" else None
    return PreferenceObjective(training.dpo, reference, model)


def build_reference_model(
    run: RunConfig, plan: Plan, dims: ParallelDims, device: torch.device
) -> ParallelModel:
    """The run's starting weights (`model.init_from`), without adapters, frozen and laid
    out like the policy: DPO's reference (its pipeline schedule, where there is one,
    returns per-token log-probabilities)."""
    converters = build_converters(
        run.training,
        device.type,
        tensor_parallel=dims.tp > 1,
        lora=None,
        sharded=plan.layout.sharded,
    )
    reference = build_rank_model(run, plan, dims, device, converters)
    for parameter in reference.parameters.values():
        parameter.requires_grad_(False)
    reference.set_training(False)
    if reference.runner is not None:
        reference.runner.score_tokens()
    return reference


def rank_converters(
    run: RunConfig, plan: Plan, dims: ParallelDims, device_type: str
) -> list[ModelConverter]:
    """The run's model converters on this rank (`models.converters`)."""
    return build_converters(
        run.training,
        device_type,
        tensor_parallel=dims.tp > 1,
        lora=run.model.lora,
        sharded=plan.layout.sharded,
    )


def build_rank_model(
    run: RunConfig,
    plan: Plan,
    dims: ParallelDims,
    device: torch.device,
    converters: list[ModelConverter],
    meta_model: PreTrainedModel | None = None,
    *,
    converted: bool = False,
) -> ParallelModel:
    """Build the model on the meta device, identically on every rank; allocate and fill
    only this rank's part of it (random init from the seed, or `model.init_from`)."""
    cfg, layout = run.training, plan.layout
    autocast = partial(
        torch.autocast,
        device_type=device.type,
        dtype=torch.bfloat16,
        enabled=cfg.mixed_precision == "bf16",
        # autocast keeps the bf16 copy of every weight it casts until its region ends: the
        # whole forward (a pipeline's whole step). Activation checkpointing saves none of
        # them, so that cache alone would hold all the layers' bf16 weights at the forward's
        # end (the dry run found it: 16 GiB a rank for Llama-3.1-70B at dp32 x tp8 with
        # full recomputation); each use casts again instead. Without recomputation the
        # backward keeps the copies anyway, and the cache shares one among microbatches.
        cache_enabled=layout.activation_checkpointing == "none",
    )
    meta_model = meta_model or plan_meta_model(run, plan)
    with ExitStack() as stack:
        weights = weight_source(
            meta_model.config, seed=cfg.seed, init_from=run.model.init_from, stack=stack
        )
        pm = parallelize(
            meta_model,
            dims,
            layout,
            device,
            autocast,
            weights=weights,
            compile_layers=cfg.compile,
            converters=converters,
            converted=converted,
            fsdp_policy=mixed_precision_policy(cfg.mixed_precision, cfg.grad_reduce_dtype),
        )
    pm.set_training(True)
    return pm


def plan_meta_model(run: RunConfig, plan: Plan) -> PreTrainedModel:
    """The plan's model on the meta device, in the dtype its parameters train in."""
    meta_model = build_meta_model(config_from_dict(plan.model_config))
    if run.training.mixed_precision == "bf16_master" and not plan.layout.sharded:
        # On the meta device: allocates nothing. (Sharded, the fp32 shards are the
        # masters and FSDP2 gathers them as bf16.)
        meta_model.to(torch.bfloat16)
    return meta_model
