"""Attention of this rank's query chunks over the cp group's gathered keys and values.

A query chunk sees the keys from the sequence's start to its own end: the earlier chunks
whole, its own causally. Both are kernel calls without a mask (a mask would be chunk x
keys elements per chunk: gigabytes at 128k tokens), merged by their log-sum-exps as ring
attention merges its steps; packed examples need their mask and take one masked call.

Two paths, by what the device's fused kernel offers:

- CPU (`FUSED_BACKWARD_DEVICES`): the flash kernel returns its log-sum-exp and has a
  backward that takes the merged output and log-sum-exp. The forward keeps only what the
  rank owns (its queries, keys, values, the output and the log-sum-exps); the backward
  gathers K/V again (one more all-gather a layer, no recomputed attention) and
  reduce-scatters their gradient.
- Elsewhere (CUDA, ...): autograd through the gather and sdpa with torch's lower-right
  causal bias (`causal_lower_right`, which the CUDA kernels run without a mask). The
  gathered K/V are kept for the backward: a layer's under full recomputation, every
  layer's without. torch's fused kernels' private backward entry points are not used
  here: this code has not been run on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from meshtrain.distributed.context_parallel import (
    ContextAttention,
    GatherSequence,
    gather_sequence,
    reduce_scatter_sequence,
)

# Devices whose fused kernel's own backward runs on the merged log-sum-exp.
FUSED_BACKWARD_DEVICES = {"cpu"}
_CPU_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _gathered(local: torch.Tensor, view: ContextAttention, autograd: bool = False):
    """(batch, heads, local tokens, dim) -> the whole sequence's (batch, heads, sequence,
    dim), as a view of a (batch, sequence, heads, dim) buffer (so a prefix is a view)."""
    sequence_major = local.transpose(1, 2)
    if autograd:
        return GatherSequence.apply(sequence_major, view.context).transpose(1, 2)
    return gather_sequence(sequence_major, view.context).transpose(1, 2)


def _merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attentions of the same queries over disjoint keys -> the attention over both
    (outputs weighed by their softmax mass, in fp32)."""
    if out is None:
        return block_out.float(), block_lse
    merged = torch.logaddexp(lse, block_lse)
    out = out * (lse - merged).exp().unsqueeze(-1)
    out += block_out.float() * (block_lse - merged).exp().unsqueeze(-1)
    return out, merged


class FusedGatheredAttention(torch.autograd.Function):
    """(batch, heads, local tokens, dim) queries, keys and values of this rank -> its
    queries' attention output over every key each may see, on the fused CPU kernel."""

    @staticmethod
    def forward(ctx, query, key, value, view: ContextAttention, scale: float | None):  # noqa: ANN001, ANN205
        keys, values = _gathered(key, view), _gathered(value, view)
        outputs, lses = [], []
        for part, (rows, _) in enumerate(view.query_chunks()):
            out = lse = None
            for block in view.key_blocks(part, query.dtype, query.device):
                keep = slice(block.start, block.stop)
                block_out, block_lse = _CPU_FORWARD(
                    query[:, :, rows],
                    keys[:, :, keep],
                    values[:, :, keep],
                    0.0,
                    block.causal,
                    attn_mask=block.mask,
                    scale=scale,
                )
                out, lse = _merge(out, lse, block_out, block_lse)
            outputs.append(out.to(query.dtype))
            lses.append(lse)
        output = torch.cat(outputs, dim=2)
        ctx.view, ctx.scale = view, scale
        ctx.save_for_backward(query, key, value, output, *lses)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # noqa: ANN205 (autograd's signature)
        query, key, value, output, *lses = ctx.saved_tensors
        view: ContextAttention = ctx.view
        keys, values = _gathered(key, view), _gathered(value, view)
        # Sequence-major like the gathered buffers, so each block's gradient adds in place.
        grad_keys = torch.zeros_like(keys.transpose(1, 2))
        grad_values = torch.zeros_like(values.transpose(1, 2))
        grad_query = torch.zeros_like(query)
        for part, (rows, _) in enumerate(view.query_chunks()):
            for block in view.key_blocks(part, query.dtype, query.device):
                keep = slice(block.start, block.stop)
                dq, dk, dv = _CPU_BACKWARD(
                    grad_output[:, :, rows],
                    query[:, :, rows],
                    keys[:, :, keep],
                    values[:, :, keep],
                    output[:, :, rows],
                    lses[part],
                    0.0,
                    block.causal,
                    attn_mask=block.mask,
                    scale=ctx.scale,
                )
                grad_query[:, :, rows] += dq
                grad_keys[:, keep] += dk.transpose(1, 2)
                grad_values[:, keep] += dv.transpose(1, 2)
        grad_key = reduce_scatter_sequence(grad_keys, view.context).transpose(1, 2)
        grad_value = reduce_scatter_sequence(grad_values, view.context).transpose(1, 2)
        return grad_query, grad_key, grad_value, None, None


def _sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    view: ContextAttention,
    scale: float | None,
) -> torch.Tensor:
    """The same attention through autograd: each chunk's visible keys in one sdpa call,
    causal by torch's lower-right bias, or the packed examples' mask."""
    keys, values = _gathered(key, view, autograd=True), _gathered(value, view, autograd=True)
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    for part, (rows, visible) in enumerate(view.query_chunks()):
        q = query[:, :, rows]
        if view.examples is None:
            bias = causal_lower_right(q.shape[2], visible)
        else:
            bias = view.mask(part, q.dtype, q.device)
        outputs.append(
            F.scaled_dot_product_attention(
                q,
                keys[:, :, :visible],
                values[:, :, :visible],
                attn_mask=bias,
                scale=scale,
                enable_gqa=gqa,
            )
        )
    return torch.cat(outputs, dim=2)


def gathered_kv_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    view: ContextAttention,
    scale: float | None = None,
) -> torch.Tensor:
    """This rank's queries' attention over the cp group's keys, in the autocast dtype where
    autocast is on (as sdpa would run: rotary embeddings leave queries and keys in fp32
    beside bf16 values)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    if device in FUSED_BACKWARD_DEVICES:
        return FusedGatheredAttention.apply(query, key, value, view, scale)
    return _sdpa_attention(query, key, value, view, scale)
