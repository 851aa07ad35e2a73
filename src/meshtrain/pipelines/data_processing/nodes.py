"""Nodes: corpus or fine-tuning examples -> tokenizer -> packed blocks."""

from __future__ import annotations

from typing import Any

import datasets

from meshtrain.config import DataConfig, check_data, parse
from meshtrain.data.chat_tokens import resolve_chat_template
from meshtrain.data.corpus import checked_corpus, load_corpus
from meshtrain.data.example_sources import check_examples, detect_format, load_examples
from meshtrain.data.fine_tuning import pack_fine_tuning, resolve_loss_on, resolve_packing
from meshtrain.data.packing import tokenize_and_pack
from meshtrain.data.pretrained_tokenizer import (
    check_tokenizer_fits,
    load_data_tokenizer,
    tokenizer_to_load,
)
from meshtrain.data.tokenizer import train_tokenizer
from meshtrain.models.builder import resolve_init_from

# Text corpora read by `data/corpus.py`; every other source holds examples in TRL's formats.
CORPUS_SOURCES = ("builtin", "text_files")


def _data_config(data: dict[str, Any]) -> DataConfig:
    cfg = parse(DataConfig, data, "data")
    check_data(cfg)
    return cfg


def build_corpus(data: dict[str, Any], raw_examples: Any = None) -> datasets.Dataset:
    """Args: `params:data`, the catalog's `raw_examples` (read for data.source=catalog).

    Returns: one document or example per row, in TRL's columns (text, prompt/completion,
    messages); rows with nothing to learn are counted and left out.
    """
    cfg = _data_config(data)
    if cfg.source in CORPUS_SOURCES or (cfg.source == "hub" and cfg.format == "text"):
        return load_corpus(
            cfg.source,
            text_files=cfg.text_files,
            hub_dataset=cfg.hub_dataset,
            hub_config=cfg.hub_config,
            hub_split=cfg.hub_split,
            text_column=cfg.text_column,
            builtin_max_chars=cfg.builtin_max_chars,
        )
    columns = dict(cfg.columns or {})
    if cfg.text_column != "text":
        columns.setdefault("text", cfg.text_column)
    examples = load_examples(
        cfg.source,
        data_files=cfg.data_files,
        hub_dataset=cfg.hub_dataset,
        hub_config=cfg.hub_config,
        hub_split=cfg.hub_split,
        columns=columns or None,
        in_memory=raw_examples,
        builtin_max_chars=cfg.builtin_max_chars,
    )
    fmt = detect_format(examples.column_names, cfg.format)
    if fmt == "text":  # a text corpus from examples' sources: documents, blank ones dropped
        return checked_corpus(examples.select_columns(["text"]), f"data.source={cfg.source}")
    examples, skipped = check_examples(examples, fmt)
    if skipped:
        print(f"{skipped} conversation(s) without an assistant turn skipped (nothing to learn)")
    return examples


def build_tokenizer(corpus: datasets.Dataset, data: dict[str, Any], model: dict[str, Any]) -> Any:
    """Args: corpus, `params:data`, `params:model`. Returns: `data.tokenizer`, else the
    `model.init_from` folder's own, else one trained here; `data.chat_template` replaces
    its chat template."""
    cfg = _data_config(data)
    init_from = (model or {}).get("init_from")
    check_tokenizer_fits(cfg.tokenizer, init_from)
    folder = resolve_init_from(init_from) if init_from and not cfg.tokenizer else init_from
    name = tokenizer_to_load(cfg.tokenizer, folder)
    tokenizer = (
        load_data_tokenizer(name) if name else train_tokenizer(_as_text(corpus), cfg.vocab_size)
    )
    resolve_chat_template(tokenizer, cfg.chat_template)
    return tokenizer


def pack_blocks(corpus: datasets.Dataset, tokenizer: Any, data: dict[str, Any]):
    """Args: corpus, tokenizer, `params:data`. Returns: `train`/`validation` blocks: a
    text stream cut into blocks, or whole examples packed with positions and loss masks."""
    cfg = _data_config(data)
    fmt = detect_format(corpus.column_names, cfg.format)
    if resolve_packing(cfg.packing, fmt) == "stream":
        return tokenize_and_pack(
            corpus,
            tokenizer,
            block_size=cfg.block_size,
            validation_fraction=cfg.validation_fraction,
            seed=cfg.seed,
            num_proc=cfg.num_proc,
        )
    blocks, _ = pack_fine_tuning(
        corpus,
        tokenizer,
        fmt=fmt,
        loss_on=resolve_loss_on(cfg.loss_on, fmt),
        block_size=cfg.block_size,
        truncation=cfg.truncation,
        validation_fraction=cfg.validation_fraction,
        seed=cfg.seed,
        num_proc=cfg.num_proc,
    )
    return blocks


def _as_text(corpus: datasets.Dataset) -> datasets.Dataset:
    """A `text` view of examples, to fit a tokenizer from scratch on them."""
    if "text" in corpus.column_names:
        return corpus

    def join(row: dict[str, Any]) -> dict[str, str]:
        parts = []
        for key in ("prompt", "completion", "messages"):
            value = row.get(key)
            if isinstance(value, str):
                parts.append(value)
            elif value:
                parts.extend(message["content"] for message in value)
        return {"text": "\n".join(parts)}

    return corpus.map(join, remove_columns=corpus.column_names, desc="Examples as text")
