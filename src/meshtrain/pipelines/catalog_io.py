"""Kedro datasets for what the engine produces: `datasets` folders and tokenizers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
from kedro.io import AbstractDataset


class HFDiskDataset(AbstractDataset[Any, Any]):
    """A `datasets.Dataset` or `DatasetDict` saved with `save_to_disk` (memory-mapped on load)."""

    def __init__(self, path: str) -> None:
        self._path = Path(path)

    def load(self) -> datasets.Dataset | datasets.DatasetDict:
        return datasets.load_from_disk(str(self._path))

    def save(self, data: datasets.Dataset | datasets.DatasetDict) -> None:
        # save_to_disk refuses to overwrite the files a loaded dataset maps, so write
        # beside and swap.
        staging = self._path.with_name(self._path.name + ".saving")
        data.save_to_disk(str(staging))
        old = self._path.with_name(self._path.name + ".old")
        if self._path.exists():
            self._path.rename(old)
        staging.rename(self._path)
        if old.exists():
            import shutil

            shutil.rmtree(old)

    def _exists(self) -> bool:
        return self._path.exists()

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path)}


class TokenizerDataset(AbstractDataset[Any, Any]):
    """A Hugging Face tokenizer folder: `save_pretrained` / `AutoTokenizer.from_pretrained`."""

    def __init__(self, path: str) -> None:
        self._path = Path(path)

    def load(self) -> Any:
        from meshtrain.data.tokenizer import load_tokenizer

        return load_tokenizer(str(self._path))

    def save(self, tokenizer: Any) -> None:
        self._path.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(self._path))

    def _exists(self) -> bool:
        return (self._path / "tokenizer_config.json").exists()

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path)}


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
