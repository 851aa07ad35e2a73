"""Choose the layout (dp x tp x pp, ZeRO-1, ...) and write plan.json."""

from kedro.pipeline import Pipeline, node

from meshtrain.pipelines.planning.nodes import plan_layout


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            node(
                plan_layout,
                [
                    "tokenizer",
                    "packed_blocks",
                    "params:parallel",
                    "params:training",
                    "params:launch",
                    "params:model",
                    "params:data",
                    "params:planner",
                ],
                "plan",
                name="plan_layout",
            )
        ]
    )
