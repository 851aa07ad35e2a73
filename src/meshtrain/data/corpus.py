"""Load a text corpus as a ``datasets.Dataset`` with one document per row in column ``text``.

Three sources: the builtin corpus (`data/builtin.py`: real English made offline from the
documentation that ships with Python, so tests and laptops need no download), local text
files, and a dataset from the Hugging Face Hub (for real runs on connected machines).
"""

from __future__ import annotations

import codecs
import glob
import os
from pathlib import Path

import datasets

from meshtrain.config_parsing import ConfigError
from meshtrain.data.builtin import builtin_corpus

SOURCES = ("builtin", "text_files", "hub")


class CorpusError(ConfigError):
    """The corpus cannot be read or holds no text; the message names the file or parameter."""


class CorpusFileNotFound(CorpusError, FileNotFoundError):
    """A `data.text_files` pattern matches no file."""


def load_corpus(
    source: str,
    *,
    text_files: list[str] | None = None,
    hub_dataset: str | None = None,
    hub_config: str | None = None,
    hub_split: str = "train",
    text_column: str = "text",
    builtin_max_chars: int | None = None,
) -> datasets.Dataset:
    """Return the corpus named by ``source``; blank documents are dropped for every source."""
    if source == "builtin":
        return builtin_corpus(builtin_max_chars)
    if source == "text_files":
        if not text_files:
            raise CorpusError(
                "data.text_files must list at least one path or glob pattern "
                "when data.source is 'text_files'"
            )
        patterns = [text_files] if isinstance(text_files, str) else text_files
        corpus = _load_text_files(patterns)
        where = f"data.text_files={patterns}"
    elif source == "hub":
        if not hub_dataset:
            raise CorpusError("data.hub_dataset must name a Hub dataset when data.source is 'hub'")
        corpus = _load_hub(hub_dataset, hub_config, hub_split, text_column)
        where = f"data.hub_dataset={hub_dataset} (column {text_column!r})"
    else:
        raise CorpusError(f"data.source must be one of {', '.join(SOURCES)}; got {source!r}")
    return checked_corpus(corpus, where)


def checked_corpus(corpus: datasets.Dataset, where: str) -> datasets.Dataset:
    """A corpus of at least two non-blank documents (`where` names its source)."""
    corpus = _drop_blank(corpus)
    if len(corpus) == 0:  # refused here, before the empty corpus is saved over an earlier one
        raise CorpusError(f"{where} holds no text: every document is empty or blank")
    if len(corpus) < 2:  # packing draws validation documents from the others
        raise CorpusError(
            f"{where} holds one document; the train and validation splits need at least 2 "
            "(text files are cut into documents at blank lines): add text, or more files"
        )
    return corpus


# --- local text files ----------------------------------------------------------------------


def _load_text_files(patterns: list[str]) -> datasets.Dataset:
    """Read local files with one row per paragraph.

    Paragraphs (blocks separated by a blank line) rather than whole files: a corpus is often a
    few big files, and per-file rows would leave too few documents to split train/validation
    at document level; paragraphs are the natural document-like unit of plain text.
    """
    files = expand_patterns(patterns, "data.text_files")
    if all(os.path.getsize(path) == 0 for path in files):  # `datasets` fails on these
        raise CorpusError(f"data.text_files: every file is empty: {', '.join(files)}")
    not_text = _first_not_text(files)  # before `datasets` meets it (NUL bytes: no rows)
    if not_text is not None:
        raise not_text
    try:
        loaded = datasets.load_dataset(
            "text", data_files=files, sample_by="paragraph", keep_linebreaks=True
        )
    except datasets.exceptions.DatasetGenerationError as error:
        reason = " ".join(str(error.__cause__ or error.__context__ or error).split())[:200]
        raise CorpusError(
            f"data.text_files: {', '.join(files)} cannot be read as text ({reason})"
        ) from None
    ds = loaded["train"].select_columns(["text"])
    return ds.map(_strip_batch, batched=True, desc="Strip paragraphs")


def expand_patterns(patterns: list[str], parameter: str) -> list[str]:
    """Expand each glob in order (matches sorted, a file named twice read once); refuse
    naming `parameter` and the first pattern with no match."""
    files: dict[str, None] = {}  # ordered set
    for pattern in patterns:
        matches = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
        if not matches:
            raise CorpusFileNotFound(f"{parameter}: no file matches {pattern!r}")
        files.update(dict.fromkeys(matches))
    return list(files)


def _first_not_text(files: list[str]) -> CorpusError | None:
    """A refusal naming the first file that is not UTF-8 text, else None."""
    for path in files:
        offset = _first_bad_byte(path)
        if offset is not None:
            return CorpusError(
                f"data.text_files: {path} is not UTF-8 text (byte {offset} is a NUL or cannot "
                "be decoded; is it a binary file?): convert it, or leave it out of the patterns"
            )
    return None


def _first_bad_byte(path: str) -> int | None:
    """The offset of the first byte no UTF-8 text file holds (a NUL, or one that does not
    decode), else None; read in 1 MiB blocks."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            nul = block.find(b"\0")
            try:
                decoder.decode(block)
            except UnicodeDecodeError as error:
                return offset + (error.start if nul < 0 else min(nul, error.start))
            if nul >= 0:
                return offset + nul
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return offset
    return None


def _strip_batch(batch: dict[str, list[str]]) -> dict[str, list[str]]:
    """Remove stray newlines left around paragraphs by runs of blank lines."""
    return {"text": [text.strip() for text in batch["text"]]}


# --- hub -----------------------------------------------------------------------------------


def _load_hub(name: str, config: str | None, split: str, text_column: str) -> datasets.Dataset:
    """Download (or reuse the cached) Hub split and keep only its text column as ``text``."""
    ds = load_hub_split(name, config, split)
    if text_column not in ds.column_names:
        raise CorpusError(
            f"data.text_column={text_column!r} is not a column of {name}; "
            f"columns are {ds.column_names}"
        )
    ds = ds.select_columns([text_column])
    if text_column != "text":
        ds = ds.rename_column(text_column, "text")
    return ds


def load_hub_split(name: str, config: str | None, split: str) -> datasets.Dataset:
    """A Hub dataset's split, downloaded or from the local cache; where it is neither
    reachable nor cached, refused saying how to get it (text corpus and examples alike)."""
    try:
        return datasets.load_dataset(name, config, split=split)
    except ConnectionError as error:  # offline, or no network, and not in the local cache
        raise _unreachable(name, config, split) from error


def _drop_blank(ds: datasets.Dataset) -> datasets.Dataset:
    """Empty or whitespace-only rows carry no tokens but would still count as documents."""
    return ds.filter(
        lambda batch: [bool(text and text.strip()) for text in batch["text"]],
        batched=True,
        desc="Drop blank documents",
    )


def _unreachable(name: str, config: str | None, split: str) -> CorpusError:
    from huggingface_hub import constants  # noqa: PLC0415

    offline = datasets.config.HF_HUB_OFFLINE or constants.HF_HUB_OFFLINE
    why = (
        "the Hugging Face Hub is offline here (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set)"
        if offline
        else "the Hugging Face Hub cannot be reached from here"
    )
    args = ", ".join(repr(a) for a in (name, config) if a is not None)
    return CorpusError(
        f"data.hub_dataset={name}: {why} and the dataset is not in the local cache "
        f"({datasets.config.HF_DATASETS_CACHE}). Download it once where there is network, "
        f'with the same HF_HOME: python -c "import datasets; datasets.load_dataset({args}, '
        f"split='{split}')\"; or save its text as files and use data.source=text_files "
        "data.text_files=<paths>."
    )
