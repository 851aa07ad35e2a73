"""Train the planned layout on all ranks; checkpoints land under training.output_dir."""

from kedro.pipeline import Pipeline, node

from meshtrain.pipelines.training.nodes import train_model


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            node(
                train_model,
                [
                    "plan",
                    "packed_blocks",
                    "tokenizer",
                    "params:parallel",
                    "params:training",
                    "params:launch",
                    "params:model",
                    "params:data",
                    "params:planner",
                ],
                "training_summary",
                name="train_model",
            )
        ]
    )
