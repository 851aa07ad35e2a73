"""Nodes: corpus -> tokenizer -> packed blocks."""

from __future__ import annotations

from typing import Any

import datasets

from meshtrain.config import DataConfig, check_data, parse
from meshtrain.data.corpus import load_corpus
from meshtrain.data.packing import tokenize_and_pack
from meshtrain.data.tokenizer import load_tokenizer, train_tokenizer


def _data_config(data: dict[str, Any]) -> DataConfig:
    cfg = parse(DataConfig, data, "data")
    check_data(cfg)
    return cfg


def build_corpus(data: dict[str, Any]) -> datasets.Dataset:
    """Args: `params:data`. Returns: one document per row, column `text`."""
    cfg = _data_config(data)
    return load_corpus(
        cfg.source,
        text_files=cfg.text_files,
        hub_dataset=cfg.hub_dataset,
        hub_config=cfg.hub_config,
        hub_split=cfg.hub_split,
        text_column=cfg.text_column,
        builtin_max_chars=cfg.builtin_max_chars,
    )


def build_tokenizer(corpus: datasets.Dataset, data: dict[str, Any]) -> Any:
    """Args: corpus, `params:data`. Returns: a tokenizer trained here, or `data.tokenizer`."""
    cfg = _data_config(data)
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer)
    return train_tokenizer(corpus, cfg.vocab_size)


def pack_blocks(corpus: datasets.Dataset, tokenizer: Any, data: dict[str, Any]):
    """Args: corpus, tokenizer, `params:data`. Returns: `train`/`validation` token blocks."""
    cfg = _data_config(data)
    return tokenize_and_pack(
        corpus,
        tokenizer,
        block_size=cfg.block_size,
        validation_fraction=cfg.validation_fraction,
        seed=cfg.seed,
        num_proc=cfg.num_proc,
    )
