"""Build a Hugging Face causal LM from `model.*` parameters, identically on every rank.

The model is created on the meta device (no storage); `build_model` fills a whole one
on the CPU (one process, the reference of the tests), the trainer only its own shards
(`meshtrain.models.llama.weights.materialize`). Both draw the same weights.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from meshtrain.distributed.tensor_parallel import unsharded
from meshtrain.models.config_fields import (
    DEFAULT_ARCHITECTURE,
    build_model_config,
    check_model_fields,
    known_config_fields,
)
from meshtrain.models.config_file import SUPPORTED_ARCHITECTURES, check_supported
from meshtrain.models.llama.pretrained import resolve_init_from
from meshtrain.models.llama.weights import (
    PretrainedWeights,
    RandomInit,
    WeightSource,
    materialize,
)

__all__ = [
    "DEFAULT_ARCHITECTURE",
    "SUPPORTED_ARCHITECTURES",
    "build_meta_model",
    "build_model",
    "build_model_config",
    "check_model_fields",
    "check_supported",
    "known_config_fields",
    "resolve_init_from",
]


def build_meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model's structure without storage (every rank builds it; nothing is allocated)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    model.config.architectures = [type(model).__name__]
    return model


def weight_source(
    config: PretrainedConfig, *, seed: int, init_from: str | None, stack: ExitStack
) -> WeightSource:
    """The weights in `init_from` (read slice by slice), else the seeded random init."""
    if init_from:
        return PretrainedWeights(resolve_init_from(init_from), config, stack)
    return RandomInit(config, seed)


def build_model(
    config: PretrainedConfig, *, seed: int, init_from: str | None = None
) -> PreTrainedModel:
    """The whole model on the CPU: random weights from `seed` (the same every layout
    draws), or the weights in `init_from`."""
    model = build_meta_model(config)
    with ExitStack() as stack:
        source = weight_source(config, seed=seed, init_from=init_from, stack=stack)
        materialize([model], unsharded(model), source, torch.device("cpu"), tp_rank=0, tp=1)
    return model


def config_from_dict(values: dict[str, Any]) -> PretrainedConfig:
    """Rebuild a config from `PretrainedConfig.to_dict()` output (as stored in plan.json)."""
    config = AutoConfig.for_model(**values)
    config._attn_implementation = "sdpa"
    return config


def parameter_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Every trainable parameter's shape, found on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}
