"""DPO's precomputed reference table on disk: read back memory-mapped, made again when
the starting weights or the blocks change."""

from __future__ import annotations

import os

import datasets
import pytest
import torch
from safetensors.torch import save_file

from meshtrain.components.reference_store import (
    REFERENCE_FILE,
    load_tables,
    save_tables,
    table_identity,
)
from meshtrain.data.blocks import BlockStore, arrow_files


@pytest.fixture
def setting(tmp_path):
    weights = tmp_path / "base"
    weights.mkdir()
    save_file({"w": torch.ones(3)}, weights / "model.safetensors")
    split = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 5})
    split.save_to_disk(str(tmp_path / "blocks"))
    blocks = BlockStore(arrow_files(datasets.load_from_disk(str(tmp_path / "blocks"))))
    identity = table_identity(str(weights), {"model_type": "llama"}, {"train": blocks})
    return tmp_path, weights, blocks, identity


def test_a_saved_table_reads_back_row_by_row_for_the_same_weights_and_blocks(setting):
    root, _, blocks, identity = setting
    table = torch.randn(len(blocks), 4)
    path = root / "run" / REFERENCE_FILE
    save_tables(path, {"train": table}, identity)
    stored = load_tables(path, identity)
    assert len(stored["train"]) == len(blocks)
    assert torch.equal(stored["train"][[4, 0, 2]], table[[4, 0, 2]])
    assert not path.with_name(path.name + ".partial").exists()


def test_a_table_of_other_weights_or_other_blocks_is_not_used(setting):
    root, weights, blocks, identity = setting
    path = root / "run" / REFERENCE_FILE
    save_tables(path, {"train": torch.zeros(len(blocks), 4)}, identity)
    # The SFT run wrote new weights to the same folder.
    save_file({"w": torch.full((3,), 2.0)}, weights / "model.safetensors")
    retrained = table_identity(str(weights), {"model_type": "llama"}, {"train": blocks})
    assert load_tables(path, retrained) is None
    # The blocks were prepared again (same folder, new files).
    os.utime(blocks.files[0], ns=(1, 1))
    touched = BlockStore(blocks.files)
    assert load_tables(path, table_identity(str(weights), {}, {"train": touched})) is None


def test_a_missing_or_broken_file_is_not_a_table(setting):
    root, _, _, identity = setting
    path = root / REFERENCE_FILE
    assert load_tables(path, identity) is None
    path.write_bytes(b"not a safetensors file")
    assert load_tables(path, identity) is None
