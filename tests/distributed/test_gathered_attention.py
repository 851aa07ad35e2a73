"""The attention of a context-parallel rank's query chunks, on a group of one rank: both
of its chunks, against sdpa over the whole sequence (causal, or packed examples), forward
and gradients, through the fused kernel's backward and through the recomputing one.
(Several ranks: tests/distributed/test_context_parallel.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain.distributed import gathered_attention
from meshtrain.distributed.context_parallel import ContextParallel
from meshtrain.distributed.gathered_attention import gathered_kv_attention
from meshtrain.models.packed_attention import packed_causal_mask


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ContextParallel(dist.group.WORLD, 1, 0)
    finally:
        dist.destroy_process_group()


def _inputs(length: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 4, length, 8), (2, 2, length, 8), (2, 2, length, 8)]  # GQA: 4 heads, 2 KV
    return [torch.randn(s, generator=generator, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_chunks_attend_as_sdpa_over_the_whole_sequence(one_rank, monkeypatch, fused, packed):
    if not fused:
        monkeypatch.setattr(gathered_attention, "FUSED_BACKWARD_DEVICES", set())
    length = 16
    positions = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)]).repeat(2, 1)
    _, view = one_rank.attention_inputs(positions if packed else None, length, torch.device("cpu"))
    q, k, v = _inputs(length)
    got = gathered_kv_attention(q, k, v, view, scale=0.3)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    mask = packed_causal_mask(positions) if packed else None
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=not packed, scale=0.3, enable_gqa=True
    )
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, a, b in zip("qkv", got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
