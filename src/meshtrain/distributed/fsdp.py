"""Sharded data parallelism on torch's FSDP2 (`fully_shard`): ZeRO-3, or hybrid sharding.

Each decoder layer is its own FSDP group, and the rest of a stage (embedding,
final norm, LM head: tied or not, in one group) is the root's. A group's
parameters are all-gathered just before its forward and again before its
backward, and its gradients reduce-scattered as soon as its backward is done,
so a rank holds 1/N of the parameters, gradients and AdamW states between
uses, plus the layers in flight. The next layer's gather is issued one layer
ahead (explicit prefetch), so it overlaps the current layer's compute.

Under pipeline parallelism the layers are not resharded after the forward:
torch's pipelining stage keeps them gathered, and their gradients unreduced,
until the last microbatch's backward of the step, when each group is
reduce-scattered once (all-gathering per microbatch would multiply the
traffic by the microbatch count).

FSDP2 shards every parameter along its first dimension: rank r of the N holds
`torch.chunk(tensor, N)[r]` (empty when there are fewer chunks than ranks) of
the tensor-parallel local piece, which is what `shard_piece` cuts for
start-up and resume, one tensor at a time, so no rank ever holds the model.

Under `bf16_master` the sharded parameters stay fp32 (they are the master
weights AdamW updates) and FSDP's mixed-precision policy gathers them as bf16
for compute, reducing gradients in fp32 (or bf16 with
`training.grad_reduce_dtype=bf16`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from meshtrain.distributed.expert_parallel import ExpertShard
from meshtrain.distributed.parallel_dims import ParallelDims


def mixed_precision_policy(mixed_precision: str, grad_reduce_dtype: str) -> MixedPrecisionPolicy:
    """bf16_master: bf16 compute copies of fp32 shards; otherwise FSDP changes no dtype."""
    if mixed_precision != "bf16_master":
        return MixedPrecisionPolicy()
    reduce = torch.bfloat16 if grad_reduce_dtype == "bf16" else torch.float32
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)


def apply_fully_shard(
    stage: nn.Module,
    layers: list[nn.Module],
    dims: ParallelDims,
    *,
    reshard_after_forward: bool,
    policy: MixedPrecisionPolicy,
) -> None:
    """Shard one stage (its decoder `layers` first, then the stage itself as the root
    group) over the dp shard mesh, with one-ahead prefetch of the layers' gathers."""
    mesh = dims.fsdp_mesh
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    # The root group's parameters are used at both ends of the step (embedding first, LM
    # head last): resharding them between forward and backward would only gather them again.
    fully_shard(stage, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    sharded: list[FSDPModule] = list(layers)  # type: ignore[arg-type]
    for current, following in zip(sharded, sharded[1:], strict=False):
        current.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([current])


def shard_experts_data_parallel(
    stage: nn.Module,
    dims: ParallelDims,
    *,
    reshard_after_forward: bool,
    policy: MixedPrecisionPolicy,
) -> None:
    """Under expert parallelism, each sparse layer's experts are a group of their own,
    sharded over the ranks that hold the same experts (`ParallelDims.expert_shard_mesh`),
    before their layer is sharded over the dp ranks with the rest. (Their reduce-scatter
    averages over the replicas; `FSDPAdamW` makes that the mean over the data-parallel
    ranks.)"""
    for module in stage.modules():
        if isinstance(module, ExpertShard):
            fully_shard(
                module,
                mesh=dims.expert_shard_mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=policy,
            )


def shard_piece(piece: torch.Tensor, shard_rank: int, shards: int) -> torch.Tensor:
    """FSDP2's dim-0 shard `shard_rank` of `shards` of a (tensor-parallel local) tensor."""
    chunks = torch.chunk(piece, shards, dim=0)
    if shard_rank < len(chunks):
        return chunks[shard_rank]
    return piece.new_empty((0, *piece.shape[1:]))
