"""Byte-level BPE training: round trips, save/load through AutoTokenizer, determinism."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import transformers

from meshtrain.config import DataConfig
from meshtrain.data.corpus import load_corpus
from meshtrain.data.pretrained_tokenizer import TokenizerMismatch
from meshtrain.data.tokenizer import (
    EOS_TOKEN,
    TokenizerSource,
    load_tokenizer,
    tokenizer_size,
    tokenizer_source,
    train_tokenizer,
)

VOCAB = 512
SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "def f(x):\n    return x ** 2  # comment",
    "Ünïcödé, emoji 🙂 and 日本語 survive byte-level BPE.",
    "",
]


@pytest.fixture(scope="module")
def corpus() -> datasets.Dataset:
    return load_corpus("builtin", builtin_max_chars=200_000)


@pytest.fixture(scope="module")
def tok(corpus: datasets.Dataset) -> transformers.PreTrainedTokenizerBase:
    return train_tokenizer(corpus, VOCAB)


def test_vocab_size_and_eos(tok: transformers.PreTrainedTokenizerBase) -> None:
    assert len(tok) == VOCAB
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    assert tok.eos_token == tok.bos_token == tok.pad_token == EOS_TOKEN
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == eos
    assert 0 <= eos < len(tok)


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_round_trips(tok: transformers.PreTrainedTokenizerBase, text: str) -> None:
    ids = tok(text)["input_ids"]
    assert tok.eos_token_id not in ids  # no special tokens added: packing adds eos itself
    assert tok.decode(ids) == text


def test_learns_merges(tok: transformers.PreTrainedTokenizerBase) -> None:
    text = "the function returns the value of the argument"
    assert len(tok(text)["input_ids"]) < len(text.encode()) / 2


def test_save_and_autotokenizer_round_trip(
    tok: transformers.PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    tok.save_pretrained(tmp_path)
    for loaded in (transformers.AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(tmp_path)):
        assert len(loaded) == len(tok)
        assert loaded.eos_token_id == tok.eos_token_id
        assert loaded.pad_token_id == tok.pad_token_id
        for text in SAMPLES:
            ids = loaded(text)["input_ids"]
            assert ids == tok(text)["input_ids"]
            assert loaded.decode(ids) == text


def test_training_is_deterministic(
    corpus: datasets.Dataset, tok: transformers.PreTrainedTokenizerBase
) -> None:
    again = train_tokenizer(corpus, VOCAB)
    assert again.get_vocab() == tok.get_vocab()
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_small_batches_give_same_tokenizer(
    corpus: datasets.Dataset, tok: transformers.PreTrainedTokenizerBase
) -> None:
    streamed = train_tokenizer(corpus, VOCAB, batch_size=7)
    assert streamed.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


@pytest.mark.parametrize("vocab_size", [0, 100, 256, 257])
def test_too_small_vocab_errors(corpus: datasets.Dataset, vocab_size: int) -> None:
    with pytest.raises(ValueError, match="data.vocab_size"):
        train_tokenizer(corpus, vocab_size)


def test_the_tokenizer_source_is_data_tokenizer_else_the_models_else_trained() -> None:
    named = DataConfig(tokenizer="./tok")
    assert tokenizer_source(named, "Qwen/Qwen2.5-0.5B") == TokenizerSource("./tok", False)
    assert tokenizer_source(DataConfig(), "./model") == TokenizerSource("./model", True)
    assert tokenizer_source(DataConfig(), None) == TokenizerSource(None, False)


def test_tokenizer_size_is_what_the_data_pipeline_will_have(
    tok: transformers.PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "bare").mkdir()
    folder = str(tmp_path / "tok")
    assert tokenizer_size(DataConfig(vocab_size=1000), None) == 1000  # trained: at most
    assert tokenizer_size(DataConfig(tokenizer=folder), None) == len(tok)
    assert tokenizer_size(DataConfig(), folder) == len(tok)  # the model folder's own
    assert tokenizer_size(DataConfig(tokenizer=folder), "Qwen/Qwen2.5-0.5B") == len(tok)
    assert tokenizer_size(DataConfig(), "Qwen/Qwen2.5-0.5B") is None  # known once fetched
    assert tokenizer_size(DataConfig(tokenizer="Qwen/Qwen2.5-0.5B"), None) is None
    with pytest.raises(TokenizerMismatch, match="has no tokenizer"):
        tokenizer_size(DataConfig(), str(tmp_path / "bare"))
