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
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator


@contextlib.contextmanager
def experts_on_fallback() -> Iterator[None]:
    """transformers' experts take its fallback grouped matmul inside the block."""
    moe = importlib.import_module("transformers.integrations.moe")
    original = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda *args: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original
