"""Kedro datasets for what the engine produces: `datasets` folders and tokenizers.

Kedro builds the catalog before the run's checks: the libraries that read and write
these folders are imported when a node loads one, not with the catalog."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kedro.io import AbstractDataset

if TYPE_CHECKING:
    import datasets

# What the nodes pass between them, named without importing `datasets`: Kedro resolves
# the nodes' annotations when it builds the pipelines, before the run's checks.
Rows = Any  # a `datasets.Dataset`: the corpus or the examples, one per row
Splits = Mapping[str, Any]  # a `datasets.DatasetDict`: the "train" and "validation" blocks


class StagedFolder(AbstractDataset[Any, Any]):
    """A folder a node writes, kept beside its place (`<path>.staged`) until the run
    commits it: a run refused after the data pipeline wrote (a block longer than the
    corpus, a batch larger than its blocks) leaves what was there before untouched,
    the `datasets` caches inside it included. Later nodes of the run read the staged
    copy; `hooks.StagedDataHook` commits before training (whose workers read the
    files by path) or at the end, and discards on an error before that."""

    def __init__(self, path: str) -> None:
        self._path = Path(path)
        self._staged = self._path.with_name(self._path.name + ".staged")
        self._pending = False

    @property
    def _current(self) -> Path:
        return self._staged if self._pending else self._path

    def save(self, data: Any) -> None:
        if self._staged.exists():  # a leftover of a run that was killed
            shutil.rmtree(self._staged)
        self._write(data, self._staged)
        self._pending = True

    def commit(self) -> None:
        """Swap the staged folder into place (the old one is removed only after)."""
        if not self._pending:
            return
        old = self._path.with_name(self._path.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        if self._path.exists():
            self._path.rename(old)
        self._staged.rename(self._path)
        self._pending = False
        shutil.rmtree(old, ignore_errors=True)

    def discard(self) -> None:
        if self._pending:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._pending = False

    def _write(self, data: Any, folder: Path) -> None:
        raise NotImplementedError

    def _exists(self) -> bool:
        return self._path.exists() or self._pending

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path)}


class HFDiskDataset(StagedFolder):
    """A `datasets.Dataset` or `DatasetDict` saved with `save_to_disk` (memory-mapped on load)."""

    def load(self) -> datasets.Dataset | datasets.DatasetDict:
        from datasets import load_from_disk  # noqa: PLC0415

        return load_from_disk(str(self._current))

    def _write(self, data: datasets.Dataset | datasets.DatasetDict, folder: Path) -> None:
        data.save_to_disk(str(folder))


class TokenizerDataset(StagedFolder):
    """A Hugging Face tokenizer folder: `save_pretrained` / `AutoTokenizer.from_pretrained`."""

    def load(self) -> Any:
        from meshtrain.data.tokenizer import load_tokenizer

        return load_tokenizer(str(self._current))

    def _write(self, tokenizer: Any, folder: Path) -> None:
        folder.mkdir(parents=True)
        tokenizer.save_pretrained(str(folder))

    def _exists(self) -> bool:
        return (self._current / "tokenizer_config.json").exists()


class UndeclaredExamples(AbstractDataset[Any, Any]):
    """`raw_examples` until a project declares its own: loads nothing.

    `data.source=catalog` fine-tunes on whatever dataset `raw_examples` names in
    `conf/<env>/catalog.yml` (kedro-datasets' Hugging Face, JSON, Parquet, pandas ...):
    the catalog owns the read, as in every Kedro project. This default stands for "none
    declared", so the other sources need no entry.
    """

    def load(self) -> None:
        return None

    def save(self, data: Any) -> None:
        raise NotImplementedError("raw_examples is read, never written, by meshtrain")

    def _exists(self) -> bool:
        return True

    def _describe(self) -> dict[str, Any]:
        return {"declared": False}
