"""What a mixture-of-experts config says, read without torch: how many experts, how many
each token takes, which decoder layers are sparse, the router's loss coefficient, and
the names the experts are stored under in a Hugging Face folder.

Qwen3-MoE and Mixtral keep the Llama family's attention and norms; a sparse layer's MLP
is a router (`mlp.gate.weight`, experts x hidden) and the experts as two 3-D parameters
(`mlp.experts.gate_up_proj`, experts x 2 intermediate x hidden, gate rows first;
`mlp.experts.down_proj`, experts x hidden x intermediate). On disk transformers keeps
one tensor per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` for
Qwen3-MoE, `block_sparse_moe.experts.{e}.w1/w3/w2.weight` for Mixtral, whose router is
stored as `block_sparse_moe.gate.weight`). The planner, the random init and the
checkpoint readers and writers all take these facts from here.
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


def stored_expert_names(config: Any, name: str) -> list[list[str]] | None:
    """For a 3-D experts parameter `name`, the names of the tensors it is stored as on
    disk, per expert, in the order they stack along its second dimension (gate, then up;
    or down alone); None for any other parameter."""
    prefix, _, rest = name.partition(".mlp.experts.")
    if not rest or rest not in ("gate_up_proj", "down_proj"):
        return None
    if config.model_type == "mixtral":
        base, parts = (
            f"{prefix}.block_sparse_moe.experts",
            {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)},
        )
    else:
        base = f"{prefix}.mlp.experts"
        parts = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
    return [
        [f"{base}.{e}.{part}.weight" for part in parts[rest]] for e in range(num_experts(config))
    ]


def stored_router_name(config: Any, name: str) -> str:
    """The name parameter `name` is stored under on disk (Mixtral's router is
    `block_sparse_moe.gate.weight`; anything else as it is)."""
    if config.model_type == "mixtral" and name.endswith(f".{ROUTER}"):
        return name.replace(f".{ROUTER}", ".block_sparse_moe.gate.weight")
    return name
