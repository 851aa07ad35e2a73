"""`model.config`: the fields of a model built from scratch, checked before anything runs.

A field the architecture's config class does not know, a shape that cannot be a model
(heads that do not divide the width, key/value heads that do not divide the heads), or a
value transformers' own validation refuses is named by its dotted parameter with a value
that works, before the data pipeline starts (`preflight`) and again where the model
config is built (`build_model_config`, here: the planner and the checks build configs
without the modelling code `models.builder` imports).
"""

from __future__ import annotations

import difflib
import inspect
import re
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from meshtrain.config import AUTO, ConfigError
from meshtrain.models.config_file import check_supported
from meshtrain.models.llama.pretrained import resolve_init_from

# Fields a config class takes without naming them in its `__init__`: the RoPE keys older
# configs carry flat (transformers 5 folds them into `rope_parameters`), and `head_dim`,
# which Qwen2's attention reads with getattr although Qwen2Config does not declare it.
_ROPE_LEGACY_FIELDS = ("rope_theta", "rope_scaling", "partial_rotary_factor")
_READ_BY_GETATTR = {"qwen2": ("head_dim",), "qwen3_moe": ("head_dim",)}
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
    check_supported(architecture)
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
    if activation is not None:
        _check_activation(activation)
    _check_shape(architecture, fields)


def _check_activation(activation: Any) -> None:
    """`model.config.hidden_act` names an activation transformers has (its table is read
    only here: importing it costs about a second of the checks)."""
    from transformers.activations import ACT2FN  # noqa: PLC0415

    if activation not in ACT2FN:
        close = difflib.get_close_matches(str(activation), sorted(ACT2FN), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(
            f"`model.config.hidden_act` is {activation!r}, not an activation transformers "
            f"knows{hint}; the Llama family uses silu."
        )


def floats_as_floats(architecture: str, fields: dict[str, Any]) -> dict[str, Any]:
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


def _multiples_near(value: int, of: int) -> str:
    """The multiples of `of` on either side of `value`, as a fix ("128 or 132")."""
    below = max(of, value // of * of)
    above = below + of
    return f"{below} or {above}" if below != value else str(value)


def _check_shape(architecture: str, fields: dict[str, Any]) -> None:
    """Refuse head counts that cannot split the width or each other, naming both fields
    and values that work (transformers checks only the first, and names neither)."""
    defaults = CONFIG_MAPPING[architecture]()
    given = {name: fields.get(name, getattr(defaults, name, None)) for name in _POSITIVE_FIELDS}
    if not all(isinstance(value, int) or value is None for value in given.values()):
        return  # a wrong kind: transformers' own check names it
    hidden, heads = given["hidden_size"], given["num_attention_heads"]
    kv_heads = given["num_key_value_heads"] or heads
    if fields.get("head_dim") is None and hidden and heads and hidden % heads:
        raise ConfigError(
            f"`model.config.hidden_size={hidden}` is not a multiple of "
            f"`model.config.num_attention_heads={heads}` (each head takes hidden_size / "
            f"num_attention_heads): use hidden_size={_multiples_near(hidden, heads)}, or a "
            "head count that divides it."
        )
    if heads and kv_heads and heads % kv_heads:
        working = [n for n in range(1, heads + 1) if heads % n == 0]
        raise ConfigError(
            f"`model.config.num_key_value_heads={kv_heads}` does not divide "
            f"`model.config.num_attention_heads={heads}` (each key/value head serves a "
            f"whole group of query heads): use num_key_value_heads in "
            f"{', '.join(map(str, working))}."
        )
    theta = fields.get("rope_theta")
    if isinstance(theta, int | float) and not isinstance(theta, bool) and theta <= 0:
        raise ConfigError(
            f"`model.config.rope_theta` is {theta}; the rotary base must be positive, e.g. "
            "10000 (Llama 2) or 500000 (Llama 3)."
        )


def _fields_named_in(message: str, fields: dict[str, Any], architecture: str) -> list[str]:
    """The config fields a transformers message speaks of, by name ("head_dim") or in words
    ("The hidden size (130)"); the fields the user set first."""
    text = message.lower()
    named = [
        name
        for name in (*fields, *sorted(known_config_fields(architecture) - set(fields)))
        if name.lower() in text or name.replace("_", " ").lower() in text
    ]
    if "attention heads" in text and "num_attention_heads" not in named:
        named.append("num_attention_heads")
    return named


def new_config(
    architecture: str, fields: dict[str, Any], values: dict[str, Any]
) -> PretrainedConfig:
    """`AutoConfig.for_model(architecture, **values)`; transformers' refusal is re-raised
    naming the `model.config` fields it speaks of (`fields`: what the user set)."""
    try:
        return AutoConfig.for_model(architecture, **values)
    except (StrictDataclassError, TypeError, ValueError, ZeroDivisionError) as error:
        cause = " ".join(str(error.__cause__ or error).split())
        field = re.match(r"Validation error for field '(\w+)'", str(error))
        names = [field[1]] if field else _fields_named_in(cause, fields, architecture)
        where = ", ".join(f"`model.config.{name}`" for name in names) or "`model.config`"
        raise ConfigError(
            f"{where}: transformers' {CONFIG_MAPPING[architecture].__name__} refuses it: {cause}"
        ) from None


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
