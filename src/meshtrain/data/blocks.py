"""Read packed token blocks (Arrow files written by `datasets`) from inside a worker.

Workers get the files, not the Dataset object: the files are memory-mapped
and each Arrow chunk of the fixed-length `input_ids` column is viewed as a
2-D numpy array without a copy, so every rank reads the same pages from the
OS cache, nothing is loaded up front whatever the corpus size, and a batch is
one fancy-index per chunk (microseconds, where `Dataset.__getitem__` takes a
millisecond). The files are read with pyarrow alone: `datasets` (and the pandas
it brings) would add most of a second to every rank's start-up.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

if TYPE_CHECKING:
    import datasets


class BlockStore:
    def __init__(self, files: list[str]) -> None:
        self._chunks: list[np.ndarray] = []
        for path in files:
            # `datasets` writes Arrow IPC streams; memory-mapped, nothing is read up front.
            column = pa.ipc.open_stream(pa.memory_map(path)).read_all().column("input_ids")
            for chunk in column.chunks:
                self._chunks.append(_as_matrix(chunk))
        self._starts = np.cumsum([0] + [len(c) for c in self._chunks]).tolist()

    def __len__(self) -> int:
        return self._starts[-1]

    def batch(self, indices: list[int]) -> torch.Tensor:
        """A (len(indices), block_size) int64 tensor of the blocks at `indices`, in order."""
        rows = []
        for index in indices:
            if not 0 <= index < len(self):
                raise IndexError(f"block {index} is outside the {len(self)} blocks")
            chunk = bisect.bisect_right(self._starts, index) - 1
            rows.append(self._chunks[chunk][index - self._starts[chunk]])
        return torch.from_numpy(np.stack(rows)).long()


def _as_matrix(chunk: pa.Array) -> np.ndarray:
    """A zero-copy (rows, block_size) view of an Arrow chunk of equal-length id lists.

    meshtrain's packing writes fixed-size lists; plain lists of equal length
    (blocks made elsewhere) are read the same way.
    """
    if chunk.null_count:
        raise ValueError("input_ids holds missing blocks")
    if pa.types.is_fixed_size_list(chunk.type):
        width = chunk.type.list_size
    elif pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type):
        lengths = np.diff(chunk.offsets.to_numpy())
        if len(lengths) and (lengths != lengths[0]).any():
            raise ValueError("input_ids blocks have different lengths; pack them first")
        width = int(lengths[0]) if len(lengths) else 0
    else:
        raise ValueError(f"input_ids must be lists of token ids, not {chunk.type}")
    values = chunk.flatten().to_numpy(zero_copy_only=True)  # respects the chunk's offset
    return values.reshape(len(chunk), width)


def arrow_files(dataset: datasets.Dataset) -> list[str]:
    """The Arrow files backing a dataset loaded from disk, in row order."""
    files = [entry["filename"] for entry in dataset.cache_files]
    if not files:
        raise ValueError("the dataset lives in memory only; save it to disk first")
    return files
