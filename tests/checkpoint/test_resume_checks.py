"""Refusals before resuming: another model shape, another sample stream, nothing to resume."""

from __future__ import annotations

import json

import pytest
import torch

from meshtrain.checkpoint.load import check_compatible, check_resumable
from meshtrain.checkpoint.manifest import CheckpointError, find_resume_checkpoint
from meshtrain.distributed.tensor_parallel import ParameterSharding


def test_another_model_shape_is_refused_naming_the_tensor() -> None:
    manifest = {"tensors": {"model.norm.weight": {"shape": [64]}}}
    layouts = {"model.norm.weight": ParameterSharding("model.norm.weight", None, 1)}
    with pytest.raises(CheckpointError, match="model.norm.weight is \\[64\\]"):
        check_compatible(manifest, {"model.norm.weight": torch.zeros(128)}, layouts)
    with pytest.raises(CheckpointError, match="no tensor lm_head.weight"):
        check_compatible(
            manifest,
            {"lm_head.weight": torch.zeros(2, 2)},
            {"lm_head.weight": ParameterSharding("lm_head.weight", 0, 1)},
        )


def test_resuming_with_another_global_batch_is_refused(tmp_path) -> None:
    state = {"step": 3, "seed": 1, "global_batch_size": 8, "num_train_blocks": 100}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    assert (
        check_resumable(tmp_path, seed=1, global_batch_size=8, num_train_blocks=100, max_steps=9)
        == 3
    )
    with pytest.raises(CheckpointError, match="global_batch_size=8"):
        check_resumable(tmp_path, seed=1, global_batch_size=16, num_train_blocks=100, max_steps=9)
    with pytest.raises(CheckpointError, match="raise max_steps"):
        check_resumable(tmp_path, seed=1, global_batch_size=8, num_train_blocks=100, max_steps=3)


def test_latest_with_nothing_to_resume_says_where_it_looked(tmp_path) -> None:
    (tmp_path / "run" / "checkpoint-4").mkdir(parents=True)  # half-written: no marker
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        find_resume_checkpoint(tmp_path, "latest", None)


def test_kv_heads_are_copied_again_for_the_new_tp() -> None:
    # 2 KV heads of 3 rows; tp=4 needs each head twice, ranks 0,1 get head 0.
    full = torch.arange(12.0).reshape(6, 2)
    layout = ParameterSharding("k", 0, 2, kv_replication=2, head_dim=3)
    assert torch.equal(layout.local_piece(full, 1, 4), full[:3])
    assert torch.equal(layout.local_piece(full, 2, 4), full[3:])
