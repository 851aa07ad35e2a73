"""Node: start the ranks with torch elastic and wait for them.

On several nodes every node runs this pipeline with its own `launch.node_rank`;
only node 0 records to MLflow (its rank 0 logs the metrics), the others train
and return the same summary.
"""

from __future__ import annotations

from typing import Any

import datasets

from meshtrain.config import RunConfig
from meshtrain.data.blocks import arrow_files
from meshtrain.launch.backends import check_backend_available
from meshtrain.launch.job import run_training
from meshtrain.planner import Plan
from meshtrain.planner.resolve import check_plan_is_current, plan_for_run
from meshtrain.tracking import mlflow_run as tracking


def train_model(
    plan: dict[str, Any],
    packed_blocks: datasets.DatasetDict,
    tokenizer: Any,
    parallel: dict[str, Any],
    training: dict[str, Any],
    launch: dict[str, Any],
    model: dict[str, Any],
    data: dict[str, Any],
    planner: dict[str, Any],
) -> dict[str, Any]:
    """Args: the plan, blocks, tokenizer and parameters. Returns: the training summary."""
    run = RunConfig.from_params(
        parallel=parallel, training=training, launch=launch, model=model, data=data, planner=planner
    )
    resolved = Plan.from_dict(plan)
    replanned = plan_for_run(
        run,
        tokenizer,
        num_train_blocks=len(packed_blocks["train"]),
        num_validation_blocks=len(packed_blocks["validation"]),
    )
    check_plan_is_current(resolved, replanned)
    check_backend_available(resolved.backend)  # e.g. neuron without the AWS packages
    node0 = run.launch.node_rank == 0
    if node0:
        tracking.log_plan(plan, run.to_dict())
    summary = run_training(
        run,
        resolved,
        train_files=arrow_files(packed_blocks["train"]),
        validation_files=arrow_files(packed_blocks["validation"]),
        tokenizer=tokenizer,
        # Rank 0 is on node 0; another node's MLflow run (if its hook opened one) gets nothing.
        tracking=tracking.active_target() if node0 else None,
    )
    if node0:
        if summary.get("cpu_matmul"):  # what training.cpu_matmul resolved to
            tracking.set_tag("meshtrain.cpu_matmul", summary["cpu_matmul"])
        tracking.log_loss_curve()
        tracking.log_memory_report(plan, summary)
    return summary
