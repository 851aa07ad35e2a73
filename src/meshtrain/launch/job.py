"""Run a planned training job: pick the run folder, start the ranks, collect the result.

The single entry point the Kedro training node (and the CLI) calls. On
several nodes every node calls it with its own `launch.node_rank`; the
nodes agree on the run folder (named from `launch.rdzv_id` or
`training.run_name`, never from a node's clock) and all return rank 0's
summary.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from meshtrain.checkpoint import remote
from meshtrain.checkpoint.load import check_resumable, check_same_model
from meshtrain.checkpoint.manifest import (
    checked_for_resume,
    find_resume_checkpoint,
    list_checkpoints,
)
from meshtrain.components.step_guard import StopRequested
from meshtrain.config import ConfigError, Refused, RunConfig, TrainingConfig, check_launch
from meshtrain.launch.elastic import Interrupted, WorkerRefusedError, run_workers
from meshtrain.launch.network import REACH_TIMEOUT_S, check_reachable, node_address
from meshtrain.launch.worker import worker_main
from meshtrain.models.builder import config_from_dict, resolve_init_from
from meshtrain.models.llama.parameter_names import llama_family_shapes
from meshtrain.planner import Plan
from meshtrain.tracking.rank_metrics import TrackingTarget
from meshtrain.trainer import WorkerSpec

logger = logging.getLogger(__name__)


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
    checkpoints and per-rank logs; the name is `training.run_name`, else the
    layout plus a timestamp on one node, or the layout plus `launch.rdzv_id`
    on several (each node computes it, so it must not depend on the node's
    clock; torchrun users already pass a per-job rdzv_id such as the SLURM
    job id). Every node writes its ranks' shards into this one folder, so
    with several nodes `training.output_dir` must be on a filesystem they
    share.
    """
    cfg = run.training
    remote_dir = None
    if _on_object_storage(cfg):
        run_dir, remote_dir, resume_from = _remote_run_folder(run, plan)
    else:
        run_dir, resume_from = _local_run_folder(run, plan)
    if resume_from is not None:
        # Refuse before any worker starts: a missing checkpoint or another sample stream.
        check_resumable(
            resume_from,
            seed=cfg.seed,
            global_batch_size=plan.global_batch_size,
            num_train_blocks=plan.num_train_blocks,
            max_steps=cfg.max_steps,
        )
        check_same_model(resume_from, llama_family_shapes(config_from_dict(plan.model_config)))
    run_dir.mkdir(parents=True, exist_ok=True)
    if run.model.init_from:
        # A hub id or a URL becomes its downloaded folder once, here: the ranks read local
        # files.
        local = str(Path(resolve_init_from(run.model.init_from)).resolve())
        run = dataclasses.replace(run, model=dataclasses.replace(run.model, init_from=local))
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
        remote_dir=remote_dir,
    )


def _run_name(run: RunConfig, plan: Plan) -> str:
    """`training.run_name`, else the layout and the job id on several nodes (the same on
    every node), else the layout and the time."""
    if run.training.run_name:
        return run.training.run_name
    if run.launch.nnodes > 1:
        return f"{plan.layout.name}-{run.launch.rdzv_id}"
    return f"{plan.layout.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _local_run_folder(run: RunConfig, plan: Plan) -> tuple[Path, Path | None]:
    """The run folder under `training.output_dir`, and the checkpoint it resumes from."""
    cfg = run.training
    if cfg.resume_from:
        resume_from = find_resume_checkpoint(Path(cfg.output_dir), cfg.resume_from, cfg.run_name)
        return resume_from.parent, resume_from  # the resumed run goes on in its own folder
    run_dir = Path(cfg.output_dir) / _run_name(run, plan)
    if run.launch.nnodes > 1:
        _refuse_earlier_run(run_dir, [p.name for p in sorted(run_dir.glob("checkpoint-*"))], run)
    return run_dir, None


def _on_object_storage(cfg: TrainingConfig) -> bool:
    """A run resumed from a URL goes on there; a new one goes to `training.output_dir`."""
    if cfg.resume_from and cfg.resume_from != "latest":
        return remote.is_url(cfg.resume_from)
    return remote.is_url(cfg.output_dir)


def _remote_run_folder(run: RunConfig, plan: Plan) -> tuple[Path, str, Path | None]:
    """A run whose checkpoints go to object storage: its local folder (logs, staging, the
    checkpoint it resumes from, downloaded once per node), its URL, and that checkpoint."""
    cfg = run.training
    if cfg.resume_from:
        url = remote.find_resume(cfg.output_dir, cfg.resume_from, cfg.run_name)
        remote_dir = remote.parent(url)
        run_dir = remote.local_folder(remote_dir, remote.LOCAL_COPIES)
        resume_from = remote.download_folder(url, run_dir / "resume" / remote.name(url))
        return run_dir, remote_dir, checked_for_resume(resume_from)
    remote_dir = remote.join(cfg.output_dir, _run_name(run, plan))
    if run.launch.nnodes > 1:
        complete, partial = remote.checkpoints(remote_dir)
        _refuse_earlier_run(remote_dir, [remote.name(u) for _, u in complete] + partial, run)
    return remote.local_folder(remote_dir, remote.LOCAL_COPIES), remote_dir, None


def _refuse_earlier_run(run_dir: Path | str, earlier: list[str], run: RunConfig) -> None:
    """A multi-node run folder is named without a timestamp, so it may be an earlier job's.

    Checked before the rendezvous, when no rank of this job can have written
    a checkpoint yet, so finding one (`earlier`: the checkpoints there) means
    another job used the same name.
    """
    if earlier:
        named_by = (
            f"training.run_name={run.training.run_name}"
            if run.training.run_name
            else f"launch.rdzv_id={run.launch.rdzv_id}"
        )
        raise ConfigError(
            f"the run folder {run_dir} (from {named_by}) already holds {earlier[-1]} of an "
            "earlier job: pass a new launch.rdzv_id for each job (e.g. $SLURM_JOB_ID) or "
            "training.run_name, or continue that run with training.resume_from=latest."
        )


class TrainingStopped(Refused):
    """A stop signal (preemption, a time limit, Ctrl-C) ended the training on purpose."""

    @classmethod
    def describe(cls, signal_name: str, run_dir: Path | str) -> TrainingStopped:
        """One line: where the run stopped and how to go on (the newest complete
        checkpoint: the one written on the signal, unless the grace ran out first)."""
        if isinstance(run_dir, str):
            complete = remote.checkpoints(run_dir)[0]
        else:
            complete = list_checkpoints(run_dir)
        if not complete:
            return cls(
                f"training stopped by {signal_name} before its first checkpoint: nothing to "
                f"resume in {run_dir}; run it again."
            )
        step, newest = complete[-1]
        return cls(
            f"training stopped by {signal_name}; {newest} (step {step}) is complete. Resume "
            "with the same command and --params training.resume_from=latest (or "
            f"training.resume_from={newest})."
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
    """Train on `launch.world_size` ranks; returns rank 0's summary, on every node.

    The tokenizer is saved into the run folder once (by node 0), and each
    checkpoint carries a copy, so any checkpoint consolidates into a complete
    model.
    """
    check_launch(run.launch)  # a wrong node rank or endpoint costs nothing yet
    node = node_address(run.launch)
    if node is not None:
        logger.info(node.describe(run.launch.node_rank))
        check_reachable(run.launch, node, REACH_TIMEOUT_S)
    spec = make_worker_spec(
        run,
        plan,
        train_files=train_files,
        validation_files=validation_files,
        tokenizer_dir=None,
        tracking=tracking,
    )
    run_dir = Path(spec.run_dir)
    launch = run.launch
    if tokenizer is not None:
        # Rank 0, which copies it into checkpoints, is on node 0; the other nodes must not
        # rewrite files in the shared folder under it.
        if launch.node_rank == 0:
            tokenizer.save_pretrained(str(run_dir / "tokenizer"))
        spec = dataclasses.replace(spec, tokenizer_dir=str(run_dir / "tokenizer"))
    if launch.nnodes == 1:
        log_dir, run_id = run_dir / "logs", f"{launch.rdzv_id}-{run_dir.name}"
    else:
        # Every node must name the same rendezvous; torchrun's --rdzv-id is exactly that.
        log_dir, run_id = run_dir / "logs" / f"node{launch.node_rank}", launch.rdzv_id
    try:
        results = run_workers(
            worker_main, (spec,), launch, log_dir=log_dir, run_id=run_id, node=node
        )
    except Interrupted as stop:
        raise TrainingStopped.describe(stop.signal_name, spec.remote_dir or run_dir) from None
    except WorkerRefusedError as refusal:
        if refusal.kind != StopRequested.__name__:
            raise
        # The signal reached the workers (or another node's), not this launcher.
        stopped_by = refusal.text.split()[0]
        raise TrainingStopped.describe(stopped_by, spec.remote_dir or run_dir) from None
    summary = results.get(0)
    if summary is None:
        raise RuntimeError(
            f"training finished on node {launch.node_rank} but rank 0's summary did not reach "
            f"it (it travels through the agents' shared store, which "
            f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 turns off); the checkpoints are in {run_dir}"
        )
    summary["run_name"] = run_dir.name
    return summary
