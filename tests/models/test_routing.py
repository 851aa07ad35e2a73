"""A mixture of experts' load-balancing loss as meshtrain computes it (`models.routing`)
is transformers' own: the same value and the same router gradients as the model's
`load_balancing_loss_func` on the routers' logits of one forward."""

from __future__ import annotations

import sys

import pytest
import torch

from meshtrain.models import build_model, build_model_config
from meshtrain.models.routing import Routing
from tests.models.test_expert_layout import SHAPE as STORED_SHAPE

SHAPE = {**STORED_SHAPE, "output_router_logits": True, "router_aux_loss_coef": 0.1}
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

    with routing.collecting() as logits:
        out = model(input_ids=ids, output_router_logits=True)
    term = routing.finish_forward(logits)
    func = sys.modules[type(model).__module__].load_balancing_loss_func
    expected = func(out.router_logits, routing.experts, routing.top_k)
    want = config.router_aux_loss_coef / microbatches * expected
    assert torch.allclose(term, want, rtol=1e-6), (term, want)
    for got, ref in zip(routers_grad(term), routers_grad(want), strict=True):
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-9)
    metrics = routing.step_metrics(None)
    assert metrics["router_loss"] == pytest.approx(float(expected) / microbatches, rel=1e-6)
    assert metrics["expert_load_max_over_mean"] >= 1.0


def test_stage_tallies_add_up_to_the_whole_forwards() -> None:
    """Pipeline stages each tally their own sparse layers; the sum is the whole model's
    tally, and the loss the last stage scores from it is the model's own."""
    config = build_model_config("qwen3_moe", {**SHAPE, **EXPERTS["qwen3_moe"]}, vocab_size=64)
    model = build_model(config, seed=5)
    routing = Routing([model], config, microbatches=1)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with routing.collecting() as logits:
        out = model(input_ids=ids, output_router_logits=True)
    layers = routing.sparse_layers
    assert len(layers) == len(logits) == 2
    first = routing.empty_tally() + routing.tally(logits[:1], layers[:1])
    whole = first + routing.tally(logits[1:], layers[1:])
    assert torch.equal(whole.detach(), routing.tally(logits, layers).detach())
    term, counts, _ = routing.score(whole)
    assert counts.sum() == 2 * 8 * 2 * routing.top_k  # rows x layers x k
    func = sys.modules[type(model).__module__].load_balancing_loss_func
    expected = config.router_aux_loss_coef * func(out.router_logits, routing.experts, 2)
    assert torch.allclose(term, expected, rtol=1e-6)
