"""A mixture of experts' routing in a training run: its load-balancing loss, as its model
defines it, and how evenly the routers spread the tokens.

transformers computes the loss from every sparse layer's router logits of one forward
(`load_balancing_loss_func` of Qwen3-MoE and Mixtral alike): E x sum_e T_e P_e, where T_e
counts the top-k picks of expert e over every layer's rows and P_e sums its router
probability over them, each divided by the rows; it adds `router_aux_loss_coef` times it
to the forward's loss, where `output_router_logits` is on. meshtrain runs its layers
itself and normalises the language-model loss over the whole global batch, so it collects
the routers' logits of each forward here and adds the coefficient times the loss, divided
by the microbatches of the global batch: the step's objective is the mean over its
microbatches of what transformers adds to each, whatever the number of data-parallel
ranks and accumulation steps the same microbatches are spread over.

Under context parallelism a microbatch's rows are spread over the cp ranks (and under
sequence parallelism over the tp ranks, where the sparse layers run on each rank's
share of the sequence), and the loss is not a sum over rows: its T and P multiply. T
comes from top-k and has no gradient, so the ranks sum their counts and rows (one small
all-reduce per forward) and each adds E x sum_e T_e P_e with its own probabilities
only: the ranks' terms add up to the microbatch's loss, and each rank's routers get
their exact gradient.

Under pipeline parallelism a microbatch's sparse layers are spread over the stages. Each
stage adds its layers' picks (one row per sparse layer of the model) and its summed
probabilities (with their gradient) to a small tally that travels with the hidden states
(`tally`); the last stage computes the loss from the whole tally, and autograd sends the
probabilities' gradient back along the pipeline with the hidden states' own.

Each step also counts the tokens each expert received, for the run's metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.models.moe_config import (
    experts_per_token,
    is_moe,
    num_experts,
    router_loss_coefficient,
    sparse_layers,
)

ROUTER_MODULE = "mlp.gate"


@runtime_checkable
class ExpertCounts(Protocol):
    """An expert-parallel dispatch (`distributed.expert_parallel.ExpertParallel`): the
    (token, expert) pairs its last forward got back from the experts' ranks."""

    pairs_returned: int


class Routing:
    """Collects the routers' logits during each forward: the microbatch's tally of picks
    and probabilities, its loss term, and the step's tokens per expert."""

    def __init__(
        self,
        modules: list[nn.Module],
        config: object,
        microbatches: int,
        sequence_group: dist.ProcessGroup | None = None,
        expert_group: dist.ProcessGroup | None = None,
    ) -> None:
        """`modules`: the rank's model (or stages); `microbatches`: the forwards of one
        global batch (data-parallel ranks x accumulation steps x pipeline microbatches);
        `sequence_group`: the ranks that hold the other rows of this rank's microbatches
        (cp, and tp under sequence parallelism; None: this rank holds all);
        `expert_group`: the ranks the experts are split over (ep; None: off)."""
        self.coefficient = router_loss_coefficient(config)
        self.experts, self.top_k = num_experts(config), experts_per_token(config)
        self.sparse_layers = sparse_layers(config)
        self.share = 1.0 / microbatches
        self.sequence_group = sequence_group
        self.expert_group = expert_group
        self.device = next(p.device for m in modules for p in m.parameters())
        self._logits: list[torch.Tensor] = []
        self._collecting = False
        self._step_loss: torch.Tensor | float = 0.0
        self._step_counts: torch.Tensor | None = None  # sparse layers x experts
        self._step_dropped = 0  # (token, expert) pairs routed but not computed
        for module in modules:
            for name, sub in module.named_modules():
                if name.endswith(ROUTER_MODULE):
                    sub.register_forward_hook(self._keep)
                if isinstance(getattr(sub, "ep", None), ExpertCounts):
                    sub.register_forward_hook(self._count_dropped)

    @classmethod
    def of(
        cls,
        modules: list[nn.Module],
        config: object,
        microbatches: int,
        sequence_group: dist.ProcessGroup | None = None,
        expert_group: dist.ProcessGroup | None = None,
    ) -> Routing | None:
        if not is_moe(config):
            return None
        return cls(modules, config, microbatches, sequence_group, expert_group)

    def _keep(self, module: nn.Module, inputs: object, output: tuple) -> None:
        # Not during activation checkpointing's recomputation in the backward.
        if self._collecting:
            self._logits.append(output[0])

    def _count_dropped(self, module: nn.Module, inputs: tuple, output: object) -> None:
        """An expert-parallel layer's pairs routed (its input's top-k) less those whose
        results came back from the experts' ranks."""
        if self._collecting:
            self._step_dropped += inputs[1].numel() - module.ep.pairs_returned

    @contextmanager
    def collecting(self) -> Iterator[list[torch.Tensor]]:
        """Around one forward (of the model or a stage): its routers' logits, in layer
        order, none before or after."""
        logits: list[torch.Tensor] = []
        self._logits, self._collecting = logits, True
        try:
            yield logits
        finally:
            self._collecting, self._logits = False, []

    def empty_tally(self) -> torch.Tensor:
        """What the first pipeline stage starts a microbatch's tally from. It requires a
        gradient so that the tally always does, whichever stages hold sparse layers (the
        pipeline sends gradients back only for outputs that have them)."""
        rows = len(self.sparse_layers) + 1
        return torch.zeros(rows, self.experts, device=self.device, requires_grad=True)

    def tally(self, logits: list[torch.Tensor], layers: list[int]) -> torch.Tensor:
        """One forward's routing over the sparse `layers` (model indices) it ran: each
        layer's picks per expert in its row of the model's sparse layers (no gradient),
        and the summed router probabilities in the last row (with theirs)."""
        picks = torch.zeros(len(self.sparse_layers), self.experts, device=self.device)
        probabilities = torch.zeros(self.experts, device=self.device)
        with torch.no_grad():  # (a fixed-size count, which fake tensors can follow too)
            for layer, scores in zip(layers, logits, strict=True):
                picks[self.sparse_layers.index(layer)] = self._counts(scores)
        for scores in logits:
            probabilities = probabilities + torch.softmax(scores, dim=-1).float().sum(dim=0)
        return torch.cat([picks, probabilities[None]])

    def finish_forward(self, logits: list[torch.Tensor]) -> torch.Tensor | None:
        """Count a whole model's forward; its share of the step's objective (coefficient
        x the load-balancing loss / the global batch's microbatches), None where off."""
        if not logits:
            return None
        term, counts, loss = self.score(self.tally(logits, self.sparse_layers))
        self.record(counts, loss)
        return term

    def score(
        self, tally: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """From a microbatch's whole tally: its term of the step's objective (None where
        the loss is off), its picks per sparse layer and expert, and its share of the
        step's mean loss. Collective over the sequence group where the loss is on."""
        counts = tally[:-1].detach()
        if not self.coefficient:
            return None, counts, None
        loss = self._balance_loss(counts, tally[-1])
        return self.coefficient * self.share * loss, counts, loss.detach() * self.share

    def record(self, counts: torch.Tensor, loss: torch.Tensor | None) -> None:
        """Add a microbatch's picks and loss share to the step's."""
        self._step_counts = counts if self._step_counts is None else self._step_counts + counts
        if loss is not None:
            self._step_loss = self._step_loss + loss

    def _balance_loss(self, counts: torch.Tensor, probabilities: torch.Tensor) -> torch.Tensor:
        """This rank's part of the microbatch's load-balancing loss (all of it where it holds
        every row): E x sum_e T_e P_e, the picks T over all the ranks' rows, the
        probabilities P over its own (module docstring). Every row is picked k times."""
        totals = torch.cat([counts.sum(dim=0), counts.sum().reshape(1) / self.top_k])
        if self.sequence_group is not None:
            dist.all_reduce(totals, group=self.sequence_group)
        picks, rows = totals[:-1], totals[-1]
        return self.experts * torch.sum(picks / rows * (probabilities / rows))

    def _counts(self, logits: torch.Tensor) -> torch.Tensor:
        """Tokens each expert received from one router's logits."""
        chosen = torch.topk(logits, self.top_k, dim=-1).indices.flatten()
        ones = torch.ones_like(chosen, dtype=torch.float32)
        return torch.zeros(self.experts, device=logits.device).index_add_(0, chosen, ones)

    def step_metrics(
        self, data: dist.ProcessGroup | None, pipeline: dist.ProcessGroup | None = None
    ) -> dict[str, float]:
        """The step's mean load-balancing loss (where on) and how unevenly the tokens went:
        per sparse layer the busiest expert's tokens over the mean, its largest and its mean
        over the layers, summed over the `data`-parallel ranks, the sequence group and the
        `pipeline` stages (only the last one scores). Collective."""
        counts = self._step_counts
        if counts is None:
            counts = torch.zeros(len(self.sparse_layers), self.experts, device=self.device)
        loss = torch.as_tensor(self._step_loss, dtype=torch.float32, device=counts.device)
        metrics = self._rank_load(counts) if self.expert_group is not None else {}
        dropped = torch.tensor([float(self._step_dropped)], device=counts.device)
        totals = torch.cat([counts.flatten(), loss.reshape(1), dropped])
        for ranks in (data, self.sequence_group, pipeline):
            if ranks is not None:
                dist.all_reduce(totals, group=ranks)
        counts = totals[:-2].view_as(counts)
        if self.expert_group is not None:
            metrics["expert_dropped_pairs"] = float(totals[-1])
        metrics |= {
            "expert_load_max_over_mean": float(_max_over_mean(counts).max()),
            "expert_load_max_over_mean_avg": float(_max_over_mean(counts).mean()),
        }
        if self.coefficient:
            metrics["router_loss"] = float(totals[-2])
        self._step_counts, self._step_loss, self._step_dropped = None, 0.0, 0
        return metrics

    def _rank_load(self, counts: torch.Tensor) -> dict[str, float]:
        """Under expert parallelism, the rows the busiest rank of an ep group received in
        the step over the group's mean, per sparse layer (what the planner's
        `moe_imbalance` assumes): the largest over layers and groups, and the largest
        group's mean over layers. `counts`: this rank's picks. Collective (all ranks)."""
        received = counts.clone()
        dist.all_reduce(received, group=self.expert_group)
        ep = dist.get_world_size(self.expert_group)
        ratio = _max_over_mean(received.view(len(self.sparse_layers), ep, -1).sum(dim=-1))
        worst = torch.stack([ratio.max(), ratio.mean()])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return {
            "expert_rank_load_max_over_mean": float(worst[0]),
            "expert_rank_load_max_over_mean_avg": float(worst[1]),
        }


def _max_over_mean(load: torch.Tensor) -> torch.Tensor:
    """Per row (sparse layer), its largest entry over its mean (0 where it is empty)."""
    return load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9)
