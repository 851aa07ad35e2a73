"""Evaluate the consolidated model; metrics to data/08_reporting and MLflow."""

from kedro.pipeline import Pipeline, node

from meshtrain.pipelines.evaluation.nodes import evaluate
from meshtrain.pipelines.run_config import EVALUATES


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            node(
                evaluate,
                [
                    "consolidation_summary",
                    "packed_blocks",
                    "training_summary",
                    "params:evaluation",
                ],
                "metrics",
                name="evaluate",
                tags=[EVALUATES],
            )
        ]
    )
