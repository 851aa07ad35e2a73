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
    return ops


SAVED_OPS = _saved_ops()


def _keep(saved: frozenset, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context(
    extra_saved_ops: frozenset = frozenset(),
) -> tuple[AbstractContextManager, AbstractContextManager]:
    """The `context_fn` for `torch.utils.checkpoint.checkpoint` (a fresh pair per call):
    keep the matmuls', attention's and collectives' outputs, and `extra_saved_ops`'
    (a model converter's own matmul kernels)."""
    return create_selective_checkpoint_contexts(partial(_keep, SAVED_OPS | extra_saved_ops))


def apply_activation_checkpointing(
    model: nn.Module, mode: str, extra_saved_ops: frozenset = frozenset()
) -> None:
    """Checkpoint every decoder layer of a Hugging Face model: `none`, `full` or `selective`
    (which also keeps the outputs of `extra_saved_ops`)."""
    if mode == "none":
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(selective_checkpoint_context, frozenset(extra_saved_ops))
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
