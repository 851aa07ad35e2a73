"""A mixture of experts' weights on disk: the tensors `checkpoint.expert_layout` expects
are those transformers' `save_pretrained` writes, and `model.init_from` reads them."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from meshtrain.checkpoint.expert_layout import stored_shapes
from meshtrain.distributed.tensor_parallel import ParameterSharding
from meshtrain.models import build_model, build_model_config
from meshtrain.models.llama.parameter_names import llama_family_shapes
from meshtrain.models.llama.pretrained import check_pretrained
from meshtrain.models.llama.weights import PretrainedWeights
from meshtrain.models.moe_config import num_experts

SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
EXPERTS = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


@pytest.mark.parametrize("architecture", sorted(EXPERTS))
def test_the_stored_tensors_are_those_transformers_writes_and_read_back(
    architecture: str, tmp_path: Path
) -> None:
    config = build_model_config(architecture, {**SHAPE, **EXPERTS[architecture]}, vocab_size=64)
    model = build_model(config, seed=3)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        written = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    expected = stored_shapes(architecture, num_experts(config), llama_family_shapes(config))
    assert written == expected
    check_pretrained(tmp_path, config)  # the folder is accepted as it is
    with ExitStack() as stack:
        source = PretrainedWeights(tmp_path, config, stack)
        for name, parameter in model.named_parameters():
            whole = ParameterSharding(name, tp_dim=None, copies=1)
            assert torch.equal(source.local(name, whole, 0, 1), parameter.detach()), name
