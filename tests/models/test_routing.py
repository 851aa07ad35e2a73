"""A mixture of experts' load-balancing loss as meshtrain computes it (`models.routing`)
is transformers' own: the same value and the same router gradients as the model's
`load_balancing_loss_func` on the routers' logits of one forward."""

from __future__ import annotations

import sys

import pytest
import torch

from meshtrain.models import build_model, build_model_config
from meshtrain.models.routing import Routing

SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.1,
}
EXPERTS = {
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


@pytest.mark.parametrize("architecture", sorted(EXPERTS))
def test_the_load_balancing_loss_is_transformers_own(architecture: str) -> None:
    config = build_model_config(architecture, {**SHAPE, **EXPERTS[architecture]}, vocab_size=64)
    model = build_model(config, seed=5)
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    microbatches = 4
    routing = Routing([model], config, microbatches)

    def routers_grad(loss: torch.Tensor) -> list[torch.Tensor]:
        routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
        return torch.autograd.grad(loss, routers, retain_graph=True)

    with routing.collecting():
        out = model(input_ids=ids, output_router_logits=True)
    term = routing.finish_forward()
    func = sys.modules[type(model).__module__].load_balancing_loss_func
    expected = func(out.router_logits, routing.experts, routing.top_k)
    want = config.router_aux_loss_coef / microbatches * expected
    assert torch.allclose(term, want, rtol=1e-6), (term, want)
    for got, ref in zip(routers_grad(term), routers_grad(want), strict=True):
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-9)
    metrics = routing.step_metrics(None)
    assert metrics["router_loss"] == pytest.approx(float(expected) / microbatches, rel=1e-6)
    assert metrics["expert_load_max_over_mean"] >= 1.0
