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
routing. `ExpertParallel` knows no model: the experts come as a function of (rows, local
expert offsets). `ExpertShard` is that function for transformers' 3-D experts (a gated
MLP per expert, `gate_up_proj` and `down_proj`): it takes the experts module's place
with this rank's experts only, under the same parameter names, and `shard_experts` puts
it into every sparse layer of a model on the meta device, before its weights exist.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from transformers.integrations import moe as hf_moe

from meshtrain.distributed.tensor_parallel import ParameterSharding
from meshtrain.models.lora_parameters import carry_adapters

# (rows sorted by local expert, cumulative row counts per local expert) -> results
LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertParallel:
    """One rank's place in an expert-parallel group over `num_experts` experts."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.pairs_returned = 0  # (token, expert) pairs of the last forward computed
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts do not split over {self.size} ranks")
        self.num_experts, self.local = num_experts, num_experts // self.size

    @property
    def first_expert(self) -> int:
        return self.rank * self.local

    def exchange_counts(self, expert_ids: torch.Tensor) -> tuple[list[int], list[list[int]]]:
        """From this rank's pairs' experts (sorted): how many pairs it sends to each rank,
        and how many it receives from each rank for each of its local experts (source x
        local expert). Collective over the group."""
        per_expert = torch.bincount(expert_ids, minlength=self.num_experts)
        received = torch.empty_like(per_expert)
        dist.all_to_all_single(received, per_expert, group=self.group)
        send = per_expert.view(self.size, self.local).sum(1).tolist()
        return send, received.view(self.size, self.local).tolist()

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
        sent = in_compute_dtype(hidden[order // k])
        send_sizes, from_each = self.exchange_counts(expert_ids)
        receive_sizes = [sum(row) for row in from_each]
        received = _exchange(sent, receive_sizes, send_sizes, self.group)
        by_expert, offsets = _by_local_expert(from_each, hidden.device)
        out = experts(received[by_expert], offsets)
        results = torch.empty_like(out).index_copy(0, by_expert, out)
        returned = _exchange(results, send_sizes, receive_sizes, self.group)
        self.pairs_returned = returned.shape[0]  # every pair sent: dropless
        weighted = returned * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(returned.dtype)
        pairs = weighted.new_zeros(tokens * k, weighted.shape[-1]).index_copy(0, order, weighted)
        return pairs.view(tokens, k, -1).sum(dim=1).to(hidden.dtype)


def in_compute_dtype(rows: torch.Tensor) -> torch.Tensor:
    """`rows` in the dtype the experts' matmuls run in: autocast's where it is on (the
    rows travel in it, half the bytes of an fp32 residual stream, and come back in it as
    the experts' outputs do), else their own."""
    device = rows.device.type
    if torch.is_autocast_enabled(device):
        return rows.to(torch.get_autocast_dtype(device))
    return rows


def _exchange(
    rows: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """An uneven all-to-all of `rows` (sent in `send`-sized runs, one per rank), with the
    backward sending the gradients back."""
    return all_to_all_single_autograd(rows.contiguous(), receive, send, group)


def _by_local_expert(
    from_each: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """For received rows grouped by source rank, then local expert (`from_each`: the
    counts, source x local expert): the order that groups them by local expert instead
    (keeping the source order within one), and the cumulative row counts per local
    expert."""
    flat = [count for row in from_each for count in row]
    starts = [sum(flat[:i]) for i in range(len(flat))]  # each run's first row
    local = len(from_each[0])
    runs = [
        torch.arange(starts[source * local + e], starts[source * local + e] + count)
        for e in range(local)
        for source, row in enumerate(from_each)
        if (count := row[e])
    ]
    order = torch.cat(runs) if runs else torch.empty(0, dtype=torch.long)
    per_expert = [sum(row[e] for row in from_each) for e in range(local)]
    offsets = torch.tensor(per_expert, device=device).cumsum(0)
    return order.to(device), offsets


class ExpertShard(nn.Module):
    """One sparse layer's experts on this rank: E / ep of them, where transformers' experts
    module held all E, with its parameter names and forward (tokens, their top-k experts
    and weights) -> the tokens' weighted sum of their experts' outputs."""

    def __init__(self, experts: nn.Module, ep: ExpertParallel) -> None:
        super().__init__()
        self.ep = ep
        self.act_fn = experts.act_fn
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            local = torch.empty(ep.local, *full.shape[1:], dtype=full.dtype, device=full.device)
            setattr(self, name, nn.Parameter(local, requires_grad=full.requires_grad))
        carry_adapters(experts, self, ep.local)  # LoRA's on the experts, if any

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.ep.forward(hidden_states, top_k_index, top_k_weights, self._local_experts)

    def _local_experts(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The gated MLP of each local expert over its rows, as one grouped matmul each way
        (transformers' own dispatcher: the kernel, or its fallback, as the model runs it),
        the weights cast to the rows' dtype as autocast casts a linear's."""
        offs = offsets.to(torch.int32)
        gate_up, down = (
            w.to(rows.dtype).transpose(-2, -1) for w in (self.gate_up_proj, self.down_proj)
        )
        gate, up = hf_moe._grouped_mm(rows, gate_up, offs).chunk(2, -1)
        return hf_moe._grouped_mm(self.act_fn(gate) * up, down, offs)


def is_experts_module(module: nn.Module) -> bool:
    """transformers' 3-D experts of a gated MLP (Qwen3-MoE's, Mixtral's)."""
    gate_up = getattr(module, "gate_up_proj", None)
    return isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and hasattr(module, "act_fn")


def shard_experts(
    modules: list[nn.Module],
    sharding: dict[str, ParameterSharding],
    group: dist.ProcessGroup,
    ep_rank: int,
) -> dict[str, ParameterSharding]:
    """Give every sparse layer of `modules` (on the meta device) this rank's experts over
    `group`; the sharding with the experts' pieces recorded (checkpoints and weight sources
    cut and rebuild them along the expert dimension)."""
    sharding = dict(sharding)
    for module in modules:
        for path, experts in list(module.named_modules()):
            if not is_experts_module(experts):
                continue
            ep = ExpertParallel(group, experts.gate_up_proj.shape[0])
            parent, _, attribute = path.rpartition(".")
            shard = ExpertShard(experts, ep)
            setattr(module.get_submodule(parent), attribute, shard)
            for name, _ in shard.named_parameters():  # LoRA's adapters too: expert first
                key = f"{path}.{name}"
                sharding[key] = dataclasses.replace(sharding[key], ep=ep.size, ep_rank=ep_rank)
    return sharding


def gather_experts(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor | None:
    """Every expert of a 3-D parameter, stacked, on rank 0 of the ep `group` (None on the
    others), from each rank's `local` experts. Collective over `group`."""
    size = dist.get_world_size(group)
    root = dist.get_rank(group) == 0
    whole = local.new_empty(size * local.shape[0], *local.shape[1:]) if root else None
    gathered = list(whole.chunk(size)) if root else None
    dist.gather(local.contiguous(), gathered, group_dst=0, group=group)
    return whole
