"""DPO's `precompute` reference: every block's reference log-probabilities, computed in
one pass before training by the starting weights laid out like the policy, so training
holds one model (TRL's `precompute_ref_log_probs`).

Each data-parallel group scores a contiguous share of the blocks (its context-parallel
ranks a share of each block's tokens; under pipeline parallelism its last stage's ranks)
and the shares are gathered, so the ranks of the last stage hold the whole table (4
bytes per block token, on the host), which one of them stores for every rank
(`components/reference_store.py`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.components.validation import data_parallel_slice, most_batches
from meshtrain.data.blocks import BlockStore
from meshtrain.distributed.context_parallel import gather_sequence
from meshtrain.models.parallel_model import ParallelModel


@torch.no_grad()
def reference_table(
    reference: ParallelModel, blocks: BlockStore, per_rank: int, device: torch.device
) -> torch.Tensor:
    """The (blocks, block size) fp32 log-probability of each label under `reference`.
    Collective over every rank."""
    dims = reference.dims
    count = len(blocks)
    lo, hi, share = data_parallel_slice(count, dims.dp_rank, dims.dp)
    width = blocks.batch([0]).shape[1]
    mine = torch.zeros(share, width, dtype=torch.float32, device=device)
    starts = list(range(lo, hi, per_rank))
    # FSDP2 gathers each layer over the dp ranks: every rank runs the busiest's count.
    padding = 0
    if reference.layout.sharded:
        padding = most_batches(len(starts), dims.dp_group) - len(starts)
    for start in starts:
        indices = list(range(start, min(hi, start + per_rank)))
        scored = _scored_rows(reference, blocks, indices, per_rank, device)
        mine[start - lo : start - lo + len(indices)] = scored
    first = list(range(min(per_rank, count)))
    for _ in range(padding):
        _scored_rows(reference, blocks, first, per_rank, device)
    if dims.dp == 1:
        return mine[:count].cpu()
    shares = [torch.empty_like(mine) for _ in range(dims.dp)]
    dist.all_gather(shares, mine, group=dims.dp_group)
    return torch.cat(shares)[:count].cpu()


def _scored_rows(
    reference: ParallelModel,
    blocks: BlockStore,
    indices: list[int],
    per_rank: int,
    device: torch.device,
) -> torch.Tensor:
    """The token log-probabilities of blocks `indices` (under cp each rank scores its share
    of the tokens, and the shares are gathered back into rows; off the last pipeline stage,
    zeros). A pipeline schedule takes whole batches only: a short one is filled up with
    copies of its first block, dropped after."""
    whole = indices
    if reference.runner is not None:
        whole = indices + indices[:1] * (per_rank - len(indices))
    logps = reference.token_logps(blocks.tokens(whole).to(device))
    if reference.context is not None:
        logps = gather_sequence(logps, reference.context)
    return logps[: len(indices)]
