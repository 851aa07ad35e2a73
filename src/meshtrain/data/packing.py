"""Tokenize a corpus and pack it into fixed-length blocks for causal-LM training.

Documents are split into train/validation before tokenizing, so no text is in both splits.
Each document is followed by the eos token and documents are concatenated and cut into
blocks of exactly ``block_size`` tokens: no padding, so every position trains.
"""

from __future__ import annotations

from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from meshtrain.config_parsing import ConfigError


def tokenize_and_pack(
    corpus: datasets.Dataset,
    tokenizer: Any,
    *,
    block_size: int,
    validation_fraction: float,
    seed: int,
    num_proc: int | None = None,
    batch_size: int = 1000,
) -> datasets.DatasetDict:
    """Return ``{"train", "validation"}`` datasets whose one column ``input_ids`` holds blocks.

    The result is the same for any ``num_proc``: only tokenizing runs in worker processes.
    """
    _validate(corpus, tokenizer, block_size, validation_fraction)
    documents = split_documents(corpus, validation_fraction, seed)
    workers = num_proc if num_proc and num_proc > 1 else None
    packed = {}
    for name, docs in documents.items():
        tokens = _tokenize(docs, tokenizer, workers, batch_size, name)
        blocks = _pack(tokens, block_size, batch_size, name)
        if len(blocks) == 0:
            n_tokens = sum(len(ids) for ids in tokens["input_ids"])
            raise ConfigError(
                f"`data.block_size={block_size}` is longer than the {name} split, which has "
                f"{len(docs)} document(s) and {n_tokens:,} token(s): use data.block_size<="
                f"{max(n_tokens - 1, 2)}, a larger data.validation_fraction or a larger corpus."
            )
        packed[name] = blocks
    return datasets.DatasetDict(packed)


def split_documents(
    corpus: datasets.Dataset, validation_fraction: float, seed: int
) -> datasets.DatasetDict:
    """Draw about ``validation_fraction`` of the documents for validation, at least one each.

    Each split keeps the corpus order, so the result depends only on the corpus and ``seed``.
    """
    n_docs = len(corpus)
    if n_docs < 2:
        raise ConfigError(
            f"the corpus holds {n_docs} document(s); the train and validation splits need at "
            "least 2 documents: use a larger corpus (data.builtin_max_chars, data.text_files)."
        )
    n_val = min(max(round(n_docs * validation_fraction), 1), n_docs - 1)
    order = np.random.default_rng(seed).permutation(n_docs)
    val_idx = np.sort(order[:n_val])
    train_idx = np.sort(order[n_val:])
    return datasets.DatasetDict(
        {"train": corpus.select(train_idx), "validation": corpus.select(val_idx)}
    )


def count_tokens(ds: datasets.Dataset) -> int:
    """Tokens in a packed split (blocks x block size)."""
    feature = ds.features["input_ids"]
    length = getattr(feature, "length", -1)
    if length is not None and length > 0:
        return len(ds) * length
    return sum(len(ids) for ids in ds["input_ids"])


def _validate(
    corpus: datasets.Dataset, tokenizer: Any, block_size: int, validation_fraction: float
) -> None:
    """Fail early, naming the config key, before any tokenizing work starts."""
    if not isinstance(block_size, int) or block_size < 2:
        raise ConfigError(
            f"data.block_size must be an integer >= 2 (an input and a next-token target); "
            f"got {block_size!r}"
        )
    if not 0.0 < validation_fraction < 1.0:
        raise ConfigError(
            "data.validation_fraction must be strictly between 0 and 1; "
            f"got {validation_fraction!r}"
        )
    if "text" not in corpus.column_names:
        raise ValueError(f"corpus needs a 'text' column; it has {corpus.column_names}")
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ConfigError(
            "the tokenizer (data.tokenizer, or model.init_from's) has no eos token, which "
            "separates packed documents: use a tokenizer that has one."
        )


def _tokenize(
    docs: datasets.Dataset, tokenizer: Any, num_proc: int | None, batch_size: int, name: str
) -> datasets.Dataset:
    """Token ids of each document followed by eos; the expensive step, so it may fan out."""
    eos = tokenizer.eos_token_id

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        # verbose=False: documents longer than a pretrained tokenizer's model_max_length are
        # fine here, they are cut into blocks afterwards.
        encoded = tokenizer(
            batch["text"], add_special_tokens=False, return_attention_mask=False, verbose=False
        )
        return {"input_ids": [ids + [eos] for ids in encoded["input_ids"]]}

    return docs.map(
        encode,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=docs.column_names,
        features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),
        desc=f"Tokenize {name}",
    )


def _pack(
    tokens: datasets.Dataset, block_size: int, batch_size: int, name: str
) -> datasets.Dataset:
    """Concatenate each batch of documents and cut it into blocks, dropping the batch's tail.

    Runs in-process: it is a cheap copy, and fixed batch boundaries (which worker sharding
    would move) keep the blocks identical for any ``num_proc``.
    """

    def cut(batch: pa.Table) -> pa.Table:
        flat = pc.list_flatten(batch.column("input_ids"))
        n_blocks = len(flat) // block_size
        flat = flat.slice(0, n_blocks * block_size).combine_chunks().cast(pa.int32())
        blocks = pa.FixedSizeListArray.from_arrays(flat, block_size)
        return pa.table({"input_ids": blocks})

    return (
        tokens.with_format("arrow")
        .map(
            cut,
            batched=True,
            batch_size=batch_size,
            features=datasets.Features(
                {"input_ids": datasets.List(datasets.Value("int32"), length=block_size)}
            ),
            desc=f"Pack {name} into blocks of {block_size}",
        )
        .with_format(None)
    )
