"""The checkpoint contract: manifest checks, finding the latest complete one, consolidation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from meshtrain.checkpoint import (
    CheckpointError,
    consolidate_checkpoint,
    list_checkpoints,
    resolve_checkpoint,
)
from meshtrain.checkpoint.files import shard_dir_name
from meshtrain.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    describe_files,
    mark_complete,
    read_manifest,
    write_json_atomic,
)
from meshtrain.models import build_model, build_model_config
from tests.conftest import TINY_MODEL, TINY_VOCAB

SHARD = f"shards/{shard_dir_name(0, 0)}/model.safetensors"

# Full tensors of the fake model and how the tp=2 checkpoint stores them.
FULL = {
    "model.embed_tokens.weight": torch.arange(32, dtype=torch.float32).reshape(8, 4),
    "model.norm.weight": torch.tensor([1.0, 2.0, 3.0, 4.0]),
    "lm_head.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4) / 10,
}
TP_DIM = {"model.embed_tokens.weight": 0, "model.norm.weight": None, "lm_head.weight": 1}


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config")
    build_model_config("llama", dict(TINY_MODEL), vocab_size=TINY_VOCAB).save_pretrained(path)
    return path


def _shard_of(name: str, tp_rank: int, tp: int) -> torch.Tensor:
    dim = TP_DIM[name]
    full = FULL[name]
    return full if dim is None else torch.chunk(full, tp, dim=dim)[tp_rank].contiguous()


def make_checkpoint(
    root: Path,
    config_dir: Path,
    *,
    step: int = 10,
    tp: int = 1,
    complete: bool = True,
    shapes: dict[str, list[int]] | None = None,
) -> Path:
    """A checkpoint folder as save_checkpoint lays it out, from hand-made tensors.

    Files already in `root` (a tokenizer, say) are listed in the manifest too."""
    root.mkdir(parents=True, exist_ok=True)
    for tp_rank in range(tp):
        shard_dir = root / "shards" / shard_dir_name(tp_rank, 0)
        shard_dir.mkdir(parents=True)
        tensors = {name: _shard_of(name, tp_rank, tp) for name in FULL}
        save_file(tensors, shard_dir / "model.safetensors", metadata={"format": "pt"})
    (root / "optimizer").mkdir()
    save_file({"exp_avg": torch.zeros(5)}, root / "optimizer" / "dp_rank_00.safetensors")
    shutil.copy2(config_dir / "config.json", root / "config.json")
    write_json_atomic(root / "trainer_state.json", {"step": step})
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "layout": {"data_parallel_size": 1, "tensor_parallel_size": tp},
        "world_size": tp,
        "tensors": {
            name: {
                "shape": (shapes or {}).get(name, list(tensor.shape)),
                "dtype": "float32",
                "tp_dim": TP_DIM[name] if tp > 1 else None,
                "pp_rank": 0,
            }
            for name, tensor in FULL.items()
        },
        "files": describe_files(root),
    }
    if complete:
        mark_complete(root, manifest)
    else:
        write_json_atomic(root / "manifest.json", manifest)
    return root


@pytest.fixture
def checkpoint(tmp_path: Path, config_dir: Path) -> Path:
    return make_checkpoint(tmp_path / "run" / "checkpoint-10", config_dir)


def _rewrite_manifest(root: Path, **changes: Any) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    mark_complete(root, {**manifest, **changes})


# --- read_manifest --------------------------------------------------------------------------


def test_a_complete_checkpoint_is_accepted(checkpoint: Path) -> None:
    manifest = read_manifest(checkpoint)
    assert manifest["format"] == FORMAT
    assert manifest["step"] == 10
    assert SHARD in manifest["files"]
    assert "config.json" in manifest["files"]
    assert "manifest.json" not in manifest["files"]
    assert "COMPLETE" not in manifest["files"]
    assert (checkpoint / "COMPLETE").read_text().strip() == "10"
    assert not list(checkpoint.rglob("*.tmp"))


def test_describe_files_records_size_and_sha256(checkpoint: Path) -> None:
    files = describe_files(checkpoint)
    assert files[SHARD]["bytes"] == (checkpoint / SHARD).stat().st_size
    assert len(files[SHARD]["sha256"]) == 64
    assert set(files) == {
        SHARD,
        "optimizer/dp_rank_00.safetensors",
        "config.json",
        "trainer_state.json",
    }


def test_without_the_marker_it_was_not_completely_written(tmp_path: Path, config_dir: Path) -> None:
    root = make_checkpoint(tmp_path / "checkpoint-3", config_dir, complete=False)
    assert (root / "manifest.json").is_file()
    with pytest.raises(CheckpointError, match="not completely written"):
        read_manifest(root)


def test_a_marker_without_manifest_is_incomplete(checkpoint: Path) -> None:
    (checkpoint / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not completely written"):
        read_manifest(checkpoint)


def test_a_truncated_shard_is_named(checkpoint: Path) -> None:
    data = (checkpoint / SHARD).read_bytes()
    (checkpoint / SHARD).write_bytes(data[:-7])
    for verify in (True, False):  # the size is checked with or without hashing
        with pytest.raises(CheckpointError) as info:
            read_manifest(checkpoint, verify=verify)
    message = str(info.value)
    assert str(checkpoint / SHARD) in message
    assert f"{len(data) - 7} bytes" in message and f"says {len(data)}" in message


def test_a_flipped_byte_fails_the_sha256(checkpoint: Path) -> None:
    data = bytearray((checkpoint / SHARD).read_bytes())
    data[-1] ^= 0xFF  # the last byte of the tensor data: same size, other content
    (checkpoint / SHARD).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256") as info:
        read_manifest(checkpoint)
    assert str(checkpoint / SHARD) in str(info.value)
    # Without verification only sizes are checked, and they still match.
    assert read_manifest(checkpoint, verify=False)["step"] == 10


def test_a_missing_listed_file_is_named(checkpoint: Path) -> None:
    missing = checkpoint / "optimizer" / "dp_rank_00.safetensors"
    missing.unlink()
    with pytest.raises(CheckpointError, match="listed in the manifest but missing") as info:
        read_manifest(checkpoint)
    assert str(missing) in str(info.value)


@pytest.mark.parametrize("absolute", [False, True])
def test_an_entry_pointing_outside_is_refused(checkpoint: Path, absolute: bool) -> None:
    outside = checkpoint.parent / "outside.safetensors"
    shutil.copy2(checkpoint / SHARD, outside)
    rel = str(outside) if absolute else "../outside.safetensors"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    files = {**manifest["files"], rel: manifest["files"][SHARD]}
    _rewrite_manifest(checkpoint, files=files)
    with pytest.raises(CheckpointError, match="points outside") as info:
        read_manifest(checkpoint)
    assert repr(rel) in str(info.value)


def test_another_format_is_refused(checkpoint: Path) -> None:
    _rewrite_manifest(checkpoint, format="something-else")
    with pytest.raises(CheckpointError, match=f"not a {FORMAT} manifest"):
        read_manifest(checkpoint)


def test_a_newer_format_version_is_refused(checkpoint: Path) -> None:
    _rewrite_manifest(checkpoint, version=FORMAT_VERSION + 1)
    with pytest.raises(CheckpointError, match="newer meshtrain"):
        read_manifest(checkpoint)


def test_a_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "checkpoint-1").write_text("x")
    with pytest.raises(CheckpointError, match="is not a folder"):
        read_manifest(tmp_path / "checkpoint-1")


# --- finding checkpoints --------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path: Path, config_dir: Path) -> Path:
    run = tmp_path / "run"
    make_checkpoint(run / "checkpoint-5", config_dir, step=5)
    make_checkpoint(run / "checkpoint-10", config_dir, step=10)
    make_checkpoint(run / "checkpoint-15", config_dir, step=15, complete=False)
    (run / "logs").mkdir()
    (run / "checkpoint-20").write_text("not a folder")
    (run / "checkpoint-x").mkdir()
    return run


def test_list_checkpoints_is_oldest_first_and_complete_only(run_dir: Path) -> None:
    assert list_checkpoints(run_dir) == [
        (5, run_dir / "checkpoint-5"),
        (10, run_dir / "checkpoint-10"),
    ]


def test_list_checkpoints_orders_by_step_not_by_name(tmp_path: Path, config_dir: Path) -> None:
    for step in (100, 9, 20):
        make_checkpoint(tmp_path / f"checkpoint-{step}", config_dir, step=step)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [9, 20, 100]


def test_list_checkpoints_of_a_missing_folder_is_empty(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path / "nowhere") == []


def test_resolve_a_checkpoint_folder(run_dir: Path) -> None:
    assert resolve_checkpoint(run_dir / "checkpoint-5") == run_dir / "checkpoint-5"


def test_resolve_its_shards_folder(run_dir: Path) -> None:
    assert resolve_checkpoint(run_dir / "checkpoint-5" / "shards") == run_dir / "checkpoint-5"


def test_resolve_a_run_folder_picks_the_latest_complete(run_dir: Path) -> None:
    assert resolve_checkpoint(run_dir) == run_dir / "checkpoint-10"
    assert resolve_checkpoint(str(run_dir)) == run_dir / "checkpoint-10"


def test_resolve_a_run_folder_without_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path / "run")


# --- consolidation --------------------------------------------------------------------------


@pytest.fixture
def tp2_checkpoint(tmp_path: Path, config_dir: Path) -> Path:
    root = tmp_path / "run" / "checkpoint-7"
    (root / "tokenizer").mkdir(parents=True)
    (root / "tokenizer" / "tokenizer.json").write_text('{"fake": true}')
    (root / "generation_config.json").write_text('{"bos_token_id": 1}')
    return make_checkpoint(root, config_dir, step=7, tp=2)


def test_the_tp2_fixture_holds_split_and_replicated_tensors(tp2_checkpoint: Path) -> None:
    rank_0 = load_file(tp2_checkpoint / "shards" / shard_dir_name(0, 0) / "model.safetensors")
    rank_1 = load_file(tp2_checkpoint / "shards" / shard_dir_name(1, 0) / "model.safetensors")
    assert rank_0["model.embed_tokens.weight"].shape == (4, 4)
    assert rank_0["lm_head.weight"].shape == (6, 2)
    assert torch.equal(rank_0["model.norm.weight"], rank_1["model.norm.weight"])
    assert not torch.equal(rank_0["model.embed_tokens.weight"], rank_1["model.embed_tokens.weight"])
    assert "tokenizer/tokenizer.json" in read_manifest(tp2_checkpoint)["files"]


def test_consolidate_rebuilds_the_full_tensors(tp2_checkpoint: Path, tmp_path: Path) -> None:
    output = tmp_path / "hf"
    summary = consolidate_checkpoint(tp2_checkpoint.parent, output)
    assert summary["checkpoint"] == str(tp2_checkpoint)
    assert summary["output_dir"] == str(output)
    assert summary["step"] == 7
    assert summary["num_tensors"] == len(FULL)
    assert summary["num_parameters"] == sum(t.numel() for t in FULL.values())
    assert summary["layout"]["tensor_parallel_size"] == 2

    merged = load_file(output / "model.safetensors")
    assert set(merged) == set(FULL)
    manifest = json.loads((tp2_checkpoint / "manifest.json").read_text())
    for name, full in FULL.items():
        assert list(merged[name].shape) == manifest["tensors"][name]["shape"]
        assert torch.equal(merged[name], full), name
    assert (output / "config.json").read_bytes() == (tp2_checkpoint / "config.json").read_bytes()
    assert (output / "tokenizer.json").read_text() == '{"fake": true}'
    assert (output / "generation_config.json").is_file()
    assert not (output / "manifest.json").exists()
    assert not (tmp_path / "hf.partial").exists()


def test_consolidate_replaces_an_old_output(tp2_checkpoint: Path, tmp_path: Path) -> None:
    output = tmp_path / "hf"
    output.mkdir()
    (output / "stale.txt").write_text("old")
    consolidate_checkpoint(tp2_checkpoint, output)
    assert not (output / "stale.txt").exists()
    assert (output / "model.safetensors").is_file()


def test_consolidate_refuses_a_shape_mismatch(tmp_path: Path, config_dir: Path) -> None:
    root = make_checkpoint(
        tmp_path / "checkpoint-7",
        config_dir,
        step=7,
        tp=2,
        shapes={"lm_head.weight": [6, 2]},  # the shard's shape, not the full one
    )
    output = tmp_path / "hf"
    with pytest.raises(CheckpointError, match=r"lm_head\.weight rebuilt with shape \[6, 4\]"):
        consolidate_checkpoint(root, output)
    assert not output.exists()


def test_consolidate_refuses_a_missing_tp_shard(tmp_path: Path, config_dir: Path) -> None:
    root = make_checkpoint(tmp_path / "checkpoint-7", config_dir, step=7, tp=2)
    manifest = json.loads((root / "manifest.json").read_text())
    shutil.rmtree(root / "shards" / shard_dir_name(1, 0))
    files = {k: v for k, v in manifest["files"].items() if shard_dir_name(1, 0) not in k}
    _rewrite_manifest(root, files=files)
    with pytest.raises(CheckpointError, match=f"missing shard file .*{shard_dir_name(1, 0)}"):
        consolidate_checkpoint(root, tmp_path / "hf")


def test_consolidate_refuses_an_incomplete_checkpoint(tmp_path: Path, config_dir: Path) -> None:
    root = make_checkpoint(tmp_path / "checkpoint-7", config_dir, step=7, tp=2, complete=False)
    with pytest.raises(CheckpointError, match="not completely written"):
        consolidate_checkpoint(root, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_consolidated_real_model_loads_in_transformers(tmp_path: Path) -> None:
    """A tp=1 checkpoint of a real model consolidates into a folder HF loads unchanged."""
    config = build_model_config("llama", dict(TINY_MODEL), vocab_size=TINY_VOCAB)
    model = build_model(config, seed=0)
    root = tmp_path / "checkpoint-2"
    shard_dir = root / "shards" / shard_dir_name(0, 0)
    shard_dir.mkdir(parents=True)
    state = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    save_file(state, shard_dir / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(root)
    mark_complete(
        root,
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": 2,
            "layout": {"tensor_parallel_size": 1},
            "tensors": {
                n: {"shape": list(t.shape), "dtype": "float32", "tp_dim": None, "pp_rank": 0}
                for n, t in state.items()
            },
            "files": describe_files(root),
        },
    )
    output = tmp_path / "hf"
    consolidate_checkpoint(root, output)
    loaded = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)
    loaded_state = dict(loaded.named_parameters())
    assert set(loaded_state) == set(state)
    for name, tensor in state.items():
        assert torch.equal(loaded_state[name].detach(), tensor), name
