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

from meshtrain.config import AUTO, ConfigError
from meshtrain.config_parsing import names_a_path
from meshtrain.distributed.tensor_parallel import unsharded
from meshtrain.models.config_fields import (
    DEFAULT_ARCHITECTURE,
    check_model_fields,
    floats_as_floats,
    known_config_fields,
    new_config,
)
from meshtrain.models.config_file import SUPPORTED_ARCHITECTURES, check_supported
from meshtrain.models.llama.pretrained import PretrainedError, check_folder
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
    if init_from:
        config = AutoConfig.from_pretrained(resolve_init_from(init_from))
        check_supported(config.model_type)
        if architecture not in (AUTO, config.model_type):
            raise ConfigError(
                f"`model.init_from` {init_from!r} holds a {config.model_type!r} model but "
                f"`model.architecture` is {architecture!r}; leave model.architecture=auto "
                "(the folder's) or set it to the folder's."
            )
    else:
        architecture = DEFAULT_ARCHITECTURE if architecture == AUTO else architecture
        check_supported(architecture)
        # Only a model built from scratch reads `fields` (with init_from they are noted and
        # left unchecked, as before).
        check_model_fields(architecture, fields)
        values = {**(special_token_ids or {}), **floats_as_floats(architecture, fields)}
        if vocab_size is not None:
            if fields.get("vocab_size") not in (None, vocab_size):
                raise ConfigError(
                    f"`model.config.vocab_size` is {fields['vocab_size']} but the tokenizer has "
                    f"{vocab_size} tokens, and the embedding always follows the tokenizer: drop "
                    "model.config.vocab_size (data.vocab_size sizes a tokenizer trained here)."
                )
            values["vocab_size"] = vocab_size
        config = new_config(architecture, fields, values)
    # sdpa is exact in fp32 on CPU and the fast path on accelerators.
    config._attn_implementation = "sdpa"
    return config


def resolve_init_from(init_from: str) -> str:
    """A local folder as it is; a hub id downloaded once (weights, config, tokenizer) into
    the Hugging Face cache, whose folder is then used the same way."""
    if Path(init_from).is_dir():
        check_folder(init_from)
        return init_from
    if names_a_path(init_from):
        raise PretrainedError(
            f"`model.init_from` {init_from!r} is not a folder: pass a local folder written by "
            "save_pretrained (config.json and *.safetensors), or a hub id such as "
            "Qwen/Qwen2.5-0.5B."
        )
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
