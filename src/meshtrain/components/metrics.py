"""What the trainer measures about itself: memory of the process, throughput, progress."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Any

import torch


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident memory of this process in MiB."""
    with open("/proc/self/statm") as handle:
        resident_pages = int(handle.read().split()[1])
    current = resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return current, peak


def memory_metrics(device: torch.device, model_states_bytes: int) -> dict[str, float]:
    """The process's resident memory (and the CUDA allocator's peak) as MLflow metrics."""
    rss, peak = rss_mb()
    metrics = {
        "memory/rss_mb": rss,
        "memory/peak_rss_mb": peak,
        "memory/model_states_mb": model_states_bytes / 2**20,
    }
    if device.type == "cuda":
        metrics["memory/cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return metrics


@dataclass
class Throughput:
    """Steady-state tokens/s: tokens over the wall time of the steps counted, not a mean of
    per-step rates (that reads high)."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None


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
