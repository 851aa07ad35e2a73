"""What a Llama-family parameter's Hugging Face name says about its shape and sharding.

Pure functions with no torch import, so the planner (and `python -m meshtrain
plan`) can reason about shapes without loading the modelling code. The
tensor-parallel split of each module is written here once: the TP plan
(`tensor_parallel.py`) builds its DTensor styles from these tables and the planner's
memory model counts shards from them.
"""

from __future__ import annotations

from typing import Any

from meshtrain.models.moe_config import moe_layer_shapes, sparse_layers

# Megatron's split of a decoder layer, by module name relative to the layer. Column
# parallel: weight and bias split along the outputs. Row parallel: weight split along
# the inputs; the bias is added once, after the sum, and stays whole.
COLUMN_PARALLEL = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
# Split along the vocabulary (the weight only).
VOCAB_PARALLEL = ("model.embed_tokens", "lm_head")
KV_PROJECTIONS = ("self_attn.k_proj", "self_attn.v_proj")
# The input embedding and the LM head: one tensor when the config ties them.
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
# A LoRA embedding's adapters (PEFT's names): A is r x vocabulary, B hidden x r.
EMBEDDING_ADAPTERS = ("lora_embedding_A", "lora_embedding_B")
# The architectures with an RMSNorm over each query and key head.
HEAD_NORMS = ("qwen3", "qwen3_moe")


def stored_name(name: str, config: Any) -> str:
    """The name a parameter's weights are stored and drawn under: a tied LM head (the
    last pipeline stage's copy) is the embedding."""
    tied = getattr(config, "tie_word_embeddings", False)
    return EMBEDDING if tied and name == LM_HEAD else name


def _module_is(module: str, names: tuple[str, ...]) -> bool:
    return any(module == name or module.endswith("." + name) for name in names)


def tensor_parallel_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits parameter `name` along, None if it keeps it
    whole: outputs (0) of column-parallel modules and the vocabulary (0) of the embedding
    and LM head, inputs (1) of row-parallel weights."""
    module, _, kind = name.rpartition(".")
    base, _, adapter = module.rpartition(".")
    if adapter in ("lora_A", "lora_B"):
        # A LoRA adapter is split the way its base layer is: B on the outputs under a
        # column-parallel base (the LM head's: its vocabulary), A on the inputs under a
        # row-parallel one; the other whole.
        if _module_is(base, (*COLUMN_PARALLEL, "lm_head")):
            return 0 if adapter == "lora_B" else None
        return 1 if adapter == "lora_A" and _module_is(base, ROW_PARALLEL) else None
    if kind in EMBEDDING_ADAPTERS:
        # The embedding's A (r x vocabulary) is split on the vocabulary like its base.
        return 1 if kind == EMBEDDING_ADAPTERS[0] else None
    if _module_is(module, COLUMN_PARALLEL):
        return 0
    if kind != "weight":
        return None
    if _module_is(module, ROW_PARALLEL):
        return 1
    return 0 if _module_is(module, VOCAB_PARALLEL) else None


def is_tensor_parallel_sharded(name: str) -> bool:
    """Whether parameter `name` is split over tp ranks (else every tp rank holds it whole)."""
    return tensor_parallel_dim(name) is not None


def is_kv_projection(name: str) -> bool:
    """k_proj/v_proj weights and biases (and their LoRA B, whose rows are the outputs): the
    tensors KV-head replication repeats."""
    module = name.rpartition(".")[0].removesuffix(".lora_B")
    return _module_is(module, KV_PROJECTIONS)


def llama_family_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every trainable parameter's Hugging Face name and shape, from the config alone.

    The same set `named_parameters()` of the built model gives (tests check it against a
    meta-device build for each supported architecture), without importing the modelling
    code, which costs seconds the planner's command should not pay. A mixture of
    experts' sparse layers hold a router and experts where the others hold the MLP.
    """
    h, vocab = config.hidden_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    sparse = set(sparse_layers(config))
    for i in range(config.num_hidden_layers):
        shapes.update(_attention_shapes(config, f"model.layers.{i}.self_attn"))
        if i in sparse:
            shapes.update(moe_layer_shapes(config, i))
        else:
            shapes.update(_mlp_shapes(config, f"model.layers.{i}.mlp"))
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (h,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not getattr(config, "tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def _attention_shapes(config: Any, at: str) -> dict[str, tuple[int, ...]]:
    kind, h = config.model_type, config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    attention_bias = getattr(config, "attention_bias", False)
    qkv_bias = kind == "qwen2" or attention_bias
    shapes: dict[str, tuple[int, ...]] = {f"{at}.q_proj.weight": (heads * head_dim, h)}
    if qkv_bias:
        shapes[f"{at}.q_proj.bias"] = (heads * head_dim,)
    for name in ("k_proj", "v_proj"):
        shapes[f"{at}.{name}.weight"] = (kv_heads * head_dim, h)
        if qkv_bias:
            shapes[f"{at}.{name}.bias"] = (kv_heads * head_dim,)
    shapes[f"{at}.o_proj.weight"] = (h, heads * head_dim)
    if attention_bias and kind != "qwen2":
        shapes[f"{at}.o_proj.bias"] = (h,)
    if kind in HEAD_NORMS:
        shapes[f"{at}.q_norm.weight"] = (head_dim,)
        shapes[f"{at}.k_norm.weight"] = (head_dim,)
    return shapes


def _mlp_shapes(config: Any, mlp: str) -> dict[str, tuple[int, ...]]:
    h, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in (
        ("gate_proj", (inter, h)),
        ("up_proj", (inter, h)),
        ("down_proj", (h, inter)),
    ):
        shapes[f"{mlp}.{name}.weight"] = shape
        if getattr(config, "mlp_bias", False):
            shapes[f"{mlp}.{name}.bias"] = (shape[0],)
    return shapes
