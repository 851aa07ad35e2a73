"""A model's `config.json` read as plain JSON, with its architecture's defaults, for the
planner alone: `python -m meshtrain plan` then imports neither transformers nor torch
(transformers' config classes import torch, about 4 s on two cores).

It knows only the sizes the planner reads, with the defaults and the two derived values
(`head_dim`, `num_key_value_heads`) of transformers' own config classes; a test holds
them to those classes for every supported architecture. Anything that builds a model
reads the folder with transformers (`models.builder`).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Protocol

from meshtrain.config_parsing import ConfigError

_LLAMA = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
_MISTRAL = {
    **{k: v for k, v in _LLAMA.items() if k not in ("attention_bias", "mlp_bias")},
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
}
_QWEN = {
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}
# transformers' config classes' defaults for the fields the planner reads (a field a class
# lacks is absent here too: the planner's getattr then takes its own default).
ARCHITECTURE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA,
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
    "mistral": _MISTRAL,
    "qwen3_moe": {
        **_QWEN,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_key_value_heads": 4,
        "attention_bias": False,
        "num_local_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
    "mixtral": {
        **_MISTRAL,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
    },
}
# transformers' `attribute_map`s: a config.json's name for a field the class keeps under
# another (Qwen3-MoE's released configs say `num_experts`).
_ALIASES = {moe: {"num_experts": "num_local_experts"} for moe in ("qwen3_moe", "mixtral")}
# Whose classes derive a missing `head_dim` from the width (the others keep theirs).
_HEAD_DIM_FROM_WIDTH = ("llama", "mistral")

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_DEFAULTS)
"""The Llama family (RMSNorm, rotary attention with GQA, gated MLP: one sharding and
staging recipe serves them all), and its mixture-of-experts kin, whose sparse layers
replace the MLP with a router and experts (`models.moe_config`)."""


class ArchitectureConfig(Protocol):
    """What the planner reads of a model's config: transformers' `PretrainedConfig` (a run)
    or a `ConfigFile` (a plan); the optional sizes (`head_dim`, `num_key_value_heads`,
    `tie_word_embeddings`, the biases) are read with getattr and a default."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int

    def to_dict(self) -> dict[str, Any]: ...


class ConfigFile:
    """A `config.json`'s values over its architecture's defaults, read as attributes like a
    `PretrainedConfig` (a field neither gives raises AttributeError, as there)."""

    def __init__(self, values: dict[str, Any], aliases: dict[str, str] | None = None) -> None:
        self._values = values
        self._aliases = aliases or {}

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][self.__dict__["_aliases"].get(name, name)]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)


def read_config_file(path: Path) -> ConfigFile:
    """`path` (a `config.json`, or a folder holding one) with its architecture's defaults;
    refuses a file that is not a supported architecture's config."""
    file = path / "config.json" if path.is_dir() else path
    try:
        given = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"{file}: not a readable config.json ({error}).") from None
    if not isinstance(given, dict):
        raise ConfigError(f"{file}: a config.json holds one JSON object.")
    architecture = given.get("model_type")
    check_supported(architecture, f"{file}'s model_type")
    aliases = _ALIASES.get(architecture, {})
    given = {aliases.get(name, name): value for name, value in given.items()}
    values = {**ARCHITECTURE_DEFAULTS[architecture], **given}
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if architecture in _HEAD_DIM_FROM_WIDTH and values.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    return ConfigFile(values, aliases)


def check_supported(architecture: Any, what: str = "`model.architecture`") -> None:
    """Refuse an architecture meshtrain cannot build, naming the closest it can."""
    if architecture in SUPPORTED_ARCHITECTURES:
        return
    close = difflib.get_close_matches(str(architecture).lower(), SUPPORTED_ARCHITECTURES, n=1)
    hint = f" Did you mean `model.architecture={close[0]}`?" if close else ""
    raise ConfigError(
        f"{what} is {architecture!r}; meshtrain supports "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} (the Llama family and its mixtures of "
        f"experts).{hint}"
    )
