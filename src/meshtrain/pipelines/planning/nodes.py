"""Node: resolve and validate the parallel layout before any worker exists.

Node modules import the engine inside the node: Kedro imports every pipeline before
the run's checks, and those should refuse a typo without waiting for torch."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtrain.pipelines.catalog_io import Splits
from meshtrain.pipelines.run_config import run_config


def plan_layout(
    tokenizer: Any, packed_blocks: Splits, **parameters: dict[str, Any]
) -> dict[str, Any]:
    """Args: tokenizer, blocks and the run's parameter groups (`params:parallel`, ...).

    Returns: `plan.json`'s content, with the hash of what it was made from.
    Raises `LayoutError` naming each refused parameter and a value that works.
    """
    # (imported when the node runs: a run refused by its checks, which come first, never
    # loads torch, transformers or mlflow)
    from meshtrain.config_dpo import check_objective_data  # noqa: PLC0415
    from meshtrain.data.preference import blocks_format  # noqa: PLC0415
    from meshtrain.dryrun.command import dry_run_plan  # noqa: PLC0415
    from meshtrain.planner.resolve import plan_for_run  # noqa: PLC0415
    from meshtrain.tracking import mlflow_run as tracking  # noqa: PLC0415

    run = run_config(parameters)
    check_objective_data(run.training.objective, blocks_format(packed_blocks["train"]))
    plan = plan_for_run(
        run,
        tokenizer,
        num_train_blocks=len(packed_blocks["train"]),
        num_validation_blocks=len(packed_blocks["validation"]),
    )
    if run.planner.dry_run:
        plan = dataclasses.replace(plan, dry_run=dry_run_plan(run, plan))
    tracking.log_plan(plan.to_dict(), run.to_dict())
    return plan.to_dict()
