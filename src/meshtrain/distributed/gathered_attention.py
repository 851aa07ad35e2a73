"""Attention of this rank's query chunks over the cp group's gathered keys and values.

Autograd through sdpa would keep each layer's gathered K/V until its backward: the whole
sequence's keys and values on every rank, which at cp 8 adds about a quarter to a Llama's
activations. Instead the forward keeps only what the rank owns (its queries, keys and
values, the output and the log-sum-exp of each chunk) and the backward gathers K/V again:
one more all-gather per layer, no recomputed attention. On CPU the fused kernel's own
backward takes the saved log-sum-exp. Elsewhere (CUDA's kernels take the mask in
alignments this code has not been measured on) the backward recomputes the chunk's
attention under autograd, trading one attention forward for the same memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtrain.distributed.context_parallel import (
    ContextAttention,
    gather_sequence,
    reduce_scatter_sequence,
)

# Devices whose fused kernel's own backward is used (the rest recompute the chunk).
FUSED_BACKWARD_DEVICES = {"cpu"}
_CPU_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _gathered(local: torch.Tensor, view: ContextAttention) -> torch.Tensor:
    """(batch, heads, local tokens, dim) -> the whole sequence's (batch, heads, sequence,
    dim), as a view of a (batch, sequence, heads, dim) buffer (so a prefix is a view)."""
    return gather_sequence(local.transpose(1, 2), view.context).transpose(1, 2)


def _chunk_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output, log-sum-exp) of one query chunk; no log-sum-exp off CPU."""
    if q.device.type in FUSED_BACKWARD_DEVICES:
        return _CPU_FORWARD(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out, None


def _chunk_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    mask: torch.Tensor,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of one chunk's query, keys and values."""
    if lse is not None:
        return _CPU_BACKWARD(grad, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        again, _ = _chunk_forward(*inputs, mask, scale)
        return torch.autograd.grad(again, inputs, grad)


class GatheredKVAttention(torch.autograd.Function):
    """(batch, heads, local tokens, dim) queries, keys and values of this rank -> its
    queries' attention output over every key each may see (`ContextAttention`)."""

    @staticmethod
    def forward(ctx, query, key, value, view: ContextAttention, scale: float | None):  # noqa: ANN001, ANN205
        keys, values = _gathered(key, view), _gathered(value, view)
        outputs, lses = [], []
        for part, (rows, visible) in enumerate(view.query_chunks()):
            mask = view.mask(part, query.dtype, query.device)
            out, lse = _chunk_forward(
                query[:, :, rows], keys[:, :, :visible], values[:, :, :visible], mask, scale
            )
            outputs.append(out)
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
        # Sequence-major like the gathered buffers, so each chunk's prefix adds in place.
        grad_keys = torch.zeros_like(keys.transpose(1, 2))
        grad_values = torch.zeros_like(values.transpose(1, 2))
        grad_query = torch.empty_like(query)
        for part, (rows, visible) in enumerate(view.query_chunks()):
            dq, dk, dv = _chunk_backward(
                grad_output[:, :, rows],
                query[:, :, rows],
                keys[:, :, :visible],
                values[:, :, :visible],
                output[:, :, rows],
                lses[part],
                view.mask(part, query.dtype, query.device),
                ctx.scale,
            )
            grad_query[:, :, rows] = dq
            grad_keys[:, :visible] += dk.transpose(1, 2)
            grad_values[:, :visible] += dv.transpose(1, 2)
        grad_key = reduce_scatter_sequence(grad_keys, view.context).transpose(1, 2)
        grad_value = reduce_scatter_sequence(grad_values, view.context).transpose(1, 2)
        return grad_query, grad_key, grad_value, None, None


def gathered_kv_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    view: ContextAttention,
    scale: float | None = None,
) -> torch.Tensor:
    """`GatheredKVAttention` in the autocast dtype where autocast is on (as sdpa would
    run: rotary embeddings leave queries and keys in fp32 beside bf16 values)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    return GatheredKVAttention.apply(query, key, value, view, scale)
