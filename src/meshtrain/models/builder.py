"""Build a Hugging Face causal LM from `model.*` parameters, identically on every rank.

The model is created on the meta device (no storage); `build_model` fills a whole one
on the CPU (one process, the reference of the tests), the trainer only its own shards
(`meshtrain.models.llama.weights.materialize`). Both draw the same weights.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from meshtrain.distributed.tensor_parallel import unsharded
from meshtrain.models.llama.pretrained import PretrainedError
from meshtrain.models.llama.weights import (
    PretrainedWeights,
    RandomInit,
    WeightSource,
    materialize,
)

# The Llama family: same block structure (RMSNorm, rotary attention with GQA,
# gated MLP), so one sharding and staging recipe serves them all.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


def build_model_config(
    architecture: str,
    fields: dict[str, Any],
    *,
    vocab_size: int | None,
    init_from: str | None = None,
    special_token_ids: dict[str, int | None] | None = None,
) -> PretrainedConfig:
    """Resolve the Hugging Face config: from `init_from` if given, else from `fields`.

    With `init_from` the folder's config.json is the model's: `fields` (the
    `model.config` of a model built from scratch) do not apply. Otherwise
    `vocab_size` (the tokenizer's length) fills the config's vocabulary, so the
    embedding always matches the tokenizer, and `special_token_ids` (bos/eos/pad)
    let `generate` stop where the tokenizer does.
    """
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"`model.architecture` is {architecture!r}; meshtrain supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (the Llama family)."
        )
    if init_from:
        config = AutoConfig.from_pretrained(resolve_init_from(init_from))
        if config.model_type != architecture:
            raise ValueError(
                f"`model.init_from` {init_from!r} holds a {config.model_type!r} model but "
                f"`model.architecture` is {architecture!r}; set model.architecture="
                f"{config.model_type}."
            )
    else:
        values = {**(special_token_ids or {}), **fields}
        if vocab_size is not None:
            values["vocab_size"] = vocab_size
        config = AutoConfig.for_model(architecture, **values)
    # sdpa is exact in fp32 on CPU and the fast path on accelerators.
    config._attn_implementation = "sdpa"
    return config


def resolve_init_from(init_from: str) -> str:
    """A local folder as it is; a hub id downloaded once (weights, config, tokenizer) into
    the Hugging Face cache, whose folder is then used the same way."""
    if Path(init_from).is_dir():
        return init_from
    from huggingface_hub import snapshot_download  # noqa: PLC0415

    try:
        return snapshot_download(
            init_from, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]
        )
    except Exception as error:  # offline, unknown id, no access: say which and why
        raise PretrainedError(
            f"`model.init_from` {init_from!r} is not a local folder and could not be fetched "
            f"from the Hugging Face hub ({type(error).__name__}: {error}). Pass a local folder "
            "written by save_pretrained, or run where the hub is reachable (HF_HUB_OFFLINE unset)."
        ) from None


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
