"""What every rank must agree on before a step's update: was a stop asked for, and are the
step's loss and gradient norm finite.

Clusters stop jobs with a signal: SIGTERM (preemption, `scancel`, the end of a SLURM
time limit) or SIGUSR1 (what `sbatch --signal=USR1@120` sends ahead of the limit).
`StopSignals` turns either into a request instead of death; the launcher forwards the
signal it gets to every worker, and a signal may also reach only some ranks (one
node's), so the ranks agree on it with one small all-reduce per step, together with
whether any rank saw a non-finite loss or gradient norm. A stop then lets the step
finish and writes a checkpoint; a non-finite value stops the run before the optimizer
applies it, so no checkpoint ever holds it.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.config import Refused

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class NonFiniteError(Refused):
    """A step's loss or gradient norm was NaN or infinite; its update was not applied."""


class StopRequested(Refused):
    """Every rank stopped after a stop signal, with a checkpoint of that step; the message
    starts with the signal's name."""


class StopSignals:
    """While entered, SIGTERM and SIGUSR1 are recorded (`received`) instead of ending the
    process; the previous handlers come back on exit."""

    def __init__(self) -> None:
        self.received: int = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _record(self, number: int, _frame: FrameType | None) -> None:
        self.received = number


def agree_on_step(
    loss_sum: torch.Tensor, grad_norm: torch.Tensor, stop: StopSignals, *, step: int
) -> int:
    """Collective over every rank. Returns the stop signal any rank received (0: none);
    raises NonFiniteError on every rank if any rank's loss or the gradient norm is not
    finite (`step`: 1-based, for the message)."""
    flags = torch.stack(
        [
            torch.tensor(float(stop.received), device=grad_norm.device),
            (~torch.isfinite(loss_sum)).any().float().to(grad_norm.device),
            (~torch.isfinite(grad_norm)).float(),
        ]
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    received, bad_loss, bad_norm = flags.tolist()
    if bad_loss or bad_norm:
        norm = grad_norm.item()
        what = (
            f"the loss is not finite and the gradient norm is {norm}"
            if bad_loss
            else f"the gradient norm is {norm}"
        )
        raise NonFiniteError(
            f"step {step}: {what}; stopped before the optimizer applied it, so no checkpoint "
            "holds it (the latest complete checkpoint is untouched and still `latest`). "
            "Lower training.learning_rate, or clip with training.max_grad_norm, and resume "
            "from that checkpoint (training.resume_from=latest)."
        )
    return int(received)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
