"""`distributed.expert_parallel` on real gloo groups of 2 and 4 ranks: each rank's tokens
routed to experts held by all the ranks give the same outputs, and the same gradients
(tokens, routing weights, each rank's experts), as every rank holding every expert.
Uneven routing included: one expert takes most pairs, some take none."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from meshtrain.distributed.expert_parallel import ExpertParallel

EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 8, 16, 12, 2, 24


def swiglu_experts(gate_up: torch.Tensor, down: torch.Tensor):
    """Experts gate_up (E x 2I x H), down (E x H x I) over rows grouped by expert."""

    def run(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for e, end in enumerate(offsets.tolist()):
            gate, up = (rows[start:end] @ gate_up[e].T).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ down[e].T)
            start = end
        return torch.cat(outs)

    return run


def _routing(rank: int, skewed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
    logits = torch.randn(TOKENS, EXPERTS, generator=generator)
    if skewed:  # expert 1 first for nearly every token; 6 and 7 for none
        logits[:, 1] += 4.0
        logits[:, 6:] -= 8.0
    weights, index = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
    return hidden, index, weights


def _check(rank: int, world: int, store_path: str) -> None:
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        generator = torch.Generator().manual_seed(0)  # the same experts on every rank
        gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator) / 4
        down = torch.randn(EXPERTS, HIDDEN, INTER, generator=generator) / 4
        ep = ExpertParallel(dist.group.WORLD, EXPERTS)
        mine = slice(ep.first_expert, ep.first_expert + ep.local)
        for skewed in (False, True):
            hidden, index, weights = _routing(rank, skewed)
            # Every rank holding every expert: the tokens' own experts, computed locally.
            ref_in = [t.clone().requires_grad_() for t in (hidden, weights, gate_up, down)]
            ref = _local(ref_in[0], index, ref_in[1], ref_in[2], ref_in[3])
            ref.square().sum().backward()
            for t in ref_in[2:]:  # an expert's gradient: every rank's tokens' share
                dist.all_reduce(t.grad)
            # Expert parallel: this rank's experts only.
            ep_in = [hidden.clone().requires_grad_(), weights.clone().requires_grad_()]
            local = [gate_up[mine].clone().requires_grad_(), down[mine].clone().requires_grad_()]
            out = ep.forward(ep_in[0], index, ep_in[1], swiglu_experts(*local))
            out.square().sum().backward()
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ep_in[0].grad, ref_in[0].grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ep_in[1].grad, ref_in[1].grad, rtol=1e-5, atol=1e-6)
            for got, want in zip(local, ref_in[2:], strict=True):
                torch.testing.assert_close(got.grad, want.grad[mine], rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


def _local(hidden, index, weights, gate_up, down) -> torch.Tensor:
    """Each expert over the tokens routed to it, weighted, summed per token."""
    out = torch.zeros_like(hidden)
    for e in range(EXPERTS):
        token, slot = torch.where(index == e)
        if len(token):
            run = swiglu_experts(gate_up[e : e + 1], down[e : e + 1])
            rows = run(hidden[token], torch.tensor([len(token)]))
            out = out.index_add(0, token, rows * weights[token, slot].unsqueeze(-1))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_every_rank_holding_every_expert(world: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_check, args=(world, os.path.join(folder, "store")), nprocs=world)
