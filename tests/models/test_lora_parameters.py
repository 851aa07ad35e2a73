"""LoRA on a mixture of experts' routers and 3-D experts (PEFT's `target_parameters`):
the converter makes the adapters the planner counts, and the model computes what PEFT's
model computes with the same adapter values, laid out as PEFT's file keeps them."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from meshtrain.checkpoint.consolidate.peft_layout import peft_tensors
from meshtrain.config import LoraSettings
from meshtrain.models import build_model, build_model_config
from meshtrain.models.lora import LoraConverter
from meshtrain.models.shapes import lora_adapter_shapes

_SHAPE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
MODELS = {
    "qwen3_moe": {
        **_SHAPE,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 8,
        "mlp_only_layers": [0],  # a dense layer: PEFT leaves its MLP alone
    },
    "mixtral": {
        **_SHAPE,
        "num_key_value_heads": 2,
        "intermediate_size": 16,
        "num_local_experts": 4,
    },
}
TARGETS = [
    {"target_modules": "all-linear"},
    {"target_modules": ["q_proj", "gate"], "target_parameters": ["experts.down_proj"]},
    {"target_modules": [], "target_parameters": ["experts.gate_up_proj"]},
]


def _with_peft_keys(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """meshtrain's adapters under the names PEFT's model gives them in memory."""
    named = peft_tensors(ours)
    return {
        k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
        for k, v in named.items()
    }


@pytest.mark.parametrize("architecture", sorted(MODELS))
@pytest.mark.parametrize("targets", TARGETS, ids=["all-linear", "router-down", "gate-up"])
def test_adapted_experts_and_routers_compute_as_peft(architecture: str, targets: dict) -> None:
    config = build_model_config(architecture, MODELS[architecture], vocab_size=64)
    base = build_model(config, seed=0)
    ours = copy.deepcopy(base)
    settings = LoraSettings(r=2, lora_alpha=6, allow_random_base=True, **targets)
    LoraConverter(settings, seed=0).convert(ours)
    adapters = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    assert {n: tuple(p.shape) for n, p in adapters.items()} == lora_adapter_shapes(config, settings)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B nonzero, so that every adapter changes the output
        for parameter in adapters.values():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    peft_settings = {k: v for k, v in targets.items() if v is not None}
    theirs = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, lora_alpha=6, **peft_settings))
    trained = {n: p for n, p in theirs.named_parameters() if p.requires_grad}
    values = _with_peft_keys({n: p.detach() for n, p in adapters.items()})
    assert values.keys() == trained.keys()
    with torch.no_grad():
        for name, value in values.items():
            trained[name].copy_(value)
    ids = torch.randint(0, 64, (2, 12), generator=generator)
    with torch.no_grad():
        got, want = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
        plain = base(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (got - plain).abs().max() > 1e-2  # the adapters are on
