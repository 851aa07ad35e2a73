"""Expert parallelism: a sparse layer's experts split over the ranks of a group, each
token sent to the ranks of the experts it is routed to and its results sent back.

Rank r of an ep group of size n holds experts [r E/n, (r+1) E/n) of E. One sparse
layer's forward on a rank, given its tokens' top-k experts and routing weights:

1. The (token, expert) pairs sorted by expert, so that each destination rank's pairs
   follow one another, and each expert's within them (the permutation is kept).
2. The counts per expert exchanged (an all-to-all of E numbers each way), which gives
   every rank the sizes of the token exchange: what it sends to each rank and what it
   receives from each, grouped by source rank, then by local expert.
3. The pairs' hidden states exchanged with an uneven all-to-all (autograd's, so the
   backward sends the gradients back the same way).
4. The received rows regrouped by local expert (from every source), the local experts
   run as one grouped computation over them, and the rows put back in source order.
5. The results exchanged back (the reverse all-to-all), weighted by the routing weights,
   returned to the pairs' order and summed over each token's k experts.

Dropless: every pair is computed, whatever the imbalance; the buffers' sizes follow the
routing. Nothing here knows a model: the experts come as a function of (rows, local
expert offsets).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

# (rows sorted by local expert, cumulative row counts per local expert) -> results
LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertParallel:
    """One rank's place in an expert-parallel group over `num_experts` experts."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts do not split over {self.size} ranks")
        self.num_experts, self.local = num_experts, num_experts // self.size

    @property
    def first_expert(self) -> int:
        return self.rank * self.local

    def forward(
        self,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        experts: LocalExperts,
    ) -> torch.Tensor:
        """The sparse layer's output for `hidden` (tokens x hidden), each token's top-k
        experts and weights (tokens x k), with this rank's `experts`."""
        tokens, k = top_k_index.shape
        expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
        sent = hidden[order // k]
        per_expert = torch.bincount(expert_ids, minlength=self.num_experts)
        received_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(received_per_expert, per_expert, group=self.group)
        send_sizes = per_expert.view(self.size, self.local).sum(1).tolist()
        from_each = received_per_expert.view(self.size, self.local)  # source x local expert
        receive_sizes = from_each.sum(1).tolist()
        received = _exchange(sent, receive_sizes, send_sizes, self.group)
        by_expert, offsets = _by_local_expert(from_each)
        out = experts(received[by_expert], offsets)
        results = torch.empty_like(out).index_copy(0, by_expert, out)
        returned = _exchange(results, send_sizes, receive_sizes, self.group)
        weighted = returned * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(returned.dtype)
        pairs = weighted.new_zeros(tokens * k, weighted.shape[-1]).index_copy(0, order, weighted)
        return pairs.view(tokens, k, -1).sum(dim=1).to(hidden.dtype)


def _exchange(
    rows: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """An uneven all-to-all of `rows` (sent in `send`-sized runs, one per rank), with the
    backward sending the gradients back."""
    out = rows.new_empty(sum(receive), *rows.shape[1:])
    return all_to_all_single(out, rows.contiguous(), receive, send, group=group)


def _by_local_expert(from_each: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For received rows grouped by source rank, then local expert: the order that groups
    them by local expert instead (keeping the source order within one), and the
    cumulative row counts per local expert."""
    sources, local = from_each.shape
    starts = torch.cumsum(from_each.flatten(), 0) - from_each.flatten()  # each run's first row
    runs = [
        torch.arange(int(start), int(start) + int(count))
        for e in range(local)
        for start, count in zip(
            starts.view(sources, local)[:, e].tolist(), from_each[:, e].tolist(), strict=True
        )
    ]
    order = torch.cat(runs) if runs else torch.empty(0, dtype=torch.long)
    return order, torch.cumsum(from_each.sum(0), 0)
