"""What a Llama-family parameter's Hugging Face name says about its sharding.

Pure functions with no torch import, so the planner (and `python -m meshtrain
plan`) can reason about shapes without loading the modelling code.
"""

from __future__ import annotations

from typing import Any


def kv_replication_factor(num_key_value_heads: int, tensor_parallel_size: int) -> int:
    """How many copies of each KV head tp ranks need so every rank holds whole heads.

    1 when the KV heads divide evenly over the ranks; tp / kv when there are
    fewer KV heads than ranks (optimum-neuron's `kv_size_multiplier`).
    Raises ValueError when neither divides the other.
    """
    if num_key_value_heads % tensor_parallel_size == 0:
        return 1
    if tensor_parallel_size % num_key_value_heads == 0:
        return tensor_parallel_size // num_key_value_heads
    raise ValueError(
        f"num_key_value_heads={num_key_value_heads} and tensor_parallel_size="
        f"{tensor_parallel_size}: one must divide the other"
    )


def is_tensor_parallel_sharded(name: str) -> bool:
    """Whether parameter `name` is split over tp ranks (for the memory estimate)."""
    return name.endswith(
        (
            "q_proj.weight",
            "k_proj.weight",
            "v_proj.weight",
            "q_proj.bias",
            "k_proj.bias",
            "v_proj.bias",
            "o_proj.weight",
            "gate_proj.weight",
            "up_proj.weight",
            "down_proj.weight",
            "embed_tokens.weight",
            "lm_head.weight",
        )
    )


def is_kv_projection(name: str) -> bool:
    return name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"))


def llama_family_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every trainable parameter's Hugging Face name and shape, from the config alone.

    The same set `named_parameters()` of the built model gives (tests check it against a
    meta-device build for each supported architecture), without importing the modelling
    code, which costs seconds the planner's command should not pay.
    """
    kind = config.model_type
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    inter, vocab = config.intermediate_size, config.vocab_size
    attention_bias = getattr(config, "attention_bias", False)
    qkv_bias = kind == "qwen2" or attention_bias
    output_bias = attention_bias and kind != "qwen2"
    mlp_bias = getattr(config, "mlp_bias", False)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        at = f"model.layers.{i}.self_attn"
        mlp = f"model.layers.{i}.mlp"
        shapes[f"{at}.q_proj.weight"] = (heads * head_dim, h)
        if qkv_bias:
            shapes[f"{at}.q_proj.bias"] = (heads * head_dim,)
        for name in ("k_proj", "v_proj"):
            shapes[f"{at}.{name}.weight"] = (kv_heads * head_dim, h)
            if qkv_bias:
                shapes[f"{at}.{name}.bias"] = (kv_heads * head_dim,)
        shapes[f"{at}.o_proj.weight"] = (h, heads * head_dim)
        if output_bias:
            shapes[f"{at}.o_proj.bias"] = (h,)
        if kind == "qwen3":
            shapes[f"{at}.q_norm.weight"] = (head_dim,)
            shapes[f"{at}.k_norm.weight"] = (head_dim,)
        for name, shape in (
            ("gate_proj", (inter, h)),
            ("up_proj", (inter, h)),
            ("down_proj", (h, inter)),
        ):
            shapes[f"{mlp}.{name}.weight"] = shape
            if mlp_bias:
                shapes[f"{mlp}.{name}.bias"] = (shape[0],)
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (h,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not getattr(config, "tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes
