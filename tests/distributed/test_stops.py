"""A run stops on purpose and loses nothing: a stop signal (SIGUSR1 to the launcher, as
SLURM sends before a time limit, or to the whole process group; SIGTERM to one worker
only, as a node's preemption)
finishes the step, writes a complete checkpoint and ends the job with one line saying
how to resume, and the resumed run is bitwise the uninterrupted one; a diverging run
stops before applying a non-finite step, and every checkpoint it leaves is finite; a
checkpoint with no room on disk is refused before its first byte, the last one kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshtrain.checkpoint import consolidate_checkpoint
from meshtrain.checkpoint.manifest import find_resume_checkpoint, list_checkpoints, read_manifest
from meshtrain.checkpoint.safetensors_format import save_safetensors
from meshtrain.checkpoint.space import CheckpointSpaceError, named_write_errors
from meshtrain.config import Refused
from meshtrain.data.blocks import arrow_files
from meshtrain.launch.job import run_training
from tests.conftest import mounted_tmpfs, worker_processes
from tests.distributed.reference import run_group
from tests.distributed.stop_run import plan_for, spec_for, stop_run_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2000  # far more than run before the signal lands
SIGNAL_AT = f"/{STEPS} ("  # rank 0's first progress line (every 5% of the steps)


def _run_until_signalled(blocks: Path, out: Path, send) -> tuple[int, str, float]:
    """Start a long run, call `send(process)` once rank 0 logs its first progress line;
    (exit code, output, seconds from the signal to the exit)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.distributed.stop_run", str(blocks), str(out), str(STEPS)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own process group, as a SLURM step's
    )
    lines, sent = [], None
    for line in process.stdout:
        lines.append(line)
        if sent is None and line.startswith("[rank0] step ") and SIGNAL_AT in line:
            send(process)
            sent = time.monotonic()
    process.wait(timeout=120)
    assert sent is not None, "".join(lines[-30:])
    return process.returncode, "".join(lines), time.monotonic() - sent


def _stopped_step(out: Path) -> int:
    (step, _), *_ = reversed(list_checkpoints(out / "stopped"))
    return step


def _train(run, blocks) -> dict:
    """`run` through the launcher, as the training node runs it."""
    return run_training(
        run,
        plan_for(run, blocks),
        train_files=arrow_files(blocks["train"]),
        validation_files=[],
        tokenizer=None,
    )


def _give_up(*_):
    raise TimeoutError("a stopped run did not end")


@pytest.mark.slow
@pytest.mark.long
def test_stop_signals_checkpoint_and_resume_bitwise(tiny_blocks, tmp_path: Path):
    blocks = tmp_path / "blocks"
    tiny_blocks.save_to_disk(str(blocks))
    previous = signal.signal(signal.SIGALRM, _give_up)
    signal.alarm(400)
    try:
        # SIGUSR1 to the launcher: it forwards it to every worker.
        code, output, seconds = _run_until_signalled(
            blocks, tmp_path / "usr1", lambda p: p.send_signal(signal.SIGUSR1)
        )
        assert code == 3, output[-3000:]
        stopped = _stopped_step(tmp_path / "usr1")
        stop_line = next(line for line in output.splitlines() if line.startswith("STOPPED: "))
        assert "training stopped by SIGUSR1" in stop_line
        assert f"checkpoint-{stopped}" in stop_line and "resume_from=latest" in stop_line
        assert stopped >= STEPS // 20 and seconds < 60
        # SIGTERM to one worker only: the ranks agree on it at the end of the step.
        code, output, seconds = _run_until_signalled(
            blocks,
            tmp_path / "term",
            lambda p: os.kill(max(worker_processes(p.pid)), signal.SIGTERM),
        )
        assert code == 3, output[-3000:]
        assert "STOPPED: training stopped by SIGTERM" in output and seconds < 60
        assert _stopped_step(tmp_path / "term") >= STEPS // 20
        # SIGUSR1 to the whole process group, as SLURM signals every process of a step:
        # the launcher, every rank and the warm-rank server (`launch.warm`), which holds it.
        code, output, seconds = _run_until_signalled(
            blocks, tmp_path / "group", lambda p: os.killpg(p.pid, signal.SIGUSR1)
        )
        assert code == 3, output[-3000:]
        assert "STOPPED: training stopped by SIGUSR1" in output and seconds < 60
        assert _stopped_step(tmp_path / "group") >= STEPS // 20
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

    # Resuming the SIGUSR1 run's checkpoint is bitwise the run that was never stopped.
    end = stopped + 2
    straight = stop_run_config(tmp_path / "again", end, run_name="straight")
    resumed = stop_run_config(
        tmp_path / "usr1", end, resume_from=str(tmp_path / "usr1" / "stopped")
    )
    specs = [spec_for(run, tiny_blocks) for run in (straight, resumed)]
    first, second = run_group(specs, 2, tmp_path, "t-stops")
    assert second["losses"] == first["losses"][stopped:]
    for name, summary in (("straight", first), ("resumed", second)):
        consolidate_checkpoint(summary["final_checkpoint"], tmp_path / name, progress=False)
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_diverging_run_stops_before_a_non_finite_update(tiny_blocks, tmp_path: Path):
    run = stop_run_config(
        tmp_path, 60, learning_rate=1e4, max_grad_norm=0.0, checkpoint_every=2, keep_last=2
    )
    with pytest.raises(Refused) as caught:
        _train(run, tiny_blocks)
    message = str(caught.value)
    assert "NonFiniteError: step " in message and "stopped before the optimizer" in message
    assert "Traceback" not in message
    failed_step = int(message.split("NonFiniteError: step ")[1].split(":")[0])
    kept = list_checkpoints(tmp_path / "stopped")
    assert kept and all(step < failed_step for step, _ in kept)
    for _, checkpoint in kept:
        for path in checkpoint.rglob("*.safetensors"):
            for name, tensor in load_file(path).items():
                assert torch.isfinite(tensor).all(), f"{path} {name}"


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MB tmpfs: room for two checkpoints of the tiny model, not three."""
    with mounted_tmpfs(tmp_path / "disk", "4m") as disk:
        yield disk


@pytest.mark.slow
def test_a_full_disk_refuses_the_checkpoint_and_keeps_the_last_one(tiny_blocks, small_disk):
    run = stop_run_config(small_disk, 20, checkpoint_every=2)
    with pytest.raises(Refused) as caught:
        _train(run, tiny_blocks)
    message = str(caught.value)
    assert "CheckpointSpaceError: not enough room for checkpoint-" in message, message
    assert "MB free" in message and "Traceback" not in message
    run_dir = small_disk / "stopped"
    kept = list_checkpoints(run_dir)
    assert kept, "the checkpoints that fitted are gone"
    step, latest = kept[-1]
    assert f"{latest.name} is untouched and still the latest" in message
    read_manifest(latest, verify=True)  # every file as written
    assert find_resume_checkpoint(small_disk, "latest", "stopped") == latest
    # The refused checkpoint left no folder at all.
    assert not (run_dir / f"checkpoint-{step + 2}").exists()


def test_a_write_that_runs_out_of_room_names_the_file_and_the_free_space(small_disk):
    """The check before writing cannot see other writers: a write that still fails for
    room is named, with what is kept, instead of a bare OSError."""
    (small_disk / "run" / "checkpoint-2").mkdir(parents=True)
    target = small_disk / "run" / "checkpoint-2" / "weights.safetensors"
    with (
        pytest.raises(CheckpointSpaceError) as caught,
        named_write_errors(small_disk / "run", target.parent),
    ):
        save_safetensors({"weights": torch.zeros(2_000_000)}, target)  # 8 MB on 4 MB
    message = str(caught.value)
    assert message.startswith(f"could not write {target}: No space left on device")
    assert "MB free there" in message and "no marker: `latest` never takes it" in message
    assert "the run has no earlier complete checkpoint" in message
