"""Whole examples best-fit into fixed blocks, each keeping its positions and its mask.

Best-fit decreasing (TRL's `bfd` packing): the longest example first, each into the
fullest block it still fits, a new block when none has room. Each example's positions
restart at 0, so attention can be kept inside it (`models/packed_attention.py`); the
block's tail is padding (its own run of positions, nothing trained). An example longer
than a block is dropped and counted, truncated, or refused (`data.truncation`), never
split over two blocks.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import datasets
import numpy as np
import pyarrow as pa

from meshtrain.config_parsing import ConfigError


@dataclass(frozen=True)
class PackingReport:
    """What packing made of a split; efficiency is real tokens / block tokens."""

    examples: int
    blocks: int
    real_tokens: int
    block_tokens: int
    trained_tokens: int
    dropped_long: int
    truncated: int

    @classmethod
    def of(
        cls, arrays: dict[str, np.ndarray], examples: int, *, dropped: int, truncated: int
    ) -> PackingReport:
        """The report of the blocks `fill_blocks` made of `examples` items."""
        blocks, block_size = arrays["input_ids"].shape
        return cls(
            examples=examples,
            blocks=blocks,
            real_tokens=int(arrays["num_tokens"].sum()),
            block_tokens=blocks * block_size,
            trained_tokens=int(arrays["loss_mask"].sum()),
            dropped_long=dropped,
            truncated=truncated,
        )

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.block_tokens if self.block_tokens else 0.0

    def line(self) -> str:
        return (
            f"{self.examples} examples in {self.blocks} blocks, packing efficiency "
            f"{self.efficiency:.1%} ({self.real_tokens:,} real of {self.block_tokens:,} tokens, "
            f"{self.trained_tokens:,} trained); {self.dropped_long} longer than a block "
            f"dropped, {self.truncated} truncated"
        )


def fit_to_block(
    ids: list[list[int]], trained: list[list[int]], block_size: int, truncation: str
) -> tuple[list[list[int]], list[list[int]], int, int]:
    """The examples that go into blocks (longer ones dropped, cut, or refused), with the
    numbers dropped and truncated."""
    long = [i for i, row in enumerate(ids) if len(row) > block_size]
    if long and truncation == "off":
        longest = max(len(ids[i]) for i in long)
        raise ConfigError(
            f"{len(long)} example(s) are longer than data.block_size={block_size} tokens (the "
            f"longest {longest}) and data.truncation is off: raise data.block_size to "
            f"{longest}, or set data.truncation=drop (leave them out, counted) or truncate."
        )
    keep_ids, keep_trained, dropped, truncated = [], [], 0, 0
    for row, mask in zip(ids, trained, strict=True):
        if len(row) > block_size:
            if truncation == "drop" or not any(mask[:block_size]):
                dropped += 1
                continue
            row, mask, truncated = row[:block_size], mask[:block_size], truncated + 1
        keep_ids.append(row)
        keep_trained.append(mask)
    return keep_ids, keep_trained, dropped, truncated


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Example indices per block: longest first, each into the block with the least room
    that still holds it (ties: the earlier example, the earlier block)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    room: list[tuple[int, int]] = []  # (free tokens, block), sorted
    blocks: list[list[int]] = []
    for index in order:
        at = bisect.bisect_left(room, (lengths[index], -1))
        if at == len(room):
            blocks.append([index])
            free, block = capacity - lengths[index], len(blocks) - 1
        else:
            free, block = room.pop(at)
            blocks[block].append(index)
            free -= lengths[index]
        bisect.insort(room, (free, block))
    return blocks


def pack_examples(
    examples: datasets.Dataset,
    *,
    block_size: int,
    truncation: str,
    pad_token_id: int,
    seed: int,
) -> tuple[datasets.Dataset, PackingReport]:
    """Blocks of `examples` (`input_ids`, `trained`): fixed-size `input_ids`,
    `position_ids`, `loss_mask` and the scalar `num_tokens`, in a seeded order."""
    ids, trained, dropped, truncated = fit_to_block(
        examples["input_ids"], examples["trained"], block_size, truncation
    )
    blocks = best_fit_decreasing([len(row) for row in ids], block_size)
    blocks = [blocks[i] for i in np.random.default_rng(seed).permutation(len(blocks))]
    arrays = fill_blocks(blocks, ids, trained, block_size, pad_token_id)
    report = PackingReport.of(arrays, len(ids), dropped=dropped, truncated=truncated)
    return blocks_dataset(arrays, block_size), report


def fill_blocks(
    blocks: list[list[int]],
    ids: list[list[int]],
    trained: list[list[int]],
    block_size: int,
    pad_token_id: int,
) -> dict[str, np.ndarray]:
    shape = (len(blocks), block_size)
    input_ids = np.full(shape, pad_token_id, dtype=np.int32)
    positions = np.zeros(shape, dtype=np.int32)
    loss_mask = np.zeros(shape, dtype=np.int8)
    num_tokens = np.zeros(len(blocks), dtype=np.int32)
    steps = np.arange(block_size, dtype=np.int32)
    for row, members in enumerate(blocks):
        at = 0
        for index in members:
            n = len(ids[index])
            input_ids[row, at : at + n] = ids[index]
            positions[row, at : at + n] = steps[:n]
            loss_mask[row, at : at + n] = trained[index]
            at += n
        positions[row, at:] = steps[: block_size - at]  # the padding tail, its own run
        num_tokens[row] = at
    return {
        "input_ids": input_ids,
        "position_ids": positions,
        "loss_mask": loss_mask,
        "num_tokens": num_tokens,
    }


def blocks_dataset(
    arrays: dict[str, np.ndarray], block_size: int, description: str = ""
) -> datasets.Dataset:
    """Fixed-size list columns, as `BlockStore` reads them without a copy; `description`
    says what the blocks hold where their columns do not (saved with them)."""
    columns = {
        name: pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), block_size)
        for name, values in arrays.items()
        if name != "num_tokens"
    }
    columns["num_tokens"] = pa.array(arrays["num_tokens"])
    return datasets.Dataset(pa.table(columns), info=datasets.DatasetInfo(description=description))
