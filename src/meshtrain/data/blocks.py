"""Read packed token blocks (Arrow files written by `datasets`) from inside a worker.

Workers get the files, not the Dataset object: the files are memory-mapped
and each Arrow chunk of the fixed-length `input_ids` column is viewed as a
2-D numpy array without a copy, so every rank reads the same pages from the
OS cache, nothing is loaded up front whatever the corpus size, and a batch is
one fancy-index per chunk (microseconds, where `Dataset.__getitem__` takes a
millisecond). The files are read with pyarrow alone: `datasets` (and the pandas
it brings) would add most of a second to every rank's start-up; so would pyarrow's own
`to_numpy`, which imports pandas and pyarrow.compute on its first call, so the integer
columns are viewed through their Arrow buffers (`_numpy_view`).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

from meshtrain.data.batch import TokenBatch, next_token_labels

if TYPE_CHECKING:
    import datasets


PACKED_COLUMNS = ("position_ids", "loss_mask")
"""The columns of fine-tuning blocks (`data/bfd.py`) beside `input_ids`."""


def is_packed(split: datasets.Dataset) -> bool:
    """Fine-tuning blocks: whole examples side by side, positions restarting at each, and
    a loss mask of the tokens the run trains."""
    return set(PACKED_COLUMNS) <= set(split.column_names)


class BlockStore:
    def __init__(self, files: list[str]) -> None:
        self.files = list(files)  # the Arrow files, in order
        self._chunks: dict[str, list[np.ndarray]] = {}
        for path in files:
            # `datasets` writes Arrow IPC streams; memory-mapped, nothing is read up front.
            table = pa.ipc.open_stream(pa.memory_map(path)).read_all()
            for name in ("input_ids", *PACKED_COLUMNS, "num_tokens"):
                if name not in table.column_names:
                    continue
                chunks = self._chunks.setdefault(name, [])
                for chunk in table.column(name).chunks:
                    chunks.append(_as_matrix(chunk) if name != "num_tokens" else _numpy_view(chunk))
        ids = self._chunks.get("input_ids", [])
        self._starts = np.cumsum([0] + [len(c) for c in ids]).tolist()
        self.packed = all(name in self._chunks for name in PACKED_COLUMNS)

    def __len__(self) -> int:
        return self._starts[-1]

    def _rows(self, column: str, indices: list[int]) -> np.ndarray:
        rows = []
        for index in indices:
            if not 0 <= index < len(self):
                raise IndexError(f"block {index} is outside the {len(self)} blocks")
            chunk = bisect.bisect_right(self._starts, index) - 1
            rows.append(self._chunks[column][chunk][index - self._starts[chunk]])
        return np.stack(rows)

    def batch(self, indices: list[int]) -> torch.Tensor:
        """A (len(indices), block_size) int64 tensor of the blocks at `indices`, in order."""
        return torch.from_numpy(self._rows("input_ids", indices)).long()

    def tokens(self, indices: list[int]) -> TokenBatch:
        """The blocks at `indices` with their targets (and, packed, positions and mask)."""
        input_ids = self.batch(indices)
        if not self.packed:
            return TokenBatch.of_ids(input_ids)
        positions = torch.from_numpy(self._rows("position_ids", indices)).long()
        loss_mask = torch.from_numpy(self._rows("loss_mask", indices))
        real = (
            int(self._rows("num_tokens", indices).sum()) if "num_tokens" in self._chunks else None
        )
        labels = next_token_labels(input_ids, positions, loss_mask)
        return TokenBatch(input_ids, labels, positions, real)

    def real_tokens(self, indices: list[int]) -> int:
        """Tokens of these blocks that are not padding (all of a pretraining block's)."""
        if "num_tokens" not in self._chunks:
            return len(indices) * self._chunks["input_ids"][0].shape[1]
        return int(self._rows("num_tokens", indices).sum())

    def trained_tokens(self, indices: list[int]) -> int:
        """How many positions of these blocks have a target (the loss's denominator)."""
        if not self.packed:
            width = self._chunks["input_ids"][0].shape[1]
            return len(indices) * (width - 1)
        return self.tokens(indices).trained_tokens


def _as_matrix(chunk: pa.Array) -> np.ndarray:
    """A zero-copy (rows, block_size) view of an Arrow chunk of equal-length id lists.

    meshtrain's packing writes fixed-size lists; plain lists of equal length
    (blocks made elsewhere) are read the same way.
    """
    if chunk.null_count:
        raise ValueError("input_ids holds missing blocks")
    if pa.types.is_fixed_size_list(chunk.type):
        width = chunk.type.list_size
        start = chunk.offset * width  # `values` ignores the chunk's own offset
    elif pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type):
        offsets = _numpy_view(chunk.offsets)  # the chunk's, its offset applied
        lengths = np.diff(offsets)
        if len(lengths) and (lengths != lengths[0]).any():
            raise ValueError("input_ids blocks have different lengths; pack them first")
        width = int(lengths[0]) if len(lengths) else 0
        start = int(offsets[0])
    else:
        raise ValueError(f"input_ids must be lists of token ids, not {chunk.type}")
    # (not `chunk.flatten()`, which imports pyarrow.compute)
    values = _numpy_view(chunk.values.slice(start, len(chunk) * width))
    return values.reshape(len(chunk), width)


def _numpy_view(values: pa.Array) -> np.ndarray:
    """A zero-copy, read-only numpy view of an Arrow integer array without nulls."""
    if not pa.types.is_integer(values.type):
        raise ValueError(f"blocks hold integers, not {values.type}")
    dtype = np.dtype(str(values.type))  # Arrow's integer names are numpy's
    if values.null_count:
        raise ValueError("the blocks hold missing values")
    data = values.buffers()[1]
    return np.frombuffer(
        data, dtype=dtype, count=len(values), offset=values.offset * dtype.itemsize
    )


def arrow_files(dataset: datasets.Dataset) -> list[str]:
    """The Arrow files backing a dataset loaded from disk, in row order."""
    files = [entry["filename"] for entry in dataset.cache_files]
    if not files:
        raise ValueError("the dataset lives in memory only; save it to disk first")
    return files
