"""The optimizer of a run, and the contract every one of them keeps.

AdamW over the flat buffer (ZeRO-1 when the layout says so; fp32 master
weights and gradients under bf16 parameters), or, under sharded data
parallelism, AdamW over FSDP2's shards; under expert parallelism, two flat buffers
(`components.expert_optimizer`). The trainer and the Checkpointer talk
to either through `ModelOptimizer` alone: the step in two halves (so a
non-finite norm can still refuse the update), and each optimizer writing and
reading its own pieces of a checkpoint (`zero_state`, `fsdp_state`: what
`checkpoint.checkpointer.OptimizerState` asks, beside the optimizer, so the
optimizers know nothing of checkpoint files and checkpoint/ nothing of them).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from meshtrain.checkpoint.checkpointer import OptimizerState
from meshtrain.components.expert_optimizer import ExpertSplitAdamW, ExpertSplitState
from meshtrain.components.fsdp_state import FSDPState
from meshtrain.components.zero_state import ZeroState
from meshtrain.config import TrainingConfig
from meshtrain.distributed.flat_buffer import FlatParameters
from meshtrain.distributed.fsdp_optimizer import FSDPAdamW
from meshtrain.distributed.zero import ShardedAdamW
from meshtrain.models.parallel_model import ParallelModel


class ModelOptimizer(Protocol):
    """What the training loop asks of a run's optimizer."""

    # -- the step ---------------------------------------------------------------------------
    def reduce_gradients(self) -> torch.Tensor:
        """Finish averaging this step's gradients; their global norm. Updates nothing."""
        ...

    def apply(self, grad_norm: torch.Tensor) -> None:
        """Clip to the norm's budget and update the parameters."""
        ...

    def zero_grad(self) -> None:
        """Clear the gradients, ready for the next step's backward."""
        ...

    def set_learning_rate(self, lr: float) -> None: ...

    def wait_for_parameters(self) -> None:
        """Every parameter holds its updated value (an overlapped gather has arrived)."""
        ...

    # -- what the loop reports and checks -----------------------------------------------------
    @property
    def model_states_bytes(self) -> int: ...

    def held_tensors(self) -> list[torch.Tensor]: ...

    def bucket_summary(self) -> dict[str, int]: ...

    def check_views(self) -> None: ...


def build_optimizer(
    pm: ParallelModel, *, training: TrainingConfig, accumulation_steps: int = 1
) -> tuple[ModelOptimizer, OptimizerState]:
    """AdamW for this rank's parameters, with the global gradient norm summed over the tp
    and pp groups: FSDP2's shards under sharded data parallelism, else the flat buffer
    (ZeRO-1 over dp when the layout says so); and its side of a checkpoint.
    `accumulation_steps`: microbatches of a step on this rank (each gradient is final
    after that many backward passes)."""
    dims = pm.dims
    norm_groups = tuple(
        dims.mesh.get_group(name) for name in ("tp", "pp") if dims.mesh[name].size() > 1
    )
    adam = {
        "lr": training.learning_rate,
        "betas": (training.adam_beta1, training.adam_beta2),
        "eps": training.adam_epsilon,
        "weight_decay": training.weight_decay,
        "max_grad_norm": training.max_grad_norm,
        "norm_groups": norm_groups,
    }
    if pm.layout.sharded:
        groups = sum(isinstance(m, FSDPModule) for stage in pm.modules for m in stage.modules())
        sharded = FSDPAdamW(pm.parameters, pm.sharding, dims, groups=groups, **adam)
        return sharded, FSDPState(sharded)
    flat_adam = partial(
        _flat_adamw,
        pm,
        training=training,
        backward_passes=accumulation_steps * pm.backward_passes_per_batch,
        **adam,
    )
    experts = {n: p for n, p in pm.parameters.items() if pm.sharding[n].ep > 1}
    if not experts:  # no expert parallelism, or its experts frozen (LoRA on the attention)
        optimizer = flat_adam(pm.parameters, dims.dp_cp_group, dims.dp_cp)
        return optimizer, ZeroState(optimizer)
    dense = {n: p for n, p in pm.parameters.items() if n not in experts}
    split = ExpertSplitAdamW(
        dense=flat_adam(dense, dims.dp_cp_group, dims.dp_cp),
        experts=flat_adam(
            experts,
            dims.expert_replica_group,
            dims.expert_replicas,
            mean_over=dims.dp_cp,
            norm_groups=(dims.ep_group, *norm_groups),
        ),
    )
    return split, ExpertSplitState(split)


def _flat_adamw(
    pm: ParallelModel,
    parameters: dict[str, torch.Tensor],
    group: dist.ProcessGroup,
    shards: int,
    *,
    training: TrainingConfig,
    mean_over: int | None = None,
    **adam: Any,
) -> ShardedAdamW:
    """AdamW over a flat buffer of `parameters`, averaged (and ZeRO-1 sharded, where the
    layout says so) over the `shards` ranks of `group`."""
    master_weights = training.mixed_precision == "bf16_master"
    grad_dtype = torch.float32 if master_weights and training.grad_reduce_dtype == "fp32" else None
    flat = FlatParameters(
        parameters.items(), num_shards=shards, sharding=pm.sharding, grad_dtype=grad_dtype
    )
    return ShardedAdamW(
        flat,
        group,
        zero_1=pm.layout.zero_1,
        overlap_reduction=training.overlap_grad_reduce,
        bucket_bytes=int(training.grad_bucket_mb * 2**20),
        reduce_after_backward=pm.gradients_finished_after_backward,
        master_weights=master_weights,
        gather_modules=pm.modules if training.gathers_under_forward else None,
        mean_over=mean_over,
        **adam,
    )
