"""Parameters and gradients laid out in one contiguous buffer each.

Every trainable parameter's storage becomes a view into `params`, and its
`.grad` a view into `grads`, so autograd accumulates straight into the buffer
the collectives use (no copy before the all-reduce or reduce-scatter) and the
optimizer can work on plain slices. Matrices come first and vectors (norms,
biases) after, so the weight-decay boundary is one offset. The buffer is
padded to a multiple of `num_shards` so ZeRO-1 cuts it into equal pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Slot:
    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


class FlatParameters:
    def __init__(self, model: nn.Module, num_shards: int = 1) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # Stable order: decayed (ndim >= 2) first, then the rest, each in module order.
        ordered = [np for np in named if np[1].ndim >= 2] + [np for np in named if np[1].ndim < 2]
        self.parameters = [p for _, p in ordered]
        self.slots: list[Slot] = []
        offset = 0
        for name, p in ordered:
            self.slots.append(Slot(name, offset, p.numel(), tuple(p.shape)))
            offset += p.numel()
        self.numel = offset
        self.decay_numel = sum(p.numel() for _, p in ordered if p.ndim >= 2)
        self.padded_numel = -(-offset // num_shards) * num_shards
        first = self.parameters[0]
        self.params = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
        self.grads = torch.zeros_like(self.params)
        for slot, p in zip(self.slots, self.parameters, strict=True):
            view = self.params[slot.offset : slot.offset + slot.numel].view(slot.shape)
            view.copy_(p.detach())
            p.data = view
            p.grad = self.grads[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def zero_grad(self) -> None:
        """Zero in place: the `.grad` views must keep pointing into the buffer."""
        self.grads.zero_()

    def check_views(self) -> None:
        """Fail loudly if anything replaced a parameter's storage or its `.grad`."""
        for slot, p in zip(self.slots, self.parameters, strict=True):
            base = self.params.data_ptr() + slot.offset * self.params.element_size()
            gbase = self.grads.data_ptr() + slot.offset * self.grads.element_size()
            if p.data_ptr() != base or p.grad is None or p.grad.data_ptr() != gbase:
                raise RuntimeError(f"parameter {slot.name} no longer lives in the flat buffer")
