"""What a mixture-of-experts config says, read without torch: how many experts, how many
each token takes, which decoder layers are sparse, the router's loss coefficient, and
the names the experts are stored under in a Hugging Face folder.

Qwen3-MoE and Mixtral keep the Llama family's attention and norms; a sparse layer's MLP
is a router (`mlp.gate.weight`, experts x hidden) and the experts as two 3-D parameters
(`mlp.experts.gate_up_proj`, experts x 2 intermediate x hidden, gate rows first;
`mlp.experts.down_proj`, experts x hidden x intermediate). The planner, the model's
shapes and the training loss take these facts from here; the names the experts are
stored under on disk are `checkpoint.expert_layout`'s.
"""

from __future__ import annotations

from typing import Any

MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")
ROUTER = "mlp.gate.weight"
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"


def is_moe(config: Any) -> bool:
    return getattr(config, "model_type", None) in MOE_ARCHITECTURES


def num_experts(config: Any) -> int:
    """Experts per sparse layer (Qwen3-MoE's `num_experts` is transformers' alias of
    `num_local_experts`, Mixtral's own name); 0 for a dense model."""
    if not is_moe(config):
        return 0
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)


def experts_per_token(config: Any) -> int:
    return config.num_experts_per_tok if is_moe(config) else 0


def expert_intermediate(config: Any) -> int:
    """One expert's intermediate size (Mixtral's experts take the model's)."""
    if config.model_type == "qwen3_moe":
        return config.moe_intermediate_size
    return config.intermediate_size


def sparse_layers(config: Any) -> list[int]:
    """The decoder layers whose MLP is a mixture of experts, as the models decide it:
    every layer of Mixtral; Qwen3-MoE's every `decoder_sparse_step`-th layer not listed in
    `mlp_only_layers`."""
    layers = range(config.num_hidden_layers)
    if not is_moe(config) or num_experts(config) == 0:
        return []
    if config.model_type == "mixtral":
        return list(layers)
    step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or [])
    return [i for i in layers if i not in dense and (i + 1) % step == 0]


def inactive_expert_parameters(config: Any) -> int:
    """The expert weights a token does not pass: in each sparse layer, those of the
    experts it is not routed to (the total less this is the model's active parameters)."""
    idle = num_experts(config) - experts_per_token(config)
    if not idle:
        return 0
    per_expert = 3 * config.hidden_size * expert_intermediate(config)
    return len(sparse_layers(config)) * idle * per_expert


def router_loss_coefficient(config: Any) -> float:
    """The load-balancing loss's weight in the training loss: `router_aux_loss_coef` where
    `output_router_logits` is on (the released configs ship it off, which turns the loss
    off, as in transformers), else 0."""
    if not is_moe(config) or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(config.router_aux_loss_coef)


def moe_layer_shapes(config: Any, layer: int) -> dict[str, tuple[int, ...]]:
    """Sparse layer `layer`'s router and experts, by Hugging Face name and shape."""
    e, h, i = num_experts(config), config.hidden_size, expert_intermediate(config)
    prefix = f"model.layers.{layer}"
    return {
        f"{prefix}.{ROUTER}": (e, h),
        f"{prefix}.{GATE_UP}": (e, 2 * i, h),
        f"{prefix}.{DOWN}": (e, h, i),
    }
