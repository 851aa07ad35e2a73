"""Linear layers' fp32 matmuls on CPU through oneDNN rather than the BLAS torch links.

Why: torch's x86-64 wheels run an fp32 `mm` through MKL, whose AVX-512 kernels are
chosen on Intel CPUs only; on other x86-64 CPUs with AVX-512 (AMD EPYC Zen 4) MKL
stays on AVX2. oneDNN, also inside every x86-64 torch, picks its kernels by
instruction set, and there runs the same products 1.3-2.5x faster. Where the CPU has
no AVX-512 both libraries run AVX2 and MKL is the faster (oneDNN 0.82-1.0x on an
AVX2-only EPYC, 2026-12-03); `bench/machine_limit.py` measures both (docs/speed.md).
So `auto` takes oneDNN only where MKL leaves AVX-512 unused. The Linear layers' products
are most of a transformer's training step, so their forward and both backward
products move to oneDNN; attention's own matmuls (inside the fused kernel) stay where
torch puts them.

The swap changes a module's class, not its parameters: names, state dicts and
checkpoints are those of `nn.Linear`. Any other call (another device or dtype,
autocast, DTensor shards under tensor parallelism, a torch.compile'd layer) runs
`nn.Linear`'s own forward.

It is a model converter (`models.converters`); which runs take it is decided without
torch in `models/cpu_matmul.py`, and the planner knows the path only by the converter's
name, which selects the device profile's rate table for it.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from meshtrain.models.llama.weights import WeightSource

from meshtrain.models.cpu_matmul import NAME


@functools.cache
def onednn_available() -> bool:
    """oneDNN is compiled into this torch, exposes the dense-in, dense-out linear (a
    private op), and that op computes a small product right: checked once per process,
    so that another torch release that changed it falls back to torch.mm."""
    if not (
        torch.backends.mkldnn.is_available()
        and platform.machine().lower() in ("x86_64", "amd64")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    a, b = torch.randn(3, 8), torch.randn(5, 8)
    try:
        return torch.allclose(onednn_mm_nt(a, b), a @ b.T, rtol=1e-5, atol=1e-5)
    except RuntimeError:
        return False


def onednn_mm_nt(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """a @ b.T (+ bias) by oneDNN, for 2-D fp32 CPU tensors (b may be a transposed view)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


class _OneDnnLinearFunction(torch.autograd.Function):
    """y = x W^T + b with the forward and both backward products on oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        rows = x.reshape(-1, x.shape[-1])
        return onednn_mm_nt(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # dL/dx = g W
            grad_x = onednn_mm_nt(grad_rows, weight.t()).view(x.shape)
        if ctx.needs_input_grad[1]:  # dL/dW = g^T x
            grad_weight = onednn_mm_nt(grad_rows.t(), x.reshape(-1, x.shape[-1]).t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(0)
        return grad_x, grad_weight, grad_bias


def _covered(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The oneDNN path's case: plain fp32 CPU tensors (not DTensor shards), no autocast,
    not being compiled (Inductor lowers the op only with its own prepacked weights)."""
    return (
        not torch.compiler.is_compiling()
        and not isinstance(x, DTensor)
        and not isinstance(weight, DTensor)
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
    )


class OneDnnLinear(nn.Linear):
    """`nn.Linear` whose fp32 CPU matmuls run on oneDNN; every other call is nn.Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _covered(x, self.weight):
            return _OneDnnLinearFunction.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def route_linears_to_onednn(modules: list[nn.Module]) -> int:
    """Swap every plain `nn.Linear` under `modules` to `OneDnnLinear`, in place; how many."""
    swapped = 0
    for module in modules:
        for layer in module.modules():
            if type(layer) is nn.Linear:
                layer.__class__ = OneDnnLinear
                swapped += 1
    return swapped


@dataclass(frozen=True)
class OneDnnLinearConverter:
    """The model converter that routes the Linear layers' fp32 CPU matmuls to oneDNN.

    Selective activation checkpointing must keep its op's outputs (`saved_ops`), as it
    keeps every other matmul's, or the recompute would run the products twice."""

    name: str = NAME

    @property
    def saved_ops(self) -> frozenset:
        return frozenset({torch.ops.mkldnn._linear_pointwise.default})

    def convert(self, model: nn.Module) -> None:
        route_linears_to_onednn([model])

    def weights(self, base: WeightSource) -> WeightSource:
        """The base's own: the swap adds no parameters."""
        return base
