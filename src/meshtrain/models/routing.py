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

Under context parallelism a microbatch's rows are spread over the cp ranks, and the loss
is not a sum over rows: its T and P multiply. T comes from top-k and has no gradient, so
the ranks sum their counts and rows (one small all-reduce per forward) and each adds
E x sum_e T_e P_e with its own probabilities only: the ranks' terms add up to the
microbatch's loss, and each rank's routers get their exact gradient.

Each step also counts the tokens each expert received, for the run's metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.models.moe_config import (
    experts_per_token,
    is_moe,
    num_experts,
    router_loss_coefficient,
)

ROUTER_MODULE = "mlp.gate"


class Routing:
    """Collects the routers' logits during each training forward: its loss term, and the
    step's tokens per expert."""

    def __init__(
        self,
        modules: list[nn.Module],
        config: object,
        microbatches: int,
        sequence_group: dist.ProcessGroup | None = None,
    ) -> None:
        """`modules`: the rank's model (or stages); `microbatches`: those of one global
        batch (data-parallel ranks x accumulation steps); `sequence_group`: the ranks that
        hold the other rows of this rank's microbatches (cp; None: this rank holds all)."""
        self.coefficient = router_loss_coefficient(config)
        self.experts, self.top_k = num_experts(config), experts_per_token(config)
        self.share = 1.0 / microbatches
        self.sequence_group = sequence_group
        self._logits: list[torch.Tensor] = []
        self._collecting = False
        self._step_loss: torch.Tensor | float = 0.0
        self._step_counts: torch.Tensor | None = None  # layers x experts
        for module in modules:
            for name, sub in module.named_modules():
                if name.endswith(ROUTER_MODULE):
                    sub.register_forward_hook(self._keep)

    @classmethod
    def of(
        cls,
        modules: list[nn.Module],
        config: object,
        microbatches: int,
        sequence_group: dist.ProcessGroup | None = None,
    ) -> Routing | None:
        return cls(modules, config, microbatches, sequence_group) if is_moe(config) else None

    def _keep(self, module: nn.Module, inputs: object, output: tuple) -> None:
        # Not during activation checkpointing's recomputation in the backward.
        if self._collecting:
            self._logits.append(output[0])

    @contextmanager
    def collecting(self) -> Iterator[None]:
        """Around one training forward: its routers' logits, none before or after."""
        self._logits, self._collecting = [], True
        try:
            yield
        finally:
            self._collecting = False

    def finish_forward(self) -> torch.Tensor | None:
        """Count the forward's routing; its share of the step's objective (coefficient x
        the load-balancing loss / the global batch's microbatches), None where it is off."""
        logits, self._logits = self._logits, []
        if not logits:
            return None
        with torch.no_grad():  # (a fixed-size count, which fake tensors can follow too)
            counts = torch.stack([self._counts(layer) for layer in logits])
            self._step_counts = counts if self._step_counts is None else self._step_counts + counts
        if not self.coefficient:
            return None
        loss = self._balance_loss(logits, counts)
        self._step_loss = self._step_loss + loss.detach() * self.share
        return self.coefficient * self.share * loss

    def _balance_loss(self, logits: list[torch.Tensor], counts: torch.Tensor) -> torch.Tensor:
        """This rank's part of the microbatch's load-balancing loss (all of it where it holds
        every row): E x sum_e T_e P_e, the picks T over all the ranks' rows, the
        probabilities P over its own (module docstring)."""
        probabilities = sum(torch.softmax(layer, dim=-1).float().sum(dim=0) for layer in logits)
        rows = sum(layer.shape[0] for layer in logits)
        with torch.no_grad():
            totals = torch.cat([counts.sum(dim=0), counts.new_tensor([rows])])
            if self.sequence_group is not None:
                dist.all_reduce(totals, group=self.sequence_group)
        picks, rows = totals[:-1], totals[-1]
        return self.experts * torch.sum(picks / rows * (probabilities / rows))

    def _counts(self, logits: torch.Tensor) -> torch.Tensor:
        """Tokens each expert received from one router's logits."""
        chosen = torch.topk(logits, self.top_k, dim=-1).indices.flatten()
        ones = torch.ones_like(chosen, dtype=torch.float32)
        return torch.zeros(self.experts, device=logits.device).index_add_(0, chosen, ones)

    def step_metrics(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """The step's mean load-balancing loss (where on) and how unevenly the tokens went:
        per sparse layer the busiest expert's tokens over the mean, its largest and its mean
        over the layers, summed over `group` (the data- and context-parallel ranks). Collective."""
        if self._step_counts is None:
            return {}
        counts = self._step_counts
        loss = torch.as_tensor(self._step_loss, dtype=torch.float32, device=counts.device)
        totals = torch.cat([counts.flatten(), loss.reshape(1)])
        if group is not None:
            dist.all_reduce(totals, group=group)
        counts = totals[:-1].view_as(counts)
        imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)
        metrics = {
            "expert_load_max_over_mean": float(imbalance.max()),
            "expert_load_max_over_mean_avg": float(imbalance.mean()),
        }
        if self.coefficient:
            metrics["router_loss"] = float(totals[-1])
        self._step_counts, self._step_loss = None, 0.0
        return metrics
