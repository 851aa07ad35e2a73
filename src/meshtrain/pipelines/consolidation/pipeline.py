"""Merge the final sharded checkpoint into data/06_models/consolidated."""

from kedro.pipeline import Pipeline, node

from meshtrain.pipelines.consolidation.nodes import consolidate


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            node(
                consolidate,
                ["training_summary", "params:consolidation"],
                "consolidation_summary",
                name="consolidate",
            )
        ]
    )
