"""Choose the layout (dp x tp x pp, ZeRO-1, ...) and write plan.json."""

from kedro.pipeline import Pipeline, node

from meshtrain.pipelines.planning.nodes import plan_layout
from meshtrain.pipelines.run_config import with_run_parameters


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            node(
                plan_layout,
                with_run_parameters(tokenizer="tokenizer", packed_blocks="packed_blocks"),
                "plan",
                name="plan_layout",
            )
        ]
    )
