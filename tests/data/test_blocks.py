"""BlockStore: zero-copy reads of packed blocks, in the sampler's order, across Arrow chunks."""

from __future__ import annotations

import subprocess
import sys

import datasets
import pyarrow as pa
import pytest
import torch

from meshtrain.data.blocks import BlockStore, _as_matrix, arrow_files


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


def test_integer_columns_are_viewed_without_pandas_or_pyarrow_compute(tmp_path) -> None:
    """A rank reads its blocks without importing pandas or pyarrow.compute (pyarrow's
    `to_numpy` does on its first call: most of a second of every rank's start-up),
    each chunk a view of the memory-mapped file, int8 masks and int64 ids included."""
    rows = {"input_ids": [[i, i + 1] for i in range(5)], "loss_mask": [[1, 0]] * 5}
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int64"), length=2),
            "loss_mask": datasets.List(datasets.Value("int8"), length=2),
        }
    )
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "v"))
    files = arrow_files(datasets.load_from_disk(str(tmp_path / "v")))
    script = (
        "import sys; from meshtrain.data.blocks import BlockStore; "
        f"store = BlockStore({files!r}); "
        "assert store.batch([0, 3]).tolist() == [[0, 1], [3, 4]]; "
        "assert store._chunks['loss_mask'][0].dtype.name == 'int8'; "
        "assert not store._chunks['input_ids'][0].flags.writeable; "
        "print(sorted(m for m in ('pandas', 'pyarrow.compute') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_a_sliced_chunk_is_read_from_its_offset() -> None:
    ids = pa.FixedSizeListArray.from_arrays(pa.array(range(12), pa.int32()), 3).slice(1, 2)
    assert _as_matrix(ids).tolist() == [[3, 4, 5], [6, 7, 8]]
    plain = pa.array([[0, 1], [2, 3], [4, 5], [6, 7]], pa.list_(pa.int64())).slice(2)
    assert _as_matrix(plain).tolist() == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="integers, not double"):
        _as_matrix(pa.FixedSizeListArray.from_arrays(pa.array([0.5, 1.5]), 2))
