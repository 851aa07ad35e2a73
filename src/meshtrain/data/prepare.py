"""The data pipeline's three steps, each choosing its path from `data.*` alone.

Read the text corpus or the fine-tuning examples (`load_corpus_or_examples`), make the
run's tokenizer (`make_tokenizer`), and pack either into the blocks training reads
(`pack_into_blocks`: a text stream cut into blocks, or whole examples best-fit). The Kedro
nodes of `pipelines/data_processing` call these with the parsed parameter groups.
"""

from __future__ import annotations

from typing import Any

import datasets

from meshtrain.config import DataConfig
from meshtrain.data.chat_tokens import resolve_chat_template
from meshtrain.data.corpus import checked_corpus, load_corpus
from meshtrain.data.example_sources import check_examples, detect_format, load_examples
from meshtrain.data.fine_tuning import pack_fine_tuning, resolve_loss_on, resolve_packing
from meshtrain.data.packing import tokenize_and_pack
from meshtrain.data.preference import check_pairs, pack_preferences, with_explicit_prompts
from meshtrain.data.pretrained_tokenizer import check_tokenizer_fits
from meshtrain.data.tokenizer import read_tokenizer, tokenizer_source, train_tokenizer
from meshtrain.models.builder import resolve_init_from


def load_corpus_or_examples(data: DataConfig, raw_examples: Any = None) -> datasets.Dataset:
    """One document or example per row, in TRL's columns (text, prompt/completion,
    messages); rows with nothing to learn are counted and left out. `raw_examples`: the
    Kedro catalog's dataset, read for `data.source=catalog`."""
    if data.reads_text_corpus:
        return load_corpus(
            data.source,
            text_files=data.text_files,
            hub_dataset=data.hub_dataset,
            hub_config=data.hub_config,
            hub_split=data.hub_split,
            text_column=data.text_column,
            builtin_max_chars=data.builtin_max_chars,
        )
    columns = dict(data.columns or {})
    if data.text_column != "text":
        columns.setdefault("text", data.text_column)
    examples = load_examples(
        data.source,
        data_files=data.data_files,
        hub_dataset=data.hub_dataset,
        hub_config=data.hub_config,
        hub_split=data.hub_split,
        columns=columns or None,
        in_memory=raw_examples,
        builtin_max_chars=data.builtin_max_chars,
    )
    fmt = detect_format(examples.column_names, data.format)
    if fmt == "text":  # a text corpus from examples' sources: documents, blank ones dropped
        return checked_corpus(examples.select_columns(["text"]), f"data.source={data.source}")
    if fmt == "preference":
        explicit = "prompt" in examples.column_names
        return check_pairs(with_explicit_prompts(examples), explicit=explicit)[0]
    examples, skipped = check_examples(examples, fmt)
    if skipped:
        print(f"{skipped} conversation(s) without an assistant turn skipped (nothing to learn)")
    return examples


def make_tokenizer(corpus: datasets.Dataset, data: DataConfig, init_from: str | None) -> Any:
    """`data.tokenizer`, else the `model.init_from` model's own (a hub model fetched), else
    one trained on the corpus (`tokenizer_source` decides); `data.chat_template` replaces
    its chat template. A tokenizer that cannot feed the model is refused first."""
    check_tokenizer_fits(data.tokenizer, init_from)
    source = tokenizer_source(data, init_from)
    if source.name is None:
        tokenizer = train_tokenizer(_as_text(corpus), data.vocab_size)
    else:
        name = resolve_init_from(source.name) if source.of_model else source.name
        tokenizer = read_tokenizer(name, of_model=source.of_model)
    resolve_chat_template(tokenizer, data.chat_template)
    return tokenizer


def pack_into_blocks(
    corpus: datasets.Dataset, tokenizer: Any, data: DataConfig
) -> datasets.DatasetDict:
    """`train`/`validation` blocks of `data.block_size`: a text stream cut into blocks, or
    whole examples packed with their positions and loss masks (`data.packing`)."""
    fmt = detect_format(corpus.column_names, data.format)
    if resolve_packing(data.packing, fmt) == "stream":
        return tokenize_and_pack(
            corpus,
            tokenizer,
            block_size=data.block_size,
            validation_fraction=data.validation_fraction,
            seed=data.seed,
            num_proc=data.num_proc,
        )
    if fmt == "preference":
        return pack_preferences(
            corpus,
            tokenizer,
            block_size=data.block_size,
            truncation=data.truncation,
            validation_fraction=data.validation_fraction,
            seed=data.seed,
            num_proc=data.num_proc,
        )[0]
    blocks, _ = pack_fine_tuning(
        corpus,
        tokenizer,
        fmt=fmt,
        loss_on=resolve_loss_on(data.loss_on, fmt),
        block_size=data.block_size,
        truncation=data.truncation,
        validation_fraction=data.validation_fraction,
        seed=data.seed,
        num_proc=data.num_proc,
    )
    return blocks


def _as_text(corpus: datasets.Dataset) -> datasets.Dataset:
    """A `text` view of examples, to fit a tokenizer from scratch on them."""
    if "text" in corpus.column_names:
        return corpus

    def join(row: dict[str, Any]) -> dict[str, str]:
        parts = []
        for key in ("prompt", "completion", "messages", "chosen", "rejected"):
            value = row.get(key)
            if isinstance(value, str):
                parts.append(value)
            elif value:
                parts.extend(message["content"] for message in value)
        return {"text": "\n".join(parts)}

    return corpus.map(join, remove_columns=corpus.column_names, desc="Examples as text")
