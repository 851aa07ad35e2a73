"""Validation loss during training, the same number whatever the layout."""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.data.batch import BlockRows
from meshtrain.data.blocks import BlockStore
from meshtrain.models.parallel_model import ParallelModel
from meshtrain.models.preference_loss import METRICS


@torch.no_grad()
def evaluate_means(
    pm: ParallelModel,
    blocks: BlockStore,
    eval_batches: int,
    device: torch.device,
    per_rank: int,
    global_batch: int,
    reference: BlockRows | None = None,
) -> list[float]:
    """Mean loss per trained token over the first `eval_batches` global batches of
    validation (fine-tuning blocks: the tokens `data.loss_on` trains); under DPO the mean
    over the pairs of the loss and of each metric (`preference_loss.METRICS`), with
    `reference` the blocks' precomputed reference log-probabilities where DPO uses them.

    Every data-parallel rank scores a contiguous slice (its context-parallel ranks a
    share of each block's tokens) and the sums are all-reduced (over the pipeline
    too: only the last stage has losses), so
    the number does not depend on the layout. Batches are the per-device
    training batch, whole ones only under pipeline parallelism (the schedule
    cuts them into its microbatches). Collective.
    """
    dims = pm.dims
    pm.set_training(False)
    # `eval_batches` global batches: the same blocks whatever the layout splits them into.
    count = min(len(blocks), eval_batches * global_batch)
    lo, hi, share = data_parallel_slice(count, dims.dp_rank, dims.dp)
    if pm.runner is not None:
        share = share // per_rank * per_rank
        hi = lo + share if lo + share <= len(blocks) else lo
    width = len(METRICS) if pm.preference is not None else 1
    sums, units = torch.zeros(width, dtype=torch.float64, device=device), 0
    starts = list(range(lo, hi, per_rank))
    padding = 0
    if pm.layout.sharded:
        # FSDP2 gathers each layer over the dp ranks, so every rank runs as many forwards as
        # the busiest one; the extra ones score a batch of the first blocks, not counted.
        padding = most_batches(len(starts), dims.dp_group) - len(starts)
    for start in starts:
        indices = list(range(start, min(hi, start + per_rank)))
        batch = blocks.tokens(indices).with_reference(reference, indices).to(device)
        sums = sums + pm.eval_batch(batch).double()
        if dims.cp_rank == 0:  # the cp ranks score parts of the same blocks
            units += pm.units(batch)
    if padding:
        first = list(range(min(per_rank, len(blocks))))
        filler = blocks.tokens(first).with_reference(reference, first).to(device)
        for _ in range(padding):
            pm.eval_batch(filler)
    if dims.pp > 1:
        # Token counts are known on every stage; losses only on the last.
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=dims.pp_group)
    totals = torch.cat([sums, torch.tensor([float(units)], dtype=torch.float64, device=device)])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=dims.dp_cp_group)
    pm.set_training(True)
    if totals[-1] == 0:
        return [float("nan")] * len(sums)
    return (totals[:-1] / totals[-1]).tolist()


def data_parallel_slice(count: int, dp_rank: int, dp: int) -> tuple[int, int, int]:
    """Data-parallel rank `dp_rank`'s contiguous slice [lo, hi) of `count` blocks, and the
    share every rank's slice is cut at (the last ones may be shorter)."""
    share = -(-count // dp)
    return min(count, dp_rank * share), min(count, (dp_rank + 1) * share), share


def most_batches(mine: int, group: dist.ProcessGroup) -> int:
    """The largest batch count over the ranks of `group`. Collective."""
    count = torch.tensor(mine)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count)
