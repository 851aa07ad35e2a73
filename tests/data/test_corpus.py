"""Corpus loading: the offline builtin corpus, local text files, the hub path and errors."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import datasets
import pytest

from meshtrain.data.builtin import DEFAULT_BUILTIN_MAX_CHARS, MIN_DOC_CHARS, stdlib_sources
from meshtrain.data.corpus import load_corpus

COMMON_WORDS = ("the", "of", "and", "to", "is", "a", "in", "if", "for", "be")


@pytest.fixture(autouse=True)
def hf_cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep every datasets cache file of these tests under tmp_path, out of repo and home."""
    cache = tmp_path / "hf_datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", cache / "downloads")
    monkeypatch.setattr(datasets.config, "EXTRACTED_DATASETS_PATH", cache / "extracted")
    return cache


@pytest.fixture(scope="module")
def builtin() -> datasets.Dataset:
    return load_corpus("builtin")


def _texts(ds: datasets.Dataset) -> list[str]:
    return list(ds["text"])


def test_builtin_is_nonempty_single_text_column(builtin: datasets.Dataset) -> None:
    assert builtin.column_names == ["text"]
    assert len(builtin) > 1000
    texts = _texts(builtin)
    assert all(len(t) >= MIN_DOC_CHARS and t == t.strip() for t in texts)
    assert len(set(texts)) == len(texts)


def test_builtin_is_deterministic(builtin: datasets.Dataset) -> None:
    assert _texts(load_corpus("builtin")) == _texts(builtin)


def test_builtin_is_mostly_english_prose(builtin: datasets.Dataset) -> None:
    text = "\n".join(_texts(builtin))
    words = re.findall(r"[a-z]+", text.lower())
    counts = Counter(words)
    assert all(counts[w] > 1000 for w in COMMON_WORDS)
    assert sum(counts[w] for w in COMMON_WORDS) / len(words) > 0.12
    assert sum(c.isascii() for c in text) / len(text) > 0.99


def test_builtin_respects_default_and_explicit_caps(builtin: datasets.Dataset) -> None:
    assert sum(map(len, _texts(builtin))) <= DEFAULT_BUILTIN_MAX_CHARS
    small = _texts(load_corpus("builtin", builtin_max_chars=50_000))
    assert 0 < sum(map(len, small)) <= 50_000
    # A cap keeps whole documents in the same fixed order: a prefix of the larger corpus.
    assert small == _texts(builtin)[: len(small)]


def test_builtin_cap_below_first_document_errors() -> None:
    with pytest.raises(ValueError, match="data.builtin_max_chars"):
        load_corpus("builtin", builtin_max_chars=10)


def test_builtin_includes_stdlib_docstrings_but_not_tests(builtin: datasets.Dataset) -> None:
    texts = _texts(builtin)
    assert any(t.startswith("Ordered dictionary") or "OrderedDict" in t for t in texts)
    sources = stdlib_sources()
    assert sources == sorted(sources)
    skipped = {"test", "idlelib", "lib2to3", "site-packages", "turtledemo"}
    assert all(not skipped.intersection(p.parts) for p in sources)


def test_text_files_glob_gives_paragraph_rows(tmp_path: Path) -> None:
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "b.txt").write_text("Second file, only paragraph.\n", encoding="utf-8")
    (folder / "a.txt").write_text(
        "First paragraph,\nover two lines.\n\n\n\nSecond paragraph.\n\n   \n\nThird one",
        encoding="utf-8",
    )
    (folder / "skip.md").write_text("not matched\n", encoding="utf-8")
    ds = load_corpus("text_files", text_files=[str(folder / "*.txt")])
    assert ds.column_names == ["text"]
    assert _texts(ds) == [
        "First paragraph,\nover two lines.",
        "Second paragraph.",
        "Third one",
        "Second file, only paragraph.",
    ]
    both = load_corpus("text_files", text_files=[str(folder / "b.txt"), str(folder / "a.txt")])
    assert _texts(both)[0] == "Second file, only paragraph."
    assert len(both) == 4


def test_text_files_pattern_matching_nothing_errors(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text\n", encoding="utf-8")
    missing = str(tmp_path / "nothing-*.txt")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        load_corpus("text_files", text_files=[str(tmp_path / "a.txt"), missing])


@pytest.mark.parametrize("value", [None, []])
def test_text_files_required(value: list[str] | None) -> None:
    with pytest.raises(ValueError, match="data.text_files"):
        load_corpus("text_files", text_files=value)


def test_hub_requires_dataset_name() -> None:
    with pytest.raises(ValueError, match="data.hub_dataset"):
        load_corpus("hub")


def test_hub_keeps_text_column_renamed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_load_dataset(name: str, config: str | None, *, split: str) -> datasets.Dataset:
        calls.append((name, config, split))
        return datasets.Dataset.from_dict(
            {"content": ["A real document.", "  \n", "", "Another one."], "id": [1, 2, 3, 4]}
        )

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_corpus(
        "hub", hub_dataset="org/corpus", hub_config="v1", hub_split="test", text_column="content"
    )
    assert calls == [("org/corpus", "v1", "test")]
    assert ds.column_names == ["text"]
    assert _texts(ds) == ["A real document.", "Another one."]
    with pytest.raises(ValueError, match="data.text_column"):
        load_corpus("hub", hub_dataset="org/corpus", text_column="body")


def test_bad_source_names_key_value_and_choices() -> None:
    with pytest.raises(ValueError, match="data.source") as err:
        load_corpus("wikipedia")
    message = str(err.value)
    assert "'wikipedia'" in message
    assert all(choice in message for choice in ("builtin", "text_files", "hub"))
