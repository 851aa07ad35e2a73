"""One optimizer step over a rank's microbatches: the trainer's and the dry run's one step.

The step's learning rate from the schedule; forward and backward of every microbatch,
accumulating into the gradients (data parallelism's averaging starts from the backward
as buckets fill); the sums the backward leaves (tensor parallelism's partial gradients,
a tied embedding's copies); the reduction and the global gradient norm; the clipped
update; the cleared gradients. What the callers add comes in as arguments, around the
step rather than inside copies of it: the trainer fetches the batches, wraps its probes
around the step and has every rank agree on a stop signal before the update; the dry
run (`meshtrain.dryrun`) hands in fake batches and names the phases it measures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from meshtrain.components.rank_build import RankParts
from meshtrain.data.batch import TokenBatch


@dataclass
class StepResult:
    """What one optimizer step leaves (nothing read back from the device yet)."""

    loss_sum: torch.Tensor  # this rank's summed token losses / the step's trained tokens
    grad_norm: torch.Tensor
    stop_signal: int = 0  # a stop signal some rank received during the step (0: none)


def _no_stop(loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> int:
    return 0


def _unnamed(phase: str) -> None:
    return None


def _nothing() -> None:
    return None


def optimizer_step(
    rank: RankParts,
    step: int,
    batches: Iterable[TokenBatch],
    trained_tokens: int,
    *,
    around: AbstractContextManager | None = None,
    agree: Callable[[torch.Tensor, torch.Tensor], int] = _no_stop,
    phase: Callable[[str], None] = _unnamed,
    after_update: Callable[[], None] = _nothing,
) -> StepResult:
    """Optimizer step `step` (0-based) over `batches`, this rank's microbatches (taken one
    at a time: a loader's are read as the step reaches them). Each microbatch's summed
    loss is divided by `trained_tokens`, the whole global batch's.

    `around`: entered after the learning rate is set and left before the gradients are
    cleared (the trainer's probes); `agree`: every rank's agreement before the update,
    given the loss and the gradient norm, returning a stop signal (a host sync, which fake
    tensors do not have); `phase`: told "forward" and "optimizer" as the step reaches them
    (a memory measurement's categories); `after_update`: called once the parameters are
    updated, their gradients still held."""
    pm, optimizer = rank.pm, rank.optimizer
    optimizer.set_learning_rate(rank.lr_schedule.rate(step))
    with around if around is not None else nullcontext():
        phase("forward")
        loss_sum = torch.zeros((), device=rank.device)
        for batch in batches:
            # (A vector under DPO: the loss and its metrics.)
            loss_sum = loss_sum + pm.train_batch(batch, trained_tokens)
        pm.finish_gradients()
        phase("optimizer")
        with record_function("meshtrain.reduce"):
            grad_norm = optimizer.reduce_gradients()
        stop_signal = agree(loss_sum, grad_norm)
        with record_function("meshtrain.optimizer"):
            optimizer.apply(grad_norm)
        after_update()
    optimizer.zero_grad()
    phase("forward")
    return StepResult(loss_sum, grad_norm, stop_signal)
