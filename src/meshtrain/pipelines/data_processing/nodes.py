"""Nodes: corpus or fine-tuning examples -> tokenizer -> packed blocks (`data/prepare.py`),
imported when each node runs (Kedro imports every pipeline before the run's checks)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from meshtrain.config import DataConfig, ModelConfig, check_data, parse
from meshtrain.pipelines.catalog_io import Rows, Splits


def build_corpus(data: dict[str, Any], raw_examples: Any = None) -> Rows:
    """Args: `params:data`, the catalog's `raw_examples` (read for data.source=catalog).

    Returns: one document or example per row, in TRL's columns (text, prompt/completion,
    messages); rows with nothing to learn are counted and left out.
    """
    return _prepare().load_corpus_or_examples(_data_config(data), raw_examples)


def build_tokenizer(corpus: Rows, data: dict[str, Any], model: dict[str, Any] | None = None) -> Any:
    """Args: corpus, `params:data`, `params:model`. Returns: `data.tokenizer`, else the
    `model.init_from` folder's own, else one trained here; `data.chat_template` replaces
    its chat template."""
    init_from = parse(ModelConfig, model, "model").init_from
    return _prepare().make_tokenizer(corpus, _data_config(data), init_from)


def pack_blocks(corpus: Rows, tokenizer: Any, data: dict[str, Any]) -> Splits:
    """Args: corpus, tokenizer, `params:data`. Returns: `train`/`validation` blocks: a
    text stream cut into blocks, or whole examples packed with positions and loss masks."""
    return _prepare().pack_into_blocks(corpus, tokenizer, _data_config(data))


def _prepare() -> ModuleType:
    """`data.prepare` (datasets, tokenizers, transformers), imported when a node runs."""
    from meshtrain.data import prepare  # noqa: PLC0415

    return prepare


def _data_config(data: dict[str, Any]) -> DataConfig:
    """`params:data` parsed and checked (each node reads it once)."""
    config = parse(DataConfig, data, "data")
    check_data(config)
    return config
