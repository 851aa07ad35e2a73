"""Build a Hugging Face causal LM from `model.*` parameters, identically on every rank."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

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

    `vocab_size` (the tokenizer's length) fills the config's vocabulary when the
    model is built from scratch, so the embedding always matches the tokenizer;
    `special_token_ids` (bos/eos/pad) let `generate` stop where the tokenizer does.
    """
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"`model.architecture` is {architecture!r}; meshtrain supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (the Llama family)."
        )
    if init_from:
        config = AutoConfig.from_pretrained(init_from, **fields)
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


def build_model(
    config: PretrainedConfig, *, seed: int, init_from: str | None = None
) -> PreTrainedModel:
    """Random weights from `seed` (the same on every rank), or the weights in `init_from`."""
    if init_from:
        model = AutoModelForCausalLM.from_pretrained(init_from, config=config, dtype=torch.float32)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    model.config.architectures = [type(model).__name__]
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
