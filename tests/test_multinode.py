"""Two nodes on one machine: two separate launcher processes meet at a c10d rendezvous on
loopback, as two `kedro run --params launch.nnodes=2,launch.node_rank=N,...` would.

Each launcher is a real `python` process calling the engine's `run_training` (what the
training node calls) with its own `launch.node_rank`; 2 workers each, dp=2 x tp=2 over
gloo. Node 1 is started first, so c10d alone (which numbers nodes by host name and pid)
would make it node 0: the run checks that `launch.node_rank` decides instead.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import pytest

from meshtrain.config import ConfigError, LaunchConfig, RunConfig, check_launch
from meshtrain.data.blocks import arrow_files
from meshtrain.launch.job import make_worker_spec, run_training
from meshtrain.launch.rendezvous import free_port
from meshtrain.models import build_model_config
from meshtrain.planner import Plan, plan_run
from tests.conftest import TINY_BLOCK, TINY_MODEL, TINY_VOCAB, is_alive, worker_processes
from tests.distributed.reference import TRAINING

REPO = Path(__file__).resolve().parents[1]
RDZV_ID = "job42"
LAYOUT = "dp2-tp2-pp1-zero1-sp"  # the planner's name for PARALLEL
PARALLEL = {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_1": True}
# per-device batch 2 x accumulation 2 x dp 2 = the reference's global batch of 8
PER_NODE_TRAINING = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}


def _multinode_run(
    blocks: datasets.DatasetDict,
    node_rank: int,
    endpoint: str,
    training: dict[str, Any],
    nproc_per_node: int = 2,
    launch: dict[str, Any] | None = None,
) -> tuple[RunConfig, Plan]:
    """One node's view of the job: its run configuration and plan (dp2 x tp2 on 2 x 2
    ranks, plain dp2 on 2 x 1)."""
    one = nproc_per_node == 1
    run = RunConfig.from_params(
        parallel={"data_parallel_size": 2} if one else PARALLEL,
        training={**TRAINING, **({} if one else PER_NODE_TRAINING), **training},
        launch={
            "nproc_per_node": nproc_per_node,
            "nnodes": 2,
            "node_rank": node_rank,
            "rdzv_endpoint": endpoint,
            "rdzv_id": RDZV_ID,
            **(launch or {}),
        },
        model={"architecture": "llama", "config": TINY_MODEL},
        data={"block_size": TINY_BLOCK},
    )
    plan = plan_run(
        run,
        build_model_config("llama", TINY_MODEL, vocab_size=TINY_VOCAB),
        num_train_blocks=len(blocks["train"]),
        num_validation_blocks=len(blocks["validation"]),
        cuda_available=False,
    )
    return run, plan


def run_node(arguments: str) -> None:
    """One node's launcher (run in a child process): plan, then `run_training`; write the
    summary it returns to `out` as JSON. Its warm-rank server is a fork of it, made once
    it holds what a server imports (`launch.warm.fork_server`), before anything else."""
    args = json.loads(arguments)
    if args["launch"].get("warm_ranks", True):
        _fork_warm_rank_server()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    blocks = datasets.load_from_disk(args["blocks"])
    run, plan = _multinode_run(
        blocks,
        args["node_rank"],
        args["endpoint"],
        args["training"],
        args["nproc_per_node"],
        args["launch"],
    )
    summary = run_training(
        run,
        plan,
        train_files=arrow_files(blocks["train"]),
        validation_files=arrow_files(blocks["validation"]),
        tokenizer=None,
    )
    Path(args["out"]).write_text(json.dumps(summary))


def _fork_warm_rank_server() -> None:
    from meshtrain.launch import warm  # noqa: PLC0415

    if warm.forkable():
        warm.fork_server()


def start_node(
    node_rank: int,
    tmp: Path,
    blocks: datasets.DatasetDict,
    endpoint: str,
    training: dict,
    nproc_per_node: int,
    host: list[str] | None = None,
    launch: dict[str, Any] | None = None,
) -> subprocess.Popen:
    """One node's launcher in a child process (inside `host`, a command prefix such as
    `ip netns exec NS`), its output in `tmp/node<N>.log`."""
    arguments = {
        "node_rank": node_rank,
        "nproc_per_node": nproc_per_node,
        "endpoint": endpoint,
        "launch": launch or {},
        "blocks": str(Path(blocks["train"].cache_files[0]["filename"]).parents[1]),
        "training": {"output_dir": str(tmp / "checkpoints"), **training},
        "out": str(tmp / f"summary-node{node_rank}.json"),
    }
    output = open(tmp / f"node{node_rank}.log", "w")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(
        [
            *(host or []),
            sys.executable,
            "-c",
            "import sys; from tests.test_multinode import run_node; run_node(sys.argv[1])",
            json.dumps(arguments),
        ],
        cwd=REPO,
        stdout=output,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a stray group is easy to find and end
    )


def _start_two_nodes(
    tmp: Path, blocks, training: dict, nproc_per_node: int = 2
) -> list[subprocess.Popen]:
    endpoint = f"127.0.0.1:{free_port()}"
    node1 = start_node(1, tmp, blocks, endpoint, training, nproc_per_node)
    time.sleep(0.5)  # node 1 gets the smaller pid: c10d's own order would make it node 0
    node0 = start_node(0, tmp, blocks, endpoint, training, nproc_per_node)
    return [node0, node1]


def end(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait(process: subprocess.Popen, seconds: float, log: Path) -> int:
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node did not finish within {seconds} s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_a_killed_node_fails_the_other_node_without_hanging(tiny_blocks, tmp_path: Path):
    # Long enough that node 1 is killed mid-training; progress is printed every 20 steps.
    training = {"max_steps": 400, "checkpoint_every": 400, "eval_every": 400}
    # One worker per node is enough to lose a peer, and starts two fewer processes.
    nodes = _start_two_nodes(tmp_path, tiny_blocks, training, nproc_per_node=1)
    node0, node1 = nodes
    log0 = tmp_path / "node0.log"
    try:
        deadline = time.monotonic() + 180
        while not re.search(r"\[rank0\] step [1-9]\d*/", log0.read_text()):
            assert node0.poll() is None and node1.poll() is None, log0.read_text()[-3000:]
            assert time.monotonic() < deadline, "training did not start:\n" + log0.read_text()
            time.sleep(0.2)
        workers = [pid for node in nodes for pid in workers_of(node.pid)]
        assert len(workers) == 2

        node1.kill()  # SIGKILL of node 1's launcher only: its workers are not told
        killed_at = time.monotonic()
        code = wait(node0, 90, log0)
        took = time.monotonic() - killed_at
        output = log0.read_text()
        assert code != 0
        assert "WorkerFailedError" in output
        assert "most likely on another node" in output, output[-3000:]
        assert took < 60, f"node 0 took {took:.0f} s to give up"

        # No worker of either node is left (node 1's were orphaned by the kill).
        deadline = time.monotonic() + 20
        while [pid for pid in workers if is_alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in workers if is_alive(pid)] == []
    finally:
        end(nodes)
    print(f"node 0 failed {took:.1f} s after node 1's launcher was killed")


def workers_of(pid: int) -> list[int]:
    return worker_processes(pid)


LAUNCH_REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "node rank out of range": ({"nnodes": 2, "node_rank": 2}, "launch.node_rank=2"),
    "negative node rank": ({"nnodes": 2, "node_rank": -1}, "launch.node_rank=-1"),
    "no endpoint": ({"nnodes": 2, "node_rank": 1}, "launch.rdzv_endpoint=HOST:PORT"),
    "bad port": ({"nnodes": 2, "rdzv_endpoint": "node001:http"}, "port must be a number"),
    "empty rdzv_id": ({"nnodes": 2, "rdzv_endpoint": "node001:29500", "rdzv_id": " "}, "rdzv_id"),
    "node rank on one node": ({"node_rank": 1}, "launch.node_rank=1"),
}


@pytest.mark.parametrize("name", LAUNCH_REFUSALS)
def test_impossible_launches_are_refused_before_anything_starts(name: str):
    values, expected = LAUNCH_REFUSALS[name]
    with pytest.raises(ConfigError) as caught:
        check_launch(LaunchConfig(**values))
    assert expected in str(caught.value)


def test_a_multinode_run_folder_of_an_earlier_job_is_refused(tiny_blocks, tmp_path: Path):
    """Without a timestamp in the name, a reused rdzv_id would mix two jobs' checkpoints."""
    run, plan = _multinode_run(tiny_blocks, 1, "node001:29500", {"output_dir": str(tmp_path)})
    files = {"train_files": arrow_files(tiny_blocks["train"]), "validation_files": []}
    spec = make_worker_spec(run, plan, **files, tokenizer_dir=None)
    assert Path(spec.run_dir) == (tmp_path / f"{LAYOUT}-{RDZV_ID}").resolve()
    (Path(spec.run_dir) / "checkpoint-6").mkdir()
    with pytest.raises(ConfigError, match=f"launch.rdzv_id={RDZV_ID}.*resume_from=latest"):
        make_worker_spec(run, plan, **files, tokenizer_dir=None)
