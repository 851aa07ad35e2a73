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
from typing import TYPE_CHECKING, Protocol

from meshtrain.config import LoraSettings, TrainingConfig
from meshtrain.models import cpu_matmul

if TYPE_CHECKING:
    from torch import nn

    from meshtrain.models.llama.weights import WeightSource

LORA = "lora"


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


def converter_names(
    training: TrainingConfig,
    *,
    on_cpu: bool,
    tensor_parallel: bool,
    lora: LoraSettings | None = None,
) -> tuple[str, ...]:
    """The converters a run goes through, by name, in the order they apply (LoRA last: it
    wraps whatever forward the Linear layers have by then). Decided here without torch,
    so the planner (which reads only the names) imports no modelling code."""
    names = []
    if (
        cpu_matmul.cpu_matmul_choice(
            training.cpu_matmul, on_cpu=on_cpu, tensor_parallel=tensor_parallel
        )
        == "onednn"
    ):
        names.append(cpu_matmul.NAME)
    if lora is not None:
        names.append(LORA)
    return tuple(names)


def build_converters(
    training: TrainingConfig,
    device_type: str,
    *,
    tensor_parallel: bool,
    lora: LoraSettings | None = None,
    sharded: bool = False,
) -> list[ModelConverter]:
    """The converters `converter_names` names, built (a new family: a name there and its
    builder here)."""
    from meshtrain.models.cpu_linear import OneDnnLinearConverter  # noqa: PLC0415  (torch)
    from meshtrain.models.lora import lora_converter  # noqa: PLC0415  (torch)

    builders: dict[str, Callable[[], ModelConverter]] = {
        cpu_matmul.NAME: OneDnnLinearConverter,
        LORA: lambda: lora_converter(lora, training, sharded=sharded),
    }
    names = converter_names(
        training, on_cpu=device_type == "cpu", tensor_parallel=tensor_parallel, lora=lora
    )
    return [builders[name]() for name in names]
