"""What the trainer measures about itself: memory of the process, throughput, progress."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from meshtrain.device import is_accelerator, peak_allocated_bytes


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident memory of this process in MiB, as the kernel counts them.

    The peak is VmHWM, the high-water mark of this process's own address space, not
    `getrusage`'s ru_maxrss: that one survives exec, so a worker spawned by a large
    parent (the Kedro session, a benchmark holding a model) would report the parent's.
    """
    fields = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024  # kB
    return fields["VmRSS"], fields["VmHWM"]


def memory_metrics(device: torch.device, model_states_bytes: int) -> dict[str, float]:
    """The process's resident memory (and an accelerator allocator's peak) as MLflow
    metrics."""
    rss, peak = rss_mb()
    metrics = {
        "memory/rss_mb": rss,
        "memory/peak_rss_mb": peak,
        "memory/model_states_mb": model_states_bytes / 2**20,
    }
    if is_accelerator(device):
        metrics["memory/device_peak_allocated_mb"] = peak_allocated_bytes(device) / 2**20
    return metrics


@dataclass
class Throughput:
    """Steady-state tokens/s: tokens over the wall time of the steps counted, not a mean of
    per-step rates (that reads high); and the median step time, which one slow step (a
    descheduled thread, a page-cache flush) does not move."""

    tokens: int = 0
    step_seconds: list[float] = field(default_factory=list)

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.step_seconds.append(seconds)

    @property
    def tokens_per_s(self) -> float | None:
        seconds = sum(self.step_seconds)
        return self.tokens / seconds if seconds else None

    @property
    def median_step_s(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None


def clock(seconds: float) -> str:
    """`m:ss`, or `h:mm:ss` past an hour."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def progress_line(done: int, max_steps: int, spent: float, remaining: float, **values: Any) -> str:
    """Rank 0's progress line: a bar would fill the per-rank log files with carriage returns."""
    return (
        f"step {done}/{max_steps} ({done / max_steps:.0%}, {clock(spent)} elapsed, "
        f"{clock(remaining)} left) | loss {values['loss']:.4f} | lr {values['lr']:.2e} | "
        f"grad norm {values['grad_norm']:.3f} | {values['tokens_per_s']:,.0f} tokens/s"
    )
