"""Run a planned training job: pick the run folder, start the ranks, collect the result.

The single entry point the Kedro training node (and the CLI) calls.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from meshtrain.config import RunConfig
from meshtrain.launch import run_workers
from meshtrain.planner import Plan
from meshtrain.tracking import TrackingTarget
from meshtrain.worker import WorkerSpec, worker_main


def run_training(
    run: RunConfig,
    plan: Plan,
    *,
    train_files: list[str],
    validation_files: list[str],
    tokenizer_dir: str | None,
    tracking: TrackingTarget | None = None,
) -> dict[str, Any]:
    """Train on `launch.world_size` ranks; returns rank 0's summary.

    Each run gets its own folder `<training.output_dir>/<run name>/` holding
    its checkpoints and per-rank logs. The name is the layout plus a
    timestamp unless `training.run_name` fixes it.
    """
    name = run.training.run_name or f"{plan.layout.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(run.training.output_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = WorkerSpec(
        run=run.to_dict(),
        plan=plan.to_dict(),
        train_files=list(train_files),
        validation_files=list(validation_files),
        run_dir=str(run_dir.resolve()),
        tokenizer_dir=str(Path(tokenizer_dir).resolve()) if tokenizer_dir else None,
        tracking_uri=tracking.tracking_uri if tracking else None,
        mlflow_run_id=tracking.run_id if tracking else None,
    )
    results = run_workers(
        worker_main,
        (spec,),
        run.launch,
        log_dir=run_dir / "logs",
        run_id=f"{run.launch.rdzv_id}-{name}",
    )
    summary = results[0] if 0 in results else next(r for r in results.values() if r)
    summary["run_name"] = name
    return summary
