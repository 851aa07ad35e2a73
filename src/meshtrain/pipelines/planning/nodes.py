"""Node: resolve and validate the parallel layout before any worker exists."""

from __future__ import annotations

from typing import Any

import datasets

from meshtrain.config import RunConfig
from meshtrain.planner.resolve import plan_for_run
from meshtrain.tracking import mlflow_run as tracking


def plan_layout(
    tokenizer: Any,
    packed_blocks: datasets.DatasetDict,
    parallel: dict[str, Any],
    training: dict[str, Any],
    launch: dict[str, Any],
    model: dict[str, Any],
    data: dict[str, Any],
    planner: dict[str, Any],
) -> dict[str, Any]:
    """Args: tokenizer, blocks and the parameter groups. Returns: `plan.json`'s content.

    Raises `LayoutError` naming each refused parameter and a value that works.
    """
    run = RunConfig.from_params(
        parallel=parallel, training=training, launch=launch, model=model, data=data, planner=planner
    )
    plan = plan_for_run(
        run,
        tokenizer,
        num_train_blocks=len(packed_blocks["train"]),
        num_validation_blocks=len(packed_blocks["validation"]),
    ).to_dict()
    tracking.log_plan(plan, run.to_dict())
    return plan
