"""Probes the trainer wraps around one chosen step: its peak memory, its pipeline timeline.

Each probe is a context manager for every step that does nothing except on
its own step; there it measures, then gathers every rank's measurement and
rank 0 logs it. The gathering is collective, so every rank enters the same
probes on the same steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.components.memory_probe import PeakMemory, measure_peak_memory
from meshtrain.components.optimizer import ModelOptimizer
from meshtrain.distributed.pipeline_parallel import idle_fraction
from meshtrain.models.parallel_model import ParallelModel
from meshtrain.planner.schedule_walk import balanced_bubble
from meshtrain.tracking.rank_metrics import MetricsLogger


def persistent_tensors(pm: ParallelModel, optimizer: ModelOptimizer) -> list[torch.Tensor]:
    """What lives through a step: parameters and buffers of this rank's stages (their
    shards under sharded data parallelism) and what the optimizer holds."""
    tensors = list(optimizer.held_tensors())
    for module in pm.modules:
        tensors.extend(module.parameters())
        tensors.extend(module.buffers())
    return tensors


class MemoryProbe:
    """Peak memory of live tensors on `step` (0-based), which the planner predicts."""

    def __init__(
        self,
        step: int | None,
        device: torch.device,
        *,
        predicted_bytes: int,
        tracker: MetricsLogger,
        existing: Callable[[], list[torch.Tensor]],
    ) -> None:
        self.step, self.device = step, device
        self.predicted_bytes, self.tracker, self.existing = predicted_bytes, tracker, existing
        self.result: dict[str, Any] = {}

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        if step != self.step:
            yield
            return
        with measure_peak_memory(self.device, existing=self.existing()) as (measured, _):
            yield
        self.result = report_peak_memory(measured, self.tracker, step + 1, self.predicted_bytes)


class PipelineTimeline:
    """Every pipeline rank's forward/backward spans on `step`, drawn into one picture."""

    def __init__(
        self, pm: ParallelModel, step: int, *, tracker: MetricsLogger, run_dir: Path
    ) -> None:
        self.pm, self.step, self.tracker, self.run_dir = pm, step, tracker, run_dir

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        recorder = self.pm.runner.recorder if self.pm.runner is not None else None
        if recorder is None or step != self.step:
            yield
            return
        recorder.enabled = True
        try:
            yield
        finally:
            recorder.enabled = False
        report_pipeline_timeline(self.pm, self.tracker, self.run_dir, step + 1)


def report_peak_memory(
    measured: PeakMemory, tracker: MetricsLogger, step: int, predicted_bytes: int
) -> dict[str, Any]:
    """Gather every rank's measured peak; rank 0 logs the largest and each pipeline
    rank's, and returns them for the summary (the planner predicts the same). Collective."""
    gathered: list[tuple[int, dict[str, int]]] = [(0, {})] * dist.get_world_size()
    dist.all_gather_object(gathered, (measured.peak_bytes, measured.by_category))
    peaks = [peak for peak, _ in gathered]
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    tracker.log(
        {
            "memory/peak_tensor_mb": peaks[worst] / 2**20,
            "memory/predicted_peak_mb": predicted_bytes / 2**20,
            **{f"memory/peak_tensor_mb_rank{r}": p / 2**20 for r, p in enumerate(peaks)},
        },
        step=step,
    )
    return {
        "predicted_peak_bytes": predicted_bytes,
        "peak_bytes": peaks[worst],
        "peak_rank": worst,
        "peak_bytes_per_rank": peaks,
        # What each rank's peak held: tensors from before the step (`existing`: the model
        # states), the forward's activations, the backward's, ... (`memory_probe`).
        "at_peak_per_rank": [by_category for _, by_category in gathered],
    }


def report_pipeline_timeline(
    pm: ParallelModel, tracker: MetricsLogger, run_dir: Path, step: int
) -> None:
    """Gather one step's forward/backward spans from every pipeline rank; rank 0 draws
    them, logs the picture to MLflow and the measured bubble as a metric. Collective."""
    dims = pm.dims
    mine = pm.runner.recorder.spans if dims.dp_cp_rank == 0 and dims.tp_rank == 0 else []
    pm.runner.recorder.spans = []
    gathered: list[tuple[int, list]] = [(0, [])] * dist.get_world_size()
    dist.all_gather_object(gathered, (dims.pp_rank, mine))
    if dist.get_rank() != 0:
        return
    spans_by_rank = {rank: spans for rank, spans in gathered if spans}
    layout = pm.layout
    microbatches = layout.pipeline_parallel_num_microbatches
    idle = idle_fraction(spans_by_rank)
    measured = sum(idle.values()) / len(idle)
    virtual = layout.pipeline_parallel_virtual_stages
    theory = balanced_bubble(layout.pipeline_schedule, dims.pp, microbatches, virtual)
    # Only rank 0 draws, once: the other ranks never import matplotlib (~0.8 s each).
    from meshtrain.tracking.plots import pipeline_timeline

    path = pipeline_timeline(
        spans_by_rank,
        run_dir / "pipeline_timeline.png",
        f"{layout.pipeline_schedule}, pp={dims.pp}, {microbatches} microbatches, step {step}: "
        f"measured bubble {measured:.0%}, theory {theory:.0%}",
    )
    tracker.log({"pipeline/bubble_fraction": measured}, step=step)
    tracker.log_artifact(path)
