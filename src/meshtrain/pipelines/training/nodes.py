"""Node: start the ranks with torch elastic and wait for them.

On several nodes every node runs this pipeline with its own `launch.node_rank`;
only node 0 records to MLflow (its rank 0 logs the metrics), the others train
and return the same summary. The engine is imported when the node runs (Kedro imports
every pipeline before the run's checks, which should not wait for torch).
"""

from __future__ import annotations

from typing import Any

from meshtrain.pipelines.catalog_io import Splits
from meshtrain.pipelines.run_config import run_config
from meshtrain.training_summary import TrainingSummary


def train_model(
    plan: dict[str, Any],
    packed_blocks: Splits,
    tokenizer: Any,
    **parameters: dict[str, Any],
) -> dict[str, Any]:
    """Args: the plan, blocks, tokenizer and the run's parameter groups (`params:parallel`,
    ...). Returns: the training summary.

    Refuses a plan.json made from other parameters or data (its hash differs), before
    any worker starts; the planner does not run again here.
    """
    # (imported when the node runs: a run refused by its checks, which come first, never
    # loads torch, transformers or mlflow)
    from meshtrain.data.blocks import arrow_files  # noqa: PLC0415
    from meshtrain.launch.backends import check_backend_available  # noqa: PLC0415
    from meshtrain.launch.job import run_training  # noqa: PLC0415
    from meshtrain.planner import Plan  # noqa: PLC0415
    from meshtrain.planner.plan_inputs import check_plan_matches, plan_inputs_hash  # noqa: PLC0415
    from meshtrain.tracking import mlflow_run as tracking  # noqa: PLC0415

    run = run_config(parameters)
    resolved = Plan.from_dict(plan)
    current = plan_inputs_hash(
        run,
        tokenizer,
        num_train_blocks=len(packed_blocks["train"]),
        num_validation_blocks=len(packed_blocks["validation"]),
    )
    check_plan_matches(resolved, current)
    check_backend_available(resolved.backend)  # e.g. neuron without the AWS packages
    node0 = run.launch.node_rank == 0
    if node0:
        tracking.log_plan(plan, run.to_dict())
    result = run_training(
        run,
        resolved,
        train_files=arrow_files(packed_blocks["train"]),
        validation_files=arrow_files(packed_blocks["validation"]),
        tokenizer=tokenizer,
        # Rank 0 is on node 0; another node's MLflow run (if its hook opened one) gets nothing.
        tracking=tracking.active_target() if node0 else None,
    )
    summary = TrainingSummary.from_dict(result)
    if node0:
        # The model converters this run applied (models/converters.py), or none.
        tracking.set_tag("meshtrain.converters", ",".join(summary.converters) or "none")
        tracking.log_loss_curve()
        tracking.log_memory_report(plan, result)
    return summary.to_dict()
