"""A failing rank fails the launch with its own error; nothing hangs or stays behind."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from meshtrain.config import LaunchConfig
from meshtrain.launch import WorkerFailedError, run_workers
from tests.conftest import child_processes


@record
def fail_on_rank_one(message: str) -> int:
    """Rank 1 raises; rank 0 waits in a collective that can never complete."""
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    if dist.get_rank() == 1:
        raise RuntimeError(message)
    dist.barrier()
    return 0


def _children_of(pid: int) -> list[tuple[int, str]]:
    # multiprocessing's resource tracker lives as long as the parent; it is no worker.
    return [(c, cmd) for c, cmd in child_processes(pid) if "resource_tracker" not in cmd]


@pytest.mark.slow
def test_a_crashing_rank_fails_the_launch_with_its_error(tmp_path: Path):
    def give_up(*_):
        raise TimeoutError("the launcher hung after a worker failed")

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(180)
    started = time.monotonic()
    try:
        with pytest.raises(WorkerFailedError) as caught:
            run_workers(
                fail_on_rank_one,
                ("disk full on rank one",),
                LaunchConfig(nproc_per_node=2),
                log_dir=tmp_path / "logs",
                run_id="crash-test",
            )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert caught.value.rank == 1
    assert "disk full on rank one" in str(caught.value)
    assert time.monotonic() - started < 120
    # Allow the OS a moment to finish reaping; a left-behind worker would stay.
    deadline = time.monotonic() + 15
    while _children_of(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _children_of(os.getpid()) == []
