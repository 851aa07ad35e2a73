"""LoRA adapters: the frozen base plus a trained low-rank update on the chosen Linear layers
(and on a mixture of experts' routers and experts, `models.lora_parameters`).

A model converter (`models.converters`): on the meta model, before any parallelism, every
base parameter is frozen and each targeted Linear layer becomes a LoRA layer in place
(its class swapped, its `weight`/`bias` untouched, so the base keeps its Hugging Face
names and loads as before), with two new children: `lora_A` (r x in) and `lora_B`
(out x r). The forward is PEFT's, `base(x) + lora_B(lora_A(dropout(x))) * scaling` (to
rounding), so the adapters' names, values and arithmetic are PEFT's, and PEFT's key for
an adapter is
`base_model.model.` + its name here (`checkpoint.consolidate.lora`). A targeted embedding
gets PEFT's two parameters instead, `lora_embedding_A` (r x vocabulary) and
`lora_embedding_B` (hidden x r): `base(ids) + (A.T[ids] @ B.T) * scaling`, no dropout
(PEFT applies none there).

The adapters start as PEFT's do (A Kaiming-uniform, B zeros; an embedding's A zeros, B
standard normal), each drawn from a generator seeded by the run's seed and the adapter's
name, so every layout, stage and shard starts from the same values. How they are split
under tensor parallelism is in `distributed.lora_parallel`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from meshtrain.config import LoraSettings, ModelConfig, TrainingConfig
from meshtrain.config_lora import check_pretrained_base
from meshtrain.distributed.tensor_parallel import ParameterSharding
from meshtrain.models.converters import LORA
from meshtrain.models.llama.parameter_names import EMBEDDING_ADAPTERS
from meshtrain.models.llama.weights import WeightSource
from meshtrain.models.lora_parameters import add_parameter_adapters
from meshtrain.models.parameter_targets import parameter_adapters
from meshtrain.models.shapes import (
    embedding_adapter_names,
    is_embedding,
    saved_module_shapes,
    select_lora_targets,
)

NAME = LORA  # the converter's name, as `converter_names` gives it


class LoraLayer:
    """Mixed into a Linear layer's own class (plain, or another converter's), so its base
    forward stays whatever it was."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float
    adapters_off = False  # a preference reference's forward: the base alone

    def add_adapters(self, r: int, dropout: float, scaling: float, dtype: torch.dtype) -> None:
        weight = self.weight  # type: ignore[attr-defined]
        kwargs = {"bias": False, "device": weight.device, "dtype": dtype}
        self.lora_A = nn.Linear(self.in_features, r, **kwargs)  # type: ignore[attr-defined]
        self.lora_B = nn.Linear(r, self.out_features, **kwargs)  # type: ignore[attr-defined]
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """PEFT's `base(x) + lora_B(lora_A(dropout(x))) * scaling`, with the scaling on the
        rank-r intermediate and B's product added in place of a separate sum: the same
        value to rounding, without two passes over the layer's whole output (on CPU at
        110M they cost a quarter of the frozen layer's forward and backward)."""
        result = super().forward(x)  # type: ignore[misc]
        if self.adapters_off:
            return result
        adapter_in = self.lora_dropout(x).to(self.lora_A.weight.dtype)
        low_rank = self.lora_A(adapter_in) * self.scaling
        if isinstance(result, DTensor):  # sharded: DTensor's rules for linear and add
            return result + self.lora_B(low_rank).to(result.dtype)
        rows = result.flatten(0, -2)
        b = self.lora_B.weight.t().to(result.dtype)
        return torch.addmm(rows, low_rank.flatten(0, -2).to(result.dtype), b).view_as(result)


class LoraEmbedding:
    """Mixed into an Embedding's own class: PEFT's embedding adapter, as two parameters of
    the embedding itself (`lora_embedding_A`, `lora_embedding_B`, PEFT's names)."""

    lora_embedding_A: nn.Parameter  # r x vocabulary
    lora_embedding_B: nn.Parameter  # hidden x r
    scaling: float
    adapters_off = False

    def add_adapters(self, r: int, scaling: float, dtype: torch.dtype) -> None:
        weight = self.weight  # type: ignore[attr-defined]
        vocabulary, hidden = weight.shape
        kwargs = {"device": weight.device, "dtype": dtype}
        self.lora_embedding_A = nn.Parameter(torch.empty(r, vocabulary, **kwargs))
        self.lora_embedding_B = nn.Parameter(torch.empty(hidden, r, **kwargs))
        self.scaling = scaling

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """PEFT's `base(ids) + (A.T[ids] @ B.T) * scaling` (A's column at the padding id
        gets no gradient, as the base's row does not)."""
        result = super().forward(ids)  # type: ignore[misc]
        if self.adapters_off:
            return result
        after_a = F.embedding(ids, self.lora_embedding_A.T, self.padding_idx)  # type: ignore[attr-defined]
        return result + (after_a @ self.lora_embedding_B.T) * self.scaling


@contextlib.contextmanager
def adapters_disabled(modules: list[nn.Module]) -> Iterator[None]:
    """Every LoRA adapter of `modules` switched off (PEFT's `disable_adapter`): the frozen
    base's forward, a preference loss's reference without a second model."""
    layers = [
        m for root in modules for m in root.modules() if isinstance(m, LoraLayer | LoraEmbedding)
    ]
    for layer in layers:
        layer.adapters_off = True
    try:
        yield
    finally:
        for layer in layers:
            layer.adapters_off = False


@functools.cache
def lora_class(base: type[nn.Module]) -> type[nn.Module]:
    """`base` with LoRA's forward (one class per base class, made once)."""
    mixin = LoraEmbedding if issubclass(base, nn.Embedding) else LoraLayer
    return type(f"Lora{base.__name__}", (mixin, base), {})


def linear_names(model: nn.Module) -> list[str]:
    """Every Linear layer's dotted name."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def target_names(model: nn.Module, settings: LoraSettings) -> list[str]:
    """The Linear layers `settings.target_modules` selects (`models.shapes`' rules, which
    the planner reads from the config alone); refuses a target the model lacks."""
    modules = [name for name, _ in model.named_modules()]
    return select_lora_targets(linear_names(model), modules, settings, model.config.model_type)


@dataclass
class LoraConverter:
    """Freezes the base and adds LoRA adapters to the targeted Linear layers, in place;
    the modules of `modules_to_save` stay trainable (PEFT's trained copies: the base
    parameter itself is trained, under its own name, as nothing needs the original).

    `base_dtype`: what the frozen base is held in (None: as built); `adapter_dtype`: the
    adapters' parameters (fp32, or bf16 where ZeRO keeps fp32 masters of them)."""

    settings: LoraSettings
    seed: int
    base_dtype: torch.dtype | None = None
    adapter_dtype: torch.dtype = torch.float32
    name: str = NAME
    # Filled by `convert`: each adapter parameter's Hugging Face shape (its init needs it).
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def saved_ops(self) -> frozenset:
        return frozenset()

    def convert(self, model: nn.Module) -> None:
        targets = target_names(model, self.settings)
        names = [name for name, _ in model.named_parameters()]
        adapted = parameter_adapters(model.config.model_type, names, self.settings)
        saved = saved_module_shapes(model.config, self.settings, targets)
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        if self.base_dtype is not None:
            model.to(self.base_dtype)
        for name in saved:  # trained whole, in the adapters' dtype; their values the base's
            parameter = model.get_parameter(name)
            parameter.data = parameter.data.to(self.adapter_dtype)
            parameter.requires_grad_(True)
        s = self.settings
        for name in targets:
            layer = model.get_submodule(name)
            layer.__class__ = lora_class(type(layer))
            if is_embedding(name):
                layer.add_adapters(s.r, s.scaling, self.adapter_dtype)
                a, b = embedding_adapter_names(name)
                self.shapes[a] = tuple(layer.lora_embedding_A.shape)
                self.shapes[b] = tuple(layer.lora_embedding_B.shape)
                continue
            layer.add_adapters(s.r, s.lora_dropout, s.scaling, self.adapter_dtype)
            self.shapes[f"{name}.lora_A.weight"] = (s.r, layer.in_features)
            self.shapes[f"{name}.lora_B.weight"] = (layer.out_features, s.r)
        self.shapes.update(add_parameter_adapters(model, adapted, self.adapter_dtype))

    def weights(self, base: WeightSource) -> AdapterInit:
        """`base`'s weights, with the adapters' initial values for the adapters."""
        return AdapterInit(base, self.shapes, self.seed)


@dataclass
class AdapterInit:
    """A weight source whose adapters start as PEFT's (A Kaiming-uniform, B zeros; an
    embedding's A zeros, B standard normal), each drawn from (seed, name); every other
    name comes from `base`."""

    base: WeightSource
    shapes: dict[str, tuple[int, ...]]
    seed: int

    def full(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        embedding_a, embedding_b = EMBEDDING_ADAPTERS
        if ".lora_B." in name or name.endswith(embedding_a):
            return torch.zeros(shape)
        stream = (self.seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63
        generator = torch.Generator().manual_seed(stream)
        if name.endswith(embedding_b):
            return torch.randn(shape, generator=generator)
        # PEFT's (and nn.Linear's) init: bound 1/sqrt(fan_in); the experts' A (E, r, in)
        # drawn as PEFT holds it, one (E r) x in matrix.
        tensor = torch.empty(math.prod(shape[:-1]), shape[-1])
        nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
        return tensor.view(shape)

    def local(self, name: str, spec: ParameterSharding, tp_rank: int, tp: int) -> torch.Tensor:
        if name in self.shapes:
            return spec.local_piece(self.full(name), tp_rank, tp)
        return self.base.local(name, spec, tp_rank, tp)


def lora_converter(
    settings: LoraSettings, training: TrainingConfig, *, sharded: bool
) -> LoraConverter:
    """The run's LoRA converter, holding the frozen base in the training precision.

    bf16 autocast: the base in bf16, the adapters fp32. bf16_master: the whole model is
    bf16 already, the adapters too, with fp32 masters in the optimizer. Under sharded
    data parallelism FSDP2's policy does the casting and its shards are the masters."""
    bf16 = training.mixed_precision == "bf16" and not sharded
    master = training.mixed_precision == "bf16_master" and not sharded
    return LoraConverter(
        settings,
        training.seed,
        base_dtype=torch.bfloat16 if bf16 else None,
        adapter_dtype=torch.bfloat16 if master else torch.float32,
    )


def check_lora_targets(model: ModelConfig) -> None:
    """Before any node runs: LoRA on a pretrained base, and targets the model has (read
    from the init_from folder's config, or model.config; nothing is allocated)."""
    from meshtrain.models.builder import (  # noqa: PLC0415  (builder imports this module's users)
        build_meta_model,
        build_model_config,
        resolve_init_from,
    )

    settings = model.lora
    if settings is None:
        return
    check_pretrained_base(settings, model.init_from)
    if model.init_from and not Path(model.init_from).is_dir():
        return  # a hub id: its config is read when the planner downloads it
    init_from = resolve_init_from(model.init_from) if model.init_from else None
    config = build_model_config(
        model.architecture, model.config, vocab_size=None, init_from=init_from
    )
    target_names(build_meta_model(config), settings)
