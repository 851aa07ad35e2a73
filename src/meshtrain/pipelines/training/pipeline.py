"""Train the planned layout on all ranks; checkpoints land under training.output_dir."""

from kedro.pipeline import Pipeline, node

from meshtrain.pipelines.run_config import TRAINS, with_run_parameters
from meshtrain.pipelines.training.nodes import train_model


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            node(
                train_model,
                with_run_parameters(
                    plan="plan", packed_blocks="packed_blocks", tokenizer="tokenizer"
                ),
                "training_summary",
                name="train_model",
                tags=[TRAINS],
            )
        ]
    )
