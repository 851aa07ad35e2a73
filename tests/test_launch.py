"""A failing rank fails the launch with its own error; nothing hangs or stays behind.
Rendezvous settings for several nodes are read as torchrun reads them, and node ranks
that cannot all be right are refused before any worker starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from meshtrain.config import LaunchConfig, split_endpoint
from meshtrain.launch.elastic import StuckRankError, WorkerFailedError, run_workers
from meshtrain.launch.network import is_loopback
from meshtrain.launch.rendezvous import free_port
from tests.conftest import worker_processes


@record
def fail_on_rank_one(message: str) -> int:
    """Rank 1 raises; rank 0 waits in a collective that can never complete."""
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    if dist.get_rank() == 1:
        raise RuntimeError(message)
    dist.barrier()
    return 0


@record
def all_reduce_forever(pid_file: str, timeout_s: float) -> int:
    """Rank 1 writes its pid (for the test to SIGSTOP it); both all-reduce until it fails."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    if dist.get_rank() == 1:
        Path(pid_file).write_text(str(os.getpid()))
    value = torch.ones(4)
    while True:
        dist.all_reduce(value)
        time.sleep(0.01)


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
    while worker_processes(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker_processes(os.getpid()) == []


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("node001:29500", ("node001", 29500)),
        ("node001", ("node001", 29400)),  # c10d's default port, as torchrun
        ("10.0.0.7:1234", ("10.0.0.7", 1234)),
        ("[fe80::1]:29500", ("fe80::1", 29500)),
        ("::1", ("::1", 29400)),
    ],
)
def test_rendezvous_endpoints_are_read_as_torchrun_reads_them(endpoint, expected):
    assert split_endpoint(endpoint) == expected


def test_loopback_endpoints_mean_every_node_on_this_machine():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("node001") and not is_loopback("10.0.0.7")


def _launcher(node_rank: int, nnodes: int, endpoint: str, log_dir: Path) -> subprocess.Popen:
    """A launcher process of its own, as on another node; its workers would only fail."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from meshtrain.config import LaunchConfig\n"
        "from meshtrain.launch.elastic import run_workers\n"
        "from tests.test_launch import fail_on_rank_one\n"
        "launch = LaunchConfig(nproc_per_node=1, nnodes=int(sys.argv[2]),"
        " node_rank=int(sys.argv[1]), rdzv_endpoint=sys.argv[3], rdzv_id='dup')\n"
        "run_workers(fail_on_rank_one, ('never',), launch, log_dir=Path(sys.argv[4]),"
        " run_id='dup')\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, str(node_rank), str(nnodes), endpoint, str(log_dir)],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_two_launchers_with_one_node_rank_are_refused_on_every_node(tmp_path: Path):
    """Two launchers claiming one node rank is a copied command line: c10d alone would
    ignore launch.node_rank and number them anyway. Refused on every node, before any
    worker starts."""
    endpoint = f"127.0.0.1:{free_port()}"
    launchers = [_launcher(r, 3, endpoint, tmp_path / f"node{i}") for i, r in enumerate((0, 1, 1))]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in launchers]
    finally:
        for process in launchers:
            process.kill()
    for process, output in zip(launchers, outputs, strict=True):
        assert process.returncode != 0
        assert "launch.node_rank values [0, 1, 1]" in output, output[-2000:]
    assert not list(tmp_path.rglob("error.json"))  # no worker ever started


@pytest.mark.slow
def test_a_stopped_rank_fails_the_job_within_the_timeout_naming_it(tmp_path: Path):
    """SIGSTOP one worker: its peer times out in a collective after
    launch.collective_timeout_s, the job fails naming the stopped rank (not the one
    that timed out), and no process stays behind."""
    pid_file = tmp_path / "rank1.pid"

    def stop_rank_one() -> None:
        while not pid_file.is_file() or not pid_file.read_text():
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(int(pid_file.read_text()), signal.SIGSTOP)

    stopper = threading.Thread(target=stop_rank_one, daemon=True)
    stopper.start()
    launch = LaunchConfig(nproc_per_node=2, collective_timeout_s=5, shutdown_grace_s=5)
    started = time.monotonic()
    with pytest.raises(StuckRankError) as caught:
        run_workers(
            all_reduce_forever,
            (str(pid_file), launch.collective_timeout_s),
            launch,
            log_dir=tmp_path / "logs",
            run_id="stuck-test",
        )
    assert caught.value.rank == 1
    assert str(caught.value).startswith("training worker rank 1 failed: rank 1 made no progress")
    assert "launch.collective_timeout_s=5 s" in str(caught.value)
    assert time.monotonic() - started < 90
    deadline = time.monotonic() + 15
    while worker_processes(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker_processes(os.getpid()) == []
