"""BlockStore: zero-copy reads of packed blocks, in the sampler's order, across Arrow chunks."""

from __future__ import annotations

import datasets
import pytest
import torch

from meshtrain.data.blocks import BlockStore, arrow_files


@pytest.fixture
def many_chunks(tmp_path) -> datasets.Dataset:
    rows = [[i * 10 + j for j in range(6)] for i in range(50)]
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"), length=6)})
    parts = [
        datasets.Dataset.from_dict({"input_ids": rows[a:b]}, features=features)
        for a, b in ((0, 7), (7, 30), (30, 50))
    ]
    # Several shards on disk, each possibly several Arrow chunks.
    datasets.concatenate_datasets(parts).save_to_disk(str(tmp_path / "d"), num_shards=3)
    return datasets.load_from_disk(str(tmp_path / "d"))


def test_blocks_come_back_in_the_order_asked(many_chunks) -> None:
    store = BlockStore(arrow_files(many_chunks))
    assert len(store) == 50
    indices = [49, 0, 7, 6, 30, 29, 13, 13]
    expected = torch.tensor([many_chunks[i]["input_ids"] for i in indices], dtype=torch.long)
    got = store.batch(indices)
    assert got.dtype == torch.long and torch.equal(got, expected)


def test_out_of_range_is_an_error(many_chunks) -> None:
    store = BlockStore(arrow_files(many_chunks))
    with pytest.raises(IndexError, match="outside the 50 blocks"):
        store.batch([50])


def test_plain_lists_of_equal_length_are_read_too(tmp_path) -> None:
    rows = [[i, i + 1, i + 2] for i in range(10)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "p"))
    store = BlockStore(arrow_files(datasets.load_from_disk(str(tmp_path / "p"))))
    assert store.batch([3, 1]).tolist() == [rows[3], rows[1]]


def test_ragged_blocks_are_refused(tmp_path) -> None:
    datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}).save_to_disk(str(tmp_path / "r"))
    with pytest.raises(ValueError, match="different lengths"):
        BlockStore(arrow_files(datasets.load_from_disk(str(tmp_path / "r"))))
