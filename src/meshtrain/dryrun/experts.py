"""Mixtures of experts on fake tensors: transformers' grouped-matmul experts through the
fallback operator transformers itself registers.

torch's fake-tensor rule for `grouped_mm` takes bf16 only (the CUDA kernel's), so on the
CPU code path that stands in, in fp32, a dry run cannot trace it. transformers registers
its fallback grouped matmul (`transformers::grouped_mm_fallback`) as a custom operator
with a fake implementation, whose autograd saves the same tensors as torch's (the input
and the weight) and whose backward makes the same gradients (the input's and the whole
weight's). The dry run routes the experts through it, so what it measures is the grouped
matmul's memory; real runs keep torch's kernel (`tests/distributed/test_moe.py` holds
the dry run to a real run's peak).

Under expert parallelism each sparse layer's experts module is replaced, on the meta
device, by this rank's share (`distributed.expert_parallel.ExpertShard`). Made inside the
fake mode its parameters would be fake tensors that the fake mode keeps weak references
to, which `to_empty` refuses to move; they are made outside it, as the model is. And
where the tokens go depends on the router's values, which fake tensors do not have: the
dry run routes them evenly (each rank's pairs spread over the experts in equal shares),
the planner's case of no imbalance.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from unittest import mock

import torch

from meshtrain.distributed.expert_parallel import ExpertParallel, ExpertShard
from meshtrain.dryrun.fake_world import outside_fake


@contextlib.contextmanager
def experts_on_fallback() -> Iterator[None]:
    """transformers' experts take its fallback grouped matmul inside the block; expert
    shards make their meta parameters outside the fake mode."""
    moe = importlib.import_module("transformers.integrations.moe")
    original = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda *args: False
    try:
        with (
            mock.patch.object(ExpertShard, "__init__", outside_fake(ExpertShard.__init__)),
            mock.patch.object(ExpertParallel, "exchange_counts", _even_counts),
        ):
            yield
    finally:
        moe._can_use_grouped_mm = original


def _even_counts(ep: ExpertParallel, expert_ids: torch.Tensor) -> tuple[list[int], list[list[int]]]:
    """`ExpertParallel.exchange_counts` when every rank spreads its pairs evenly over the
    experts (the remainder one each to the first)."""
    pairs = expert_ids.shape[0]
    share, extra = divmod(pairs, ep.num_experts)
    per_expert = [share + (e < extra) for e in range(ep.num_experts)]
    send = [sum(per_expert[r * ep.local : (r + 1) * ep.local]) for r in range(ep.size)]
    mine = per_expert[ep.first_expert : ep.first_expert + ep.local]
    return send, [list(mine) for _ in range(ep.size)]
