"""Model converters: changes a run makes to the model's modules before it is parallelised.

A converter swaps or rewraps layers in place (the CPU Linear layers on a faster
kernel library; LoRA adapters beside the targeted layers) without changing the base's
parameter names, so checkpoints and consolidation read the base as before. The run's
list is decided here, in one place, from its training and LoRA configuration;
`parallelize` applies the list first, on the meta model, and asks each converter, through
`ModelConverter` alone, what it needs from the parallelisation (the ops activation
checkpointing keeps, the initial values of the parameters it adds): a new converter is a
new family here, with no edit of `parallelize`. The planner reads only the names, to pick
the device profile's rate table for the layers a converter runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import nn

from meshtrain.config import LoraSettings, TrainingConfig
from meshtrain.models import cpu_linear
from meshtrain.models.llama.weights import WeightSource
from meshtrain.models.lora import lora_converter


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

    def weights(self, base: WeightSource) -> WeightSource:
        """Where the converted model's weights come from: `base`, plus the initial values
        of the parameters `convert` added (`base` itself when it added none)."""
        ...


# Each family: (training config, device type, tensor_parallel=) -> a converter or None.
_FAMILIES: tuple[Callable[..., ModelConverter | None], ...] = (cpu_linear.linear_converter,)


def build_converters(
    training: TrainingConfig,
    device_type: str,
    *,
    tensor_parallel: bool,
    lora: LoraSettings | None = None,
    sharded: bool = False,
) -> list[ModelConverter]:
    """The converters a run on `device_type` goes through, in the order they apply (LoRA
    last: it wraps whatever forward the Linear layers have by then)."""
    found = (family(training, device_type, tensor_parallel=tensor_parallel) for family in _FAMILIES)
    converters: list[ModelConverter] = [c for c in found if c is not None]
    if lora is not None:
        converters.append(lora_converter(lora, training, sharded=sharded))
    return converters


def converter_names(
    training: TrainingConfig,
    device_type: str,
    *,
    tensor_parallel: bool,
    lora: LoraSettings | None = None,
) -> tuple[str, ...]:
    """The names of `build_converters`' list (what the planner and the run's tags see)."""
    converters = build_converters(training, device_type, tensor_parallel=tensor_parallel, lora=lora)
    return tuple(c.name for c in converters)
