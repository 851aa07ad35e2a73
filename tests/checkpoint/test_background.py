"""The background checkpoint writer: the checkpoint is marked complete only after its files
are in place, a failed write leaves it incomplete and is raised, stale staging goes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshtrain.checkpoint.background import (
    BackgroundWriter,
    remove_stale_staging,
    staging_folder,
)
from meshtrain.checkpoint.host_copy import bounce_buffer, host_bytes
from meshtrain.checkpoint.manifest import CheckpointError, describe_files
from tests.conftest import mounted_tmpfs


@pytest.fixture
def one_rank(tmp_path: Path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def staged_files(root: Path) -> Path:
    (root / "optimizer").mkdir(parents=True)
    (root / "optimizer" / "rank0.safetensors").write_bytes(b"moments")
    (root / "config.json").write_text("{}")
    return root


def test_the_files_are_in_place_before_the_checkpoint_is_completed(one_rank, tmp_path):
    staged = staged_files(tmp_path / "staging" / "checkpoint-3")
    root = tmp_path / "run" / "checkpoint-3"
    seen = []
    writer = BackgroundWriter()
    described = {}

    def finish(everyone: dict) -> None:
        seen.append(sorted(p.name for p in root.rglob("*")))
        described.update(everyone)

    writer.start(staged, root, finish)
    writer.wait()
    assert seen == [["config.json", "optimizer", "rank0.safetensors"]]
    assert described == describe_files(root)  # hashed on the way, as a reread would
    assert (root / "optimizer" / "rank0.safetensors").read_bytes() == b"moments"
    assert not staged.exists()  # the host memory it held is given back


def test_a_failed_write_is_never_completed_and_is_raised(one_rank, tmp_path):
    staged = staged_files(tmp_path / "staging" / "checkpoint-3")
    root = tmp_path / "run" / "checkpoint-3"
    root.mkdir(parents=True)
    (root / "optimizer").write_text("a file where a folder must go")
    completed = []
    writer = BackgroundWriter()
    writer.start(staged, root, completed.append)
    with pytest.raises(CheckpointError, match="background checkpoint write failed"):
        writer.wait()
    assert not completed and not staged.exists()
    writer.check()  # raised once


def test_a_full_disk_is_named_with_the_file_and_what_is_kept(one_rank, tmp_path):
    staged = staged_files(tmp_path / "staging" / "checkpoint-3")
    (staged / "optimizer" / "rank0.safetensors").write_bytes(bytes(256 << 10))
    with mounted_tmpfs(tmp_path / "disk", "64k") as disk:
        writer = BackgroundWriter()
        writer.start(staged, disk / "checkpoint-3", None)
        with pytest.raises(CheckpointError) as caught:
            writer.wait()
    message = str(caught.value)
    assert "No space left on device" in message and "MB free there" in message
    assert f"could not write {disk}/checkpoint-3/optimizer/rank0.safetensors" in message
    assert "checkpoint-3 is incomplete" in message and "\n" not in message


def test_staging_left_by_a_killed_process_is_removed(tmp_path):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    dead = tmp_path / f"meshtrain-checkpoint-{int(gone.stdout)}-rank0"
    alive = staging_folder(0, tmp_path)
    for folder in (dead, alive):
        (folder / "checkpoint-5").mkdir(parents=True)
    remove_stale_staging(tmp_path)
    assert not dead.exists() and alive.exists()
    assert str(os.getpid()) in alive.name


def test_a_device_tensor_reaches_the_file_through_one_reused_buffer():
    """`host_copy`: the bounce path an accelerator's tensors take (here with a CPU tensor
    and a small buffer, so that a tensor spans several chunks)."""
    flat = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    buffer = torch.empty(1024, dtype=torch.uint8)
    chunks = [bytes(chunk) for chunk in host_bytes(flat, buffer)]
    assert len(chunks) == 10 and b"".join(chunks) == flat.numpy().tobytes()
    first = bounce_buffer("test-device", 4096)
    assert bounce_buffer("test-device", 4096).data_ptr() == first.data_ptr()  # reused
