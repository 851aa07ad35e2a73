"""Run a planned training job: pick the run folder, start the ranks, collect the result.

The single entry point the Kedro training node (and the CLI) calls.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from meshtrain.checkpoint.load import check_resumable
from meshtrain.checkpoint.manifest import find_resume_checkpoint
from meshtrain.config import RunConfig
from meshtrain.launch import run_workers
from meshtrain.planner import Plan
from meshtrain.tracking import TrackingTarget
from meshtrain.worker import WorkerSpec, worker_main


def make_worker_spec(
    run: RunConfig,
    plan: Plan,
    *,
    train_files: list[str],
    validation_files: list[str],
    tokenizer_dir: str | None,
    tracking: TrackingTarget | None = None,
) -> WorkerSpec:
    """Fix the run folder and pack what every rank needs.

    Each run gets its own folder `<training.output_dir>/<run name>/` for its
    checkpoints and per-rank logs; the name is the layout plus a timestamp
    unless `training.run_name` fixes it. It is chosen here, once, so all
    ranks (and all nodes) agree on it.
    """
    cfg = run.training
    resume_from = None
    if cfg.resume_from:
        # Refuse before any worker starts: a missing checkpoint or another sample stream.
        resume_from = find_resume_checkpoint(Path(cfg.output_dir), cfg.resume_from, cfg.run_name)
        check_resumable(
            resume_from,
            seed=cfg.seed,
            global_batch_size=plan.global_batch_size,
            num_train_blocks=plan.num_train_blocks,
            max_steps=cfg.max_steps,
        )
        run_dir = resume_from.parent  # the resumed run goes on in its own folder
    else:
        name = cfg.run_name or f"{plan.layout.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = Path(cfg.output_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return WorkerSpec(
        run=run.to_dict(),
        plan=plan.to_dict(),
        train_files=list(train_files),
        validation_files=list(validation_files),
        run_dir=str(run_dir.resolve()),
        tokenizer_dir=str(Path(tokenizer_dir).resolve()) if tokenizer_dir else None,
        tracking_uri=tracking.tracking_uri if tracking else None,
        mlflow_run_id=tracking.run_id if tracking else None,
        resume_from=str(resume_from.resolve()) if resume_from else None,
    )


def run_training(
    run: RunConfig,
    plan: Plan,
    *,
    train_files: list[str],
    validation_files: list[str],
    tokenizer: Any | None,
    tracking: TrackingTarget | None = None,
) -> dict[str, Any]:
    """Train on `launch.world_size` ranks; returns rank 0's summary.

    The tokenizer is saved into the run folder once, and each checkpoint
    carries a copy, so any checkpoint consolidates into a complete model.
    """
    spec = make_worker_spec(
        run,
        plan,
        train_files=train_files,
        validation_files=validation_files,
        tokenizer_dir=None,
        tracking=tracking,
    )
    run_dir = Path(spec.run_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(run_dir / "tokenizer"))
        spec = dataclasses.replace(spec, tokenizer_dir=str(run_dir / "tokenizer"))
    results = run_workers(
        worker_main,
        (spec,),
        run.launch,
        log_dir=run_dir / "logs",
        run_id=f"{run.launch.rdzv_id}-{run_dir.name}",
    )
    summary = results.get(0) or next(r for r in results.values() if r)
    summary["run_name"] = run_dir.name
    return summary
