"""Activation checkpointing (full and selective) and activation offloading.

`full` recomputes each decoder layer in backward and keeps only its input.
`selective` keeps what is expensive to recompute -- every matmul's output, the
attention core's output, and the tensor-parallel collectives' results (so no
collective runs twice) -- and recomputes the cheap, memory-hungry rest:
RMSNorms, rotary embedding, SiLU and the gating product. (Korthikanti et al.
recompute the attention core because their attention kept the sequence x
sequence scores; SDPA keeps only a log-sum-exp per head, so recomputing it
would cost FLOPs and save nothing. What stores much here is the elementwise
work around the matmuls.)

Offloading moves the tensors autograd saves to pinned host memory during the
forward and back for the backward (`torch.autograd.graph.save_on_cpu`); on a
CPU there is no device memory to relieve, so it is a no-op with a warning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
_functional = torch.ops._c10d_functional


def _saved_ops() -> set[Any]:
    ops = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default}
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(_aten, name):
            ops.add(getattr(_aten, name).default)
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "wait_tensor"):
        if hasattr(_functional, name):
            ops.add(getattr(_functional, name).default)
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):  # Linear on oneDNN (models.cpu_linear)
        ops.add(torch.ops.mkldnn._linear_pointwise.default)
    return ops


SAVED_OPS = _saved_ops()


def _keep_matmuls_and_attention(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if func in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context() -> tuple[AbstractContextManager, AbstractContextManager]:
    """The `context_fn` for `torch.utils.checkpoint.checkpoint` (a fresh pair per call)."""
    return create_selective_checkpoint_contexts(_keep_matmuls_and_attention)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Checkpoint every decoder layer of a Hugging Face model: `none`, `full` or `selective`."""
    if mode == "none":
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = selective_checkpoint_context
    elif mode != "full":
        raise ValueError(f"parallel.activation_checkpointing={mode!r}: use none, full or selective")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def offload_context(enabled: bool, device: torch.device) -> Callable[[], AbstractContextManager]:
    """A factory of contexts that keep saved activations in host memory while enabled."""
    if not enabled:
        return contextlib.nullcontext
    if device.type == "cpu":
        logger.warning(
            "parallel.activation_offloading=true has no effect on CPU: activations already "
            "live in host memory."
        )
        return contextlib.nullcontext
    return partial(torch.autograd.graph.save_on_cpu, pin_memory=True)
