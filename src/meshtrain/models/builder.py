"""Build a Hugging Face causal LM from `model.*` parameters, identically on every rank.

The model is created on the meta device (no storage); `build_model` fills a whole one
on the CPU (one process, the reference of the tests), the trainer only its own shards
(`meshtrain.models.llama.weights.materialize`). Both draw the same weights.
"""

from __future__ import annotations

import difflib
import inspect
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.activations import ACT2FN

from meshtrain.config import AUTO, ConfigError
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

# Fields a config class takes without naming them in its `__init__`: the RoPE keys older
# configs carry flat (transformers 5 folds them into `rope_parameters`), and `head_dim`,
# which Qwen2's attention reads with getattr although Qwen2Config does not declare it.
_ROPE_LEGACY_FIELDS = ("rope_theta", "rope_scaling", "partial_rotary_factor")
_READ_BY_GETATTR = {"qwen2": ("head_dim",)}
# Shape fields that must be at least 1 (transformers accepts a negative hidden_size).
_POSITIVE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


DEFAULT_ARCHITECTURE = "llama"
"""What `model.architecture: auto` builds from scratch (with `model.init_from`, auto is the
folder's own model type)."""


def known_config_fields(architecture: str) -> set[str]:
    """The `model.config` names `architecture`'s config class understands.

    Not `to_dict()` alone: it lacks fields folded into others (`rope_theta` lives in
    `rope_parameters`) and those read by getattr; so the `__init__` parameters, the
    `to_dict()` keys and the `attribute_map` aliases, with the two kinds above.
    """
    cls = CONFIG_MAPPING[architecture]
    names = set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}
    names |= set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
    if "rope_parameters" in names:
        names |= set(_ROPE_LEGACY_FIELDS)
    names |= set(_READ_BY_GETATTR.get(architecture, ()))
    return {name for name in names if not name.startswith("_")}


def check_model_fields(architecture: str, fields: dict[str, Any]) -> None:
    """Refuse `model.config` names `architecture`'s config class does not know (a typo
    would otherwise be ignored: the model would keep the default), and shape fields
    below 1, naming the dotted parameter and the closest real field."""
    architecture = DEFAULT_ARCHITECTURE if architecture == AUTO else architecture
    check_architecture(architecture)
    known = known_config_fields(architecture)
    for name in fields:
        if name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean `model.config.{close[0]}`?" if close else "."
        cls = CONFIG_MAPPING[architecture].__name__
        raise ConfigError(
            f"`model.config.{name}` is not a field of {cls} "
            f"(model.architecture={architecture}){hint} The model would silently keep its "
            "default for it."
        )
    for name in _POSITIVE_FIELDS:
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"`model.config.{name}` must be at least 1, got {value}.")
    eps = fields.get("rms_norm_eps")
    if isinstance(eps, int | float) and not isinstance(eps, bool) and eps <= 0:
        raise ConfigError(
            f"`model.config.rms_norm_eps` is {eps}; use a small positive number, e.g. 1e-5 "
            "(it keeps the RMSNorm's division away from zero)."
        )
    activation = fields.get("hidden_act")
    if activation is not None and activation not in ACT2FN:
        close = difflib.get_close_matches(str(activation), sorted(ACT2FN), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(
            f"`model.config.hidden_act` is {activation!r}, not an activation transformers "
            f"knows{hint}; the Llama family uses silu."
        )


def _floats_as_floats(architecture: str, fields: dict[str, Any]) -> dict[str, Any]:
    """`model.config.rms_norm_eps=1` means 1.0: transformers' strict float fields refuse
    an int, which YAML and `--params` give for a whole number."""
    declared = getattr(CONFIG_MAPPING[architecture], "__dataclass_fields__", {})
    return {
        name: float(value)
        if name in declared
        and declared[name].type is float
        and isinstance(value, int)
        and not isinstance(value, bool)
        else value
        for name, value in fields.items()
    }


def check_architecture(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        close = difflib.get_close_matches(str(architecture).lower(), SUPPORTED_ARCHITECTURES, n=1)
        hint = f" Did you mean `model.architecture={close[0]}`?" if close else ""
        raise ConfigError(
            f"`model.architecture` is {architecture!r}; meshtrain supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (the Llama family).{hint}"
        )


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
        check_architecture(config.model_type)
        if architecture not in (AUTO, config.model_type):
            raise ConfigError(
                f"`model.init_from` {init_from!r} holds a {config.model_type!r} model but "
                f"`model.architecture` is {architecture!r}; leave model.architecture=auto "
                "(the folder's) or set it to the folder's."
            )
    else:
        architecture = DEFAULT_ARCHITECTURE if architecture == AUTO else architecture
        check_architecture(architecture)
        # Only a model built from scratch reads `fields` (with init_from they are noted and
        # left unchecked, as before).
        check_model_fields(architecture, fields)
        values = {**(special_token_ids or {}), **_floats_as_floats(architecture, fields)}
        if vocab_size is not None:
            if fields.get("vocab_size") not in (None, vocab_size):
                raise ConfigError(
                    f"`model.config.vocab_size` is {fields['vocab_size']} but the tokenizer has "
                    f"{vocab_size} tokens, and the embedding always follows the tokenizer: drop "
                    "model.config.vocab_size (data.vocab_size sizes a tokenizer trained here)."
                )
            values["vocab_size"] = vocab_size
        try:
            config = AutoConfig.for_model(architecture, **values)
        except (StrictDataclassError, TypeError, ValueError, ZeroDivisionError) as error:
            # transformers' own validation (a wrong kind, heads not dividing hidden_size):
            # its message names the field.
            cause = error.__cause__ or error
            field = re.match(r"Validation error for field '(\w+)'", str(error))
            where = f"`model.config.{field[1]}`" if field else "`model.config`"
            raise ConfigError(
                f"{where} is refused by transformers' {CONFIG_MAPPING[architecture].__name__}: "
                f"{' '.join(str(cause).split())}"
            ) from None
    # sdpa is exact in fp32 on CPU and the fast path on accelerators.
    config._attn_implementation = "sdpa"
    return config


def resolve_init_from(init_from: str) -> str:
    """A local folder as it is; a hub id downloaded once (weights, config, tokenizer) into
    the Hugging Face cache, whose folder is then used the same way."""
    if Path(init_from).is_dir():
        return init_from
    if init_from.startswith(("/", "./", "../", "~")) or Path(init_from).exists():
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
