"""Hugging Face attention over a context-parallel sequence (`distributed.context_parallel`).

Registered in transformers' attention interface under `ATTENTION`; a model's attention
modules are pointed at it by `use_context_parallel_attention`, which gives them a copy
of the config (the model's own config, which checkpoints save, keeps `sdpa`). The
layers pass the forward's `ContextAttention` as their `attention_mask`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AttentionInterface

from meshtrain.distributed.context_parallel import ContextAttention
from meshtrain.distributed.gathered_attention import gathered_kv_attention

ATTENTION = "meshtrain_context_parallel"


def context_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,  # (batch, heads, local tokens, head dim)
    key: torch.Tensor,  # (batch, kv heads, local tokens, head dim)
    value: torch.Tensor,
    attention_mask: ContextAttention,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Each of this rank's query chunks attends the whole sequence's keys up to its own
    end; returns (batch, local tokens, heads, head dim), as transformers' sdpa does."""
    if dropout and module.training:
        raise ValueError(
            f"attention dropout {dropout} under context parallelism: set the model's "
            "attention_dropout to 0 (Llama-family models train without it)"
        )
    output = gathered_kv_attention(query, key, value, attention_mask, scaling)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, context_parallel_attention)


def use_context_parallel_attention(model: nn.Module) -> None:
    """Point every attention module of `model` at `context_parallel_attention`."""
    config = copy.copy(model.config)
    config._attn_implementation = ATTENTION
    for module in model.modules():
        if hasattr(module, "config") and hasattr(module, "o_proj"):
            module.config = config
