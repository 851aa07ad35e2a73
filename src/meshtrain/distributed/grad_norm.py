"""The global gradient norm of a sharded model, and clipping to it.

Every optimizer of meshtrain holds some pieces of the model's gradient: a
ZeRO-1 range of the flat buffer, or FSDP2's shards. The norm is the same sum
either way: each rank adds the squares of its pieces, weighting down elements
that several ranks hold (replicated norms under tensor parallelism, copied KV
heads, a tied embedding's two pipeline copies), then the sums are added over
the groups that split the model between them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def global_grad_norm(
    pieces: Iterable[tuple[torch.Tensor, float]],
    groups: Iterable[dist.ProcessGroup],
    *,
    device: torch.device,
) -> torch.Tensor:
    """L2 norm of the whole model's gradient from this rank's `(piece, weight)` pairs
    (weight: 1 / how many ranks hold the piece), summed over `groups`. Collective."""
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for piece, weight in pieces:
        # vector_norm reduces without materialising the squares (no piece-sized temporary).
        squares += torch.linalg.vector_norm(piece, dtype=torch.float32) ** 2 * weight
    for group in groups:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    return squares.sqrt()


def clip_gradients_(grads: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale `grads` in place so that a gradient of global norm `norm` has at most
    `max_norm` (0: no clipping), as `torch.nn.utils.clip_grad_norm_` does."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef)
