"""Packing: exact blocks, nothing lost but batch tails, leak-free splits, determinism."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import datasets
import pytest
import transformers

from meshtrain.data.corpus import load_corpus
from meshtrain.data.packing import count_tokens, split_documents, tokenize_and_pack
from meshtrain.data.tokenizer import EOS_TOKEN, train_tokenizer

BLOCK = 32
FRACTION = 0.1
Tokenizer = transformers.PreTrainedTokenizerBase
WORDS = ["the", "of", "and", "to", "a", "in", "is", "for", "value", "return", "list", "data"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer(load_corpus("builtin", builtin_max_chars=100_000), 400)


@pytest.fixture(scope="module")
def corpus() -> datasets.Dataset:
    """300 unique documents of 3 to 80 words, so blocks span several documents."""
    rng = random.Random(0)
    docs = [
        f"Document {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(3, 80))) + "."
        for i in range(300)
    ]
    return datasets.Dataset.from_dict({"text": docs})


def _pack(corpus: datasets.Dataset, tok: Tokenizer, **overrides: Any) -> datasets.DatasetDict:
    kwargs = {"block_size": BLOCK, "validation_fraction": FRACTION, "seed": 0} | overrides
    return tokenize_and_pack(corpus, tok, **kwargs)


def _blocks(ds: datasets.Dataset) -> list[list[int]]:
    return [list(block) for block in ds["input_ids"]]


def _doc_tokens(texts: list[str], tok: Tokenizer) -> list[list[int]]:
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    return [doc + [tok.eos_token_id] for doc in ids]


@pytest.fixture(scope="module")
def packed(corpus: datasets.Dataset, tok: Tokenizer) -> datasets.DatasetDict:
    return _pack(corpus, tok)


def test_blocks_have_exactly_block_size_tokens(packed: datasets.DatasetDict) -> None:
    assert set(packed) == {"train", "validation"}
    for split in packed.values():
        assert split.column_names == ["input_ids"]
        assert split.features["input_ids"] == datasets.List(datasets.Value("int32"), length=BLOCK)
        assert len(split) > 0
        assert all(len(block) == BLOCK for block in split["input_ids"])
        array = split.with_format("numpy")[:]["input_ids"]
        assert array.shape == (len(split), BLOCK)
        assert split.with_format("torch")[:4]["input_ids"].shape == (4, BLOCK)
        assert count_tokens(split) == len(split) * BLOCK


def test_packing_loses_only_the_tail(corpus: datasets.Dataset, tok: Tokenizer) -> None:
    # One batch holds every document, so the blocks are a prefix of the whole token stream.
    packed = _pack(corpus, tok, batch_size=len(corpus))
    docs = split_documents(corpus, FRACTION, seed=0)
    for name, split in packed.items():
        stream = list(itertools.chain(*_doc_tokens(list(docs[name]["text"]), tok)))
        flat = list(itertools.chain(*_blocks(split)))
        assert flat == stream[: len(flat)]
        assert len(stream) - len(flat) < BLOCK


def test_small_batches_drop_one_tail_per_batch(corpus: datasets.Dataset, tok: Tokenizer) -> None:
    batch_size = 7
    packed = _pack(corpus, tok, batch_size=batch_size)
    train_texts = list(split_documents(corpus, FRACTION, seed=0)["train"]["text"])
    expected: list[int] = []
    for start in range(0, len(train_texts), batch_size):
        stream = list(itertools.chain(*_doc_tokens(train_texts[start : start + batch_size], tok)))
        expected += stream[: len(stream) // BLOCK * BLOCK]
    assert list(itertools.chain(*_blocks(packed["train"]))) == expected


def test_split_is_by_document_and_disjoint(
    corpus: datasets.Dataset, tok: Tokenizer, packed: datasets.DatasetDict
) -> None:
    docs = split_documents(corpus, FRACTION, seed=0)
    train, val = set(docs["train"]["text"]), set(docs["validation"]["text"])
    assert not train & val
    assert train | val == set(corpus["text"])
    assert len(val) == round(len(corpus) * FRACTION)
    # Whole documents recovered from the validation blocks all come from validation docs.
    decoded = tok.decode(list(itertools.chain(*_blocks(packed["validation"]))))
    inner = decoded.split(EOS_TOKEN)[1:-1]
    assert inner
    assert all(doc in val for doc in inner)


@pytest.mark.parametrize("n_docs", [2, 3, 10])
def test_tiny_corpora_keep_a_document_in_each_split(n_docs: int) -> None:
    ds = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(n_docs)]})
    docs = split_documents(ds, 0.01, seed=3)
    assert len(docs["validation"]) == 1
    assert len(docs["train"]) == n_docs - 1
    docs = split_documents(ds, 0.99, seed=3)
    assert len(docs["train"]) == 1


def test_single_document_cannot_be_split(tok: Tokenizer) -> None:
    ds = datasets.Dataset.from_dict({"text": ["only one document " * 50]})
    with pytest.raises(ValueError, match="at least 2 documents"):
        _pack(ds, tok)


def test_deterministic_for_a_seed_and_different_for_another(
    corpus: datasets.Dataset, tok: Tokenizer, packed: datasets.DatasetDict
) -> None:
    again = _pack(corpus, tok)
    for name in packed:
        assert _blocks(again[name]) == _blocks(packed[name])
    other = _pack(corpus, tok, seed=1)
    assert _blocks(other["validation"]) != _blocks(packed["validation"])
    val0 = set(split_documents(corpus, FRACTION, seed=0)["validation"]["text"])
    val1 = set(split_documents(corpus, FRACTION, seed=1)["validation"]["text"])
    assert val0 != val1


@pytest.mark.slow
def test_num_proc_does_not_change_blocks(
    corpus: datasets.Dataset, tok: Tokenizer, packed: datasets.DatasetDict
) -> None:
    parallel = _pack(corpus, tok, num_proc=2, batch_size=50)
    serial = _pack(corpus, tok, num_proc=1, batch_size=50)
    for name in packed:
        assert _blocks(parallel[name]) == _blocks(serial[name])


@pytest.mark.slow
def test_disk_backed_corpus_with_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok: Tokenizer
) -> None:
    """Text files give a cached (memory-mapped) dataset; map then writes cache files."""
    cache = tmp_path / "hf_datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", cache / "downloads")
    monkeypatch.setattr(datasets.config, "EXTRACTED_DATASETS_PATH", cache / "extracted")
    rng = random.Random(1)
    paragraphs = [" ".join(rng.choices(WORDS, k=rng.randint(5, 60))) for _ in range(120)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(paragraphs), encoding="utf-8")
    ds = load_corpus("text_files", text_files=[str(tmp_path / "*.txt")])
    parallel = _pack(ds, tok, num_proc=2)
    serial = _pack(ds, tok)
    for name in serial:
        assert _blocks(parallel[name]) == _blocks(serial[name])
    assert ds.cache_files and all(Path(f["filename"]).is_relative_to(cache) for f in ds.cache_files)


@pytest.mark.parametrize("block_size", [1, 0, -4, 2.5])
def test_bad_block_size_errors(corpus: datasets.Dataset, tok: Tokenizer, block_size: float) -> None:
    with pytest.raises(ValueError, match="data.block_size"):
        _pack(corpus, tok, block_size=block_size)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_bad_validation_fraction_errors(
    corpus: datasets.Dataset, tok: Tokenizer, fraction: float
) -> None:
    with pytest.raises(ValueError, match="data.validation_fraction"):
        _pack(corpus, tok, validation_fraction=fraction)


def test_split_too_small_for_one_block_errors(corpus: datasets.Dataset, tok: Tokenizer) -> None:
    pattern = r"`data.block_size=5000` is longer than the validation split, which has \d+ doc"
    with pytest.raises(ValueError, match=pattern):
        _pack(corpus, tok, block_size=5000)
