"""The data pipeline's entry points choose their path from `data.*` alone: a text corpus
streamed into blocks, or examples packed whole with positions and loss masks."""

from __future__ import annotations

import pytest

from meshtrain.config import DataConfig
from meshtrain.config_parsing import ConfigError
from meshtrain.data.prepare import (
    load_corpus_or_examples,
    make_tokenizer,
    pack_into_blocks,
)


@pytest.mark.parametrize(
    ("values", "text"),
    [
        ({}, True),
        ({"source": "text_files", "text_files": ["a.txt"]}, True),
        ({"source": "hub", "hub_dataset": "a/b", "format": "text"}, True),
        ({"source": "hub", "hub_dataset": "a/b"}, False),
        ({"source": "builtin_instructions"}, False),
        ({"source": "files", "data_files": ["a.jsonl"]}, False),
    ],
)
def test_the_config_alone_says_whether_a_text_corpus_is_read(values: dict, text: bool) -> None:
    assert DataConfig(**values).reads_text_corpus is text


def test_a_corpus_streams_and_examples_pack_whole() -> None:
    corpus_config = DataConfig(builtin_max_chars=60_000, vocab_size=400, block_size=64)
    corpus = load_corpus_or_examples(corpus_config)
    assert corpus.column_names == ["text"]
    tokenizer = make_tokenizer(corpus, corpus_config, None)
    assert len(tokenizer) <= corpus_config.vocab_size
    streamed = pack_into_blocks(corpus, tokenizer, corpus_config)
    assert streamed["train"].column_names == ["input_ids"]

    chats_config = DataConfig(
        source="builtin_instructions", builtin_max_chars=60_000, block_size=1024, num_proc=1
    )
    chats = load_corpus_or_examples(chats_config)
    assert chats.column_names == ["messages"]
    packed = pack_into_blocks(chats, tokenizer, chats_config)
    assert {"input_ids", "position_ids", "loss_mask"} <= set(packed["train"].column_names)
    with pytest.raises(ConfigError, match="data.packing=stream"):
        pack_into_blocks(chats, tokenizer, DataConfig(packing="stream"))
