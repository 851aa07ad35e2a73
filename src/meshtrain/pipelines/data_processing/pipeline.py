"""Raw text, or fine-tuning examples, to the packed token blocks that training reads."""

from kedro.pipeline import Pipeline, node

from meshtrain.pipelines.data_processing.nodes import build_corpus, build_tokenizer, pack_blocks


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            node(build_corpus, ["params:data", "raw_examples"], "corpus", name="build_corpus"),
            node(
                build_tokenizer,
                ["corpus", "params:data", "params:model"],
                "tokenizer",
                name="build_tokenizer",
            ),
            node(
                pack_blocks,
                ["corpus", "tokenizer", "params:data"],
                "packed_blocks",
                name="pack_blocks",
            ),
        ]
    )
