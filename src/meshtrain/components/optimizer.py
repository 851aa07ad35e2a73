"""The optimizer of a run: AdamW over the flat buffer (ZeRO-1 when the layout says so;
fp32 master weights and gradients under bf16 parameters)."""

from __future__ import annotations

import torch

from meshtrain.config import TrainingConfig
from meshtrain.distributed.flat_buffer import FlatParameters
from meshtrain.distributed.zero import ShardedAdamW
from meshtrain.models.parallel_model import ParallelModel


def build_optimizer(
    pm: ParallelModel, *, zero_1: bool, overlap: bool, training: TrainingConfig
) -> tuple[FlatParameters, ShardedAdamW]:
    """The flat buffer over this rank's parameters and AdamW on it (ZeRO-1 over dp),
    with the global gradient norm summed over the tp and pp groups."""
    dims = pm.dims
    master_weights = training.mixed_precision == "bf16_master"
    grad_dtype = torch.float32 if master_weights and training.grad_reduce_dtype == "fp32" else None
    flat = FlatParameters(
        pm.parameters.items(), num_shards=dims.dp, sharding=pm.sharding, grad_dtype=grad_dtype
    )
    norm_groups = tuple(
        dims.mesh.get_group(name) for name in ("tp", "pp") if dims.mesh[name].size() > 1
    )
    optimizer = ShardedAdamW(
        flat,
        dims.dp_group,
        zero_1=zero_1,
        overlap_reduction=overlap,
        bucket_bytes=int(training.grad_bucket_mb * 2**20),
        reduce_after_backward=pm.gradients_finished_after_backward,
        norm_groups=norm_groups,
        lr=training.learning_rate,
        betas=(training.adam_beta1, training.adam_beta2),
        eps=training.adam_epsilon,
        weight_decay=training.weight_decay,
        max_grad_norm=training.max_grad_norm,
        master_weights=master_weights,
    )
    return flat, optimizer
