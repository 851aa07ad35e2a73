"""LoRA on parameters that are not a Linear layer's: a mixture of experts' routers and
3-D experts (PEFT's `target_parameters`; which ones, `models.parameter_targets`).

The module holding such a parameter gets its class mixed with `AdaptedParameters` and
two `ParameterDict`s, `lora_A` and `lora_B`, keyed by the parameter's name; its forward
runs with each adapted parameter replaced by the merged weight PEFT's `ParamWrapper`
computes, W + scaling * B @ A (one batched product per expert for the experts, in W's
dtype, autocast off, as PEFT folds it), so the module's own forward (transformers', or
`ExpertShard`'s under expert parallelism) runs unchanged. Like PEFT, each forward builds
the whole merged weight, which backward keeps (the planner counts it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from meshtrain.models.parameter_targets import ParameterTarget, adapter_names, adapter_shapes


class AdaptedParameters:
    """Mixed into a module's own class: some of its parameters carry LoRA adapters."""

    lora_A: nn.ParameterDict
    lora_B: nn.ParameterDict
    lora_scaling: dict[str, float]

    def add_parameter_adapter(
        self, name: str, rank: int, scaling: float, dtype: torch.dtype, experts: int | None
    ) -> None:
        """Adapters of rank `rank` for parameter `name` (of `experts` of the module's
        experts when a rank holds some of them only; None: as many as it holds)."""
        if not hasattr(self, "lora_scaling"):
            self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
            self.lora_scaling = {}
        weight = getattr(self, name)
        shape = tuple(weight.shape)
        if experts is not None:
            shape = (experts, *shape[1:])
        for adapters, adapter_shape in zip(
            (self.lora_A, self.lora_B), adapter_shapes(shape, rank), strict=True
        ):
            empty = torch.empty(adapter_shape, dtype=dtype, device=weight.device)
            adapters[name] = nn.Parameter(empty)
        self.lora_scaling[name] = scaling

    def forward(self, *args: object, **kwargs: object) -> object:
        with self._merged_weights():
            return super().forward(*args, **kwargs)  # type: ignore[misc]

    @contextmanager
    def _merged_weights(self) -> Iterator[None]:
        """The module's adapted parameters replaced by their merged weights for the forward
        (whatever tensor holds them now: FSDP2 swaps in its gathered ones before)."""
        held = self._parameters  # type: ignore[attr-defined]
        kept = {name: held[name] for name in self.lora_scaling}
        try:
            for name, weight in kept.items():
                held[name] = self.merged(name, weight)
            yield
        finally:
            held.update(kept)

    def merged(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """PEFT's merged weight: per expert W + s B A as one batched product in W's dtype
        (its `_LoraFactorsProxy`); a 2-D weight plus s (B @ A) (its `get_delta_weight`)."""
        a, b, scaling = self.lora_A[name], self.lora_B[name], self.lora_scaling[name]
        if weight.dim() == 3:
            with torch.autocast(weight.device.type, enabled=False):
                return torch.baddbmm(weight, b.to(weight.dtype), a.to(weight.dtype), alpha=scaling)
        return weight + ((b @ a) * scaling).to(weight.dtype)


@functools.cache
def adapted_class(base: type[nn.Module]) -> type[nn.Module]:
    """`base` with adapted parameters (one class per base class, made once)."""
    return type(f"Lora{base.__name__}", (AdaptedParameters, base), {})


def add_parameter_adapters(
    model: nn.Module, targets: dict[str, ParameterTarget], dtype: torch.dtype
) -> dict[str, tuple[int, ...]]:
    """Adapters on the parameters of `targets` (full names), in place; their names and
    Hugging Face shapes."""
    shapes = {}
    for name, target in targets.items():
        path, _, short = name.rpartition(".")
        module = model.get_submodule(path)
        if not isinstance(module, AdaptedParameters):
            module.__class__ = adapted_class(type(module))
        module.add_parameter_adapter(short, target.rank, target.scaling, dtype, None)
        a, b = adapter_names(name)
        shapes[a], shapes[b] = module.lora_A[short].shape, module.lora_B[short].shape
    return {name: tuple(shape) for name, shape in shapes.items()}


def carry_adapters(source: nn.Module, target: nn.Module, experts: int) -> None:
    """Give `target` (the module taking `source`'s place, holding `experts` of its
    experts) the adapters `source` has, empty and as trainable."""
    if not isinstance(source, AdaptedParameters):
        return
    target.__class__ = adapted_class(type(target))
    for name, scaling in source.lora_scaling.items():
        rank = source.lora_A[name].shape[-2]
        target.add_parameter_adapter(name, rank, scaling, source.lora_A[name].dtype, experts)
