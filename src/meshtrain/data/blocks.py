"""Read packed token blocks (Arrow files written by `datasets`) from inside a worker.

Workers get the files, not the Dataset object: `Dataset.from_file` memory-maps
them, so every rank reads the same pages from the OS cache and nothing is
copied into each process up front, whatever the corpus size.
"""

from __future__ import annotations

import datasets
import torch


class BlockStore:
    def __init__(self, files: list[str]) -> None:
        parts = [datasets.Dataset.from_file(f) for f in files]
        dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        self.dataset = dataset.select_columns(["input_ids"]).with_format("torch")

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, indices: list[int]) -> torch.Tensor:
        """A (len(indices), block_size) int64 tensor of the blocks at `indices`, in order."""
        return self.dataset[indices]["input_ids"].long()


def arrow_files(dataset: datasets.Dataset) -> list[str]:
    """The Arrow files backing a dataset loaded from disk, in row order."""
    files = [entry["filename"] for entry in dataset.cache_files]
    if not files:
        raise ValueError("the dataset lives in memory only; save it to disk first")
    return files
