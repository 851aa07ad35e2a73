"""`models.shapes` reads from the config what a built model has: module names, and a LoRA
run's adapter shapes equal to what `LoraConverter` makes (and the same refusals)."""

from __future__ import annotations

from typing import Any

import pytest

from meshtrain.config import ConfigError, LoraSettings
from meshtrain.models import build_model_config
from meshtrain.models.builder import build_meta_model
from meshtrain.models.lora import LoraConverter
from meshtrain.models.shapes import lora_adapter_shapes, module_names

SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TARGETS: list[Any] = [
    None,
    "all-linear",
    ["all-linear"],
    ["o_proj", "down_proj"],
    ["gate_proj", "up_proj", "k_proj"],
    r".*\.v_proj",
    r"model\.layers\.1\..*_proj",
    r"nothing",
    ["q_projj"],
    ["lm_head"],
    ["embed_tokens"],
    ["mlp"],
    ["input_layernorm"],
    r"lm_head",
    r".*",
]


# The mixtures of experts with 4 experts (sparse layers hold no dense MLP projections).
ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"]
EXPERTS = {"qwen3_moe": {"num_experts": 4}, "mixtral": {"num_local_experts": 4}}


def _config(architecture: str, tied: bool):
    fields = {**SHAPE, "tie_word_embeddings": tied, **EXPERTS.get(architecture, {})}
    return build_model_config(architecture, fields, vocab_size=128)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("tied", [False, True])
def test_module_names_are_the_built_models(architecture: str, tied: bool) -> None:
    config = _config(architecture, tied)
    built = [name for name, _ in build_meta_model(config).named_modules() if name]
    assert module_names(config) == built


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("targets", TARGETS, ids=repr)
def test_adapter_shapes_are_the_converters(architecture: str, targets: Any) -> None:
    config = _config(architecture, tied=architecture == "qwen2")
    settings = LoraSettings(r=4, target_modules=targets)
    converter = LoraConverter(settings, seed=0)
    try:
        converter.convert(build_meta_model(config))
    except ConfigError as error:
        with pytest.raises(ConfigError) as ours:
            lora_adapter_shapes(config, settings)
        assert str(ours.value) == str(error)
        return
    shapes = lora_adapter_shapes(config, settings)
    assert list(shapes.items()) == list(converter.shapes.items())
