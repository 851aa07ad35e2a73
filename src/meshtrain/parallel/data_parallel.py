"""Data-parallel gradient synchronisation over the flat gradient buffer.

Without ZeRO-1 every rank needs every averaged gradient (all-reduce); with it
a rank only needs the range it owns (reduce-scatter, half the traffic).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def average_gradients(grads: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """All-reduce `grads` in place to the mean over the data-parallel ranks."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return
    dist.all_reduce(grads, op=dist.ReduceOp.SUM, group=group)
    grads.div_(size)


def reduce_scatter_gradients(
    grads: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    """Write into `shard` this rank's equal part of the mean of `grads` over the ranks."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        shard.copy_(grads)
        return
    dist.reduce_scatter_single(shard, grads, op=dist.ReduceOp.SUM, group=group)
    shard.div_(size)


def gather_parameters(
    params: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    """Rebuild the full parameter buffer from each rank's updated shard."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return
    dist.all_gather_single(params, shard, group=group)
