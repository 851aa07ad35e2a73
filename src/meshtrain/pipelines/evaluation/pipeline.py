"""Evaluate the consolidated model; metrics to data/08_reporting and MLflow."""

from kedro.pipeline import Pipeline, node

from meshtrain.pipelines.evaluation.nodes import evaluate


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            node(
                evaluate,
                [
                    "consolidation_summary",
                    "packed_blocks",
                    "training_summary",
                    "plan",
                    "params:training",
                    "params:evaluation",
                ],
                "metrics",
                name="evaluate",
            )
        ]
    )
