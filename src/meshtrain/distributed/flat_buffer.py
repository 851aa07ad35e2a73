"""Parameters and gradients laid out in one contiguous buffer each.

Every trainable parameter's storage (a DTensor's local shard under tensor
parallelism) becomes a view into `params`, and its `.grad` a view into
`grads`, so autograd accumulates straight into the buffer the collectives
use (no copy before the all-reduce or reduce-scatter) and the optimizer can
work on plain slices. Parameters are ordered into runs that share a weight
decay setting and a copy count (how many tp ranks hold each element, which
the global gradient norm must divide out). The buffer is padded to a
multiple of `num_shards` so ZeRO-1 cuts it into equal pieces.

With bf16 parameters the gradients can be kept in fp32 (`grad_dtype`), as
Megatron's `main_grad` does: autograd cannot accumulate a bf16 parameter's
gradient into an fp32 tensor, so each parameter's bf16 `.grad` is added into
its fp32 view (`parameter.main_grad`) by a post-accumulate hook as soon as the
backward produces it, and dropped. Either way `main_grad` is where a
parameter's accumulated gradient lives (`tensor_parallel.accumulated_grad`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshtrain.distributed.tensor_parallel import ParameterSharding, local_tensor, unsharded


@dataclass(frozen=True)
class Slot:
    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    position: int  # where the parameter came in the model's order (the buffer sorts them)


@dataclass(frozen=True)
class Run:
    """A contiguous range of the buffer whose parameters are treated alike."""

    start: int
    end: int
    weight_decay: bool
    copies: int


class FlatParameters:
    def __init__(
        self,
        parameters: nn.Module | Iterable[tuple[str, torch.Tensor]],
        num_shards: int = 1,
        sharding: dict[str, ParameterSharding] | None = None,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        """`parameters`: a module, or (name, parameter) pairs (e.g. of several stages);
        `grad_dtype`: the gradient buffer's dtype (default: the parameters')."""
        if isinstance(parameters, nn.Module):
            sharding = sharding or unsharded(parameters)
            parameters = parameters.named_parameters()
        named = [(n, p) for n, p in parameters if p.requires_grad]
        position = {n: i for i, (n, _) in enumerate(named)}
        sharding = sharding or {n: ParameterSharding(n, None, 1) for n, _ in named}

        def kind(item: tuple[str, torch.Tensor]) -> tuple[bool, int]:
            name, parameter = item
            # Matrices and embeddings are decayed; norms and biases are not.
            return (parameter.ndim < 2, sharding[name].copies)

        ordered = sorted(named, key=kind)  # stable: module order within a kind
        self.parameters = [p for _, p in ordered]
        self.slots: list[Slot] = []
        self.runs: list[Run] = []
        offset = 0
        for name, p in ordered:
            local = local_tensor(p)
            self.slots.append(Slot(name, offset, local.numel(), tuple(local.shape), position[name]))
            no_decay, copies = kind((name, p))
            if self.runs and (not self.runs[-1].weight_decay, self.runs[-1].copies) == (
                no_decay,
                copies,
            ):
                last = self.runs[-1]
                self.runs[-1] = Run(last.start, offset + local.numel(), last.weight_decay, copies)
            else:
                self.runs.append(Run(offset, offset + local.numel(), not no_decay, copies))
            offset += local.numel()
        self.numel = offset
        self.padded_numel = -(-offset // num_shards) * num_shards
        first = local_tensor(self.parameters[0])
        self.params = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
        self.grads = torch.zeros_like(self.params, dtype=grad_dtype or first.dtype)
        # Gradients of another dtype than the parameters are accumulated by a hook.
        self.separate_grads = self.grads.dtype != self.params.dtype
        self._hooks = []
        for slot, p in zip(self.slots, self.parameters, strict=True):
            local = local_tensor(p)
            view = self.params[slot.offset : slot.offset + slot.numel].view(slot.shape)
            view.copy_(local.detach())
            local.data = view
            grad = self.grads[slot.offset : slot.offset + slot.numel].view(slot.shape)
            p.main_grad = grad
            if self.separate_grads:
                p.grad = None
                self._hooks.append(p.register_post_accumulate_grad_hook(_add_to_main_grad))
                continue
            if isinstance(p, DTensor):
                grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False)
            p.grad = grad

    def index(self) -> dict:
        """Where each parameter's elements are in the buffer, as JSON (saved with each
        checkpoint shard, so optimizer moments can be re-cut for another layout)."""
        return {
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "slots": [[s.name, s.offset, s.numel, list(s.shape)] for s in self.slots],
        }

    def zero_grad(self) -> None:
        """Zero in place: the `.grad` views must keep pointing into the buffer."""
        self.grads.zero_()

    def check_views(self) -> None:
        """Fail loudly if anything replaced a parameter's storage or its `.grad`."""
        for slot, p in zip(self.slots, self.parameters, strict=True):
            base = self.params.data_ptr() + slot.offset * self.params.element_size()
            gbase = self.grads.data_ptr() + slot.offset * self.grads.element_size()
            if self.separate_grads:
                grad = p.main_grad if p.grad is None else None
            else:
                grad = None if p.grad is None else local_tensor(p.grad)
            if local_tensor(p).data_ptr() != base or grad is None or grad.data_ptr() != gbase:
                raise RuntimeError(f"parameter {slot.name} no longer lives in the flat buffer")


def collect_assigned_grads(parameters: Iterable[torch.Tensor]) -> None:
    """Move into the fp32 buffer the gradients that were assigned to `.grad` rather than
    accumulated by autograd, which runs no post-accumulate hook (torch's zero-bubble
    pipeline schedules assign each weight-gradient pass's result)."""
    for parameter in parameters:
        main = getattr(parameter, "main_grad", None)
        grad = parameter.grad
        if main is not None and grad is not None and local_tensor(grad).dtype != main.dtype:
            _add_to_main_grad(parameter)


def _add_to_main_grad(parameter: torch.Tensor) -> None:
    """Post-accumulate hook: move this backward's gradient into the fp32 buffer view."""
    grad = parameter.grad
    if isinstance(grad, DTensor) and grad.placements != parameter.placements:
        # Autograd may hand a DTensor parameter its gradient in another placement (a
        # replicated value of a sharded weight): bring it to the parameter's.
        grad = grad.redistribute(parameter.device_mesh, parameter.placements)
    parameter.main_grad.add_(local_tensor(grad))
    parameter.grad = None
