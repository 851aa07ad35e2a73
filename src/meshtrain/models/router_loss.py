"""A mixture of experts' load-balancing loss, as its model defines it, in a training run.

transformers computes the loss from every sparse layer's router logits of one forward
(`load_balancing_loss_func` of the model's own module: the token counts per expert and
the mean router probabilities summed over the layers, then multiplied) and adds
`router_aux_loss_coef` times it to the forward's loss. meshtrain runs its layers itself
and normalises the language-model loss over the whole global batch, so it collects the
routers' logits of each forward here and adds the coefficient times the loss, divided
by the microbatches of the global batch: the step's objective is the mean over its
microbatches of what transformers adds to each, whatever the number of data-parallel
ranks and accumulation steps the same microbatches are spread over.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from meshtrain.models.moe_config import experts_per_token, num_experts, router_loss_coefficient

ROUTER_MODULE = "mlp.gate"


class RouterLoss:
    """Collects the routers' logits during a training forward and gives its loss term."""

    def __init__(self, modules: list[nn.Module], config: object, microbatches: int) -> None:
        """`modules`: the rank's model (or stages); `microbatches`: those of one global
        batch (data-parallel ranks x accumulation steps)."""
        self.coefficient = router_loss_coefficient(config)
        self.experts, self.top_k = num_experts(config), experts_per_token(config)
        self.share = 1.0 / microbatches
        self._logits: list[torch.Tensor] = []
        self._collecting = False
        self._loss_func = None
        for module in modules:
            for name, sub in module.named_modules():
                if name.endswith(ROUTER_MODULE):
                    sub.register_forward_hook(self._keep)
                    self._loss_func = sys.modules[type(sub).__module__].load_balancing_loss_func

    @classmethod
    def of(cls, modules: list[nn.Module], config: object, microbatches: int) -> RouterLoss | None:
        """The router loss of a mixture of experts whose config turns it on, else None."""
        return cls(modules, config, microbatches) if router_loss_coefficient(config) else None

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

    def term(self) -> torch.Tensor:
        """This microbatch's share of the step's objective: coefficient x the load-balancing
        loss of the forward just collected / the global batch's microbatches."""
        assert self._loss_func is not None
        loss = self._loss_func(tuple(self._logits), self.experts, self.top_k)
        self._logits = []
        self.last = loss.detach()
        return self.coefficient * self.share * loss
