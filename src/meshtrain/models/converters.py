"""Model converters: changes a run makes to the model's modules before it is parallelised.

A converter swaps or rewraps layers in place (the CPU Linear layers on a faster
kernel library today; LoRA adapters and other kernels tomorrow) without changing
parameter names, so
checkpoints and consolidation never know it ran. The run's list is decided here, in
one place, from its training configuration; `parallelize` applies the list first,
on the meta model, and the planner reads only the names, to pick the device
profile's rate table for the layers a converter runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import nn

from meshtrain.config import TrainingConfig
from meshtrain.models import cpu_linear


class ModelConverter(Protocol):
    """What `parallelize` needs of a converter."""

    name: str

    @property
    def saved_ops(self) -> frozenset:
        """Ops whose outputs selective activation checkpointing keeps (its matmuls)."""
        ...

    def convert(self, model: nn.Module) -> None:
        """Change `model` in place, keeping its parameter names."""
        ...


# Each family: (training config, device type, tensor_parallel=) -> a converter or None.
_FAMILIES: tuple[Callable[..., ModelConverter | None], ...] = (cpu_linear.linear_converter,)


def build_converters(
    training: TrainingConfig, device_type: str, *, tensor_parallel: bool
) -> list[ModelConverter]:
    """The converters a run on `device_type` goes through, in the order they apply."""
    found = (family(training, device_type, tensor_parallel=tensor_parallel) for family in _FAMILIES)
    return [converter for converter in found if converter is not None]


def converter_names(
    training: TrainingConfig, device_type: str, *, tensor_parallel: bool
) -> tuple[str, ...]:
    """The names of `build_converters`' list (what the planner and the run's tags see)."""
    return tuple(
        c.name for c in build_converters(training, device_type, tensor_parallel=tensor_parallel)
    )
