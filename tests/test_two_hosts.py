"""Two hosts for real: each node in its own network namespace, with its own address on a
veth link and a decoy interface beside it (tests/netns.py), as on two machines.

The host name resolves to 127.0.0.1 in both (as on these machines, and as Debian maps
it to 127.0.1.1 by default): what a launcher advertised by name would send the other
host to its own loopback. meshtrain chooses the interface and the address itself
(`launch.network`); these tests hold it to that.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshtrain.checkpoint import consolidate_checkpoint
from meshtrain.config import ConfigError, LaunchConfig
from meshtrain.launch.network import node_address
from meshtrain.launch.rendezvous import free_port
from tests.conftest import TINY_MODEL
from tests.distributed.reference import assert_matches_reference, reference_run
from tests.netns import Host, processes_in, require_namespaces, two_hosts
from tests.test_multinode import LAYOUT, RDZV_ID, end, start_node, wait, workers_of


@pytest.fixture
def hosts():
    require_namespaces()
    with two_hosts() as pair:
        yield pair


def _start(tmp: Path, blocks, hosts: tuple[Host, Host], training: dict, nproc: int, **launch):
    """Node 1 first (c10d alone would then make it node 0), on host b; node 0 on host a,
    where the rendezvous endpoint is."""
    endpoint = f"{hosts[0].address}:{free_port()}"
    return [
        start_node(n, tmp, blocks, endpoint, training, nproc, hosts[n].command(), launch)
        for n in (1, 0)
    ][::-1]


@pytest.mark.slow
def test_two_hosts_on_a_veth_link_train_as_one_process(tiny_blocks, hosts, tmp_path: Path):
    assert socket.gethostbyname(socket.gethostname()).startswith("127."), "the trap is set"
    nodes = _start(tmp_path, tiny_blocks, hosts, {}, nproc=2)
    try:
        codes = [wait(p, 240, tmp_path / f"node{i}.log") for i, p in enumerate(nodes)]
    finally:
        end(nodes)
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    for node, code in enumerate(codes):
        assert code == 0, logs[node][-3000:]

    # Each launcher chose its link, not the decoy, and said so.
    for n, host in enumerate(hosts):
        assert (
            f"node {n}: network interface {host.interface} ({host.address}), chosen by the "
            f"route to launch.rdzv_endpoint's {hosts[0].address}"
        ) in logs[n], logs[n][-3000:]

    summaries = [json.loads((tmp_path / f"summary-node{n}.json").read_text()) for n in (0, 1)]
    # Both nodes report the run: the same folder, named from rdzv_id, and rank 0's summary.
    assert summaries[0] == summaries[1]
    assert summaries[0]["run_name"] == f"{LAYOUT}-{RDZV_ID}"
    run_dir = tmp_path / "checkpoints" / f"{LAYOUT}-{RDZV_ID}"
    assert Path(summaries[0]["run_dir"]) == run_dir.resolve()

    # Every rank's gloo connections went over the link: to the other host's address
    # (and its own host's, for the ranks beside it), never to loopback.
    for n, host in enumerate(hosts):
        other = hosts[1 - n].address
        for log in (run_dir / "logs" / f"node{n}").glob("*/*/*/stdout.log"):
            found = re.search(r"gloo on interface (\S+), TCP connections to (.*)", log.read_text())
            assert found, log
            assert found.group(1) == host.interface
            assert other in found.group(2) and "127.0.0.1" not in found.group(2), found.group(0)

    # launch.node_rank decided the ranks: rank 0 (the only one that prints) ran on node 0.
    rank0_log = "\n".join(p.read_text() for p in (run_dir / "logs/node0").glob("*/*/0/stdout.log"))
    assert f"training {LAYOUT}" in rank0_log
    assert not any("training dp2" in p.read_text() for p in (run_dir / "logs/node1").rglob("*.log"))

    # All four ranks, two per host, wrote into the one shared folder (with ZeRO-1 each
    # rank owns a slice of the optimizer state; host b's ranks 2 and 3 are dp rank 1).
    final = Path(summaries[0]["final_checkpoint"])
    assert sorted(p.name for p in (final / "rng").iterdir()) == [
        f"rank_{r:05d}.safetensors" for r in range(4)
    ]
    assert len(list((final / "optimizer").iterdir())) == 4

    expected_losses, expected_weights = reference_run(tiny_blocks, "llama", TINY_MODEL)
    assert_matches_reference(
        "two-hosts-dp2-tp2", summaries[0], expected_losses, expected_weights, tmp_path / "hf"
    )


def _run_to_end(tmp: Path, blocks, hosts, training: dict, launch: dict) -> dict:
    nodes = _start(tmp, blocks, hosts, training, nproc=1, **launch)
    try:
        codes = [wait(p, 180, tmp / f"node{n}.log") for n, p in enumerate(nodes)]
    finally:
        end(nodes)
    assert codes == [0, 0], (tmp / "node0.log").read_text()[-3000:]
    return json.loads((tmp / "summary-node0.json").read_text())


def _weights(summary: dict, folder: Path) -> dict[str, torch.Tensor]:
    consolidate_checkpoint(summary["final_checkpoint"], folder, progress=False)
    return load_file(folder / "model.safetensors")


@pytest.mark.slow
@pytest.mark.long
def test_a_link_that_fails_mid_run_ends_the_job_naming_the_node(tiny_blocks, hosts, tmp_path: Path):
    """Host b's link goes down after the first checkpoint: node 0 ends within the
    collective timeout plus a few seconds naming node 1; node 1's rank ends at its own
    timeout, and its launcher as soon as the link returns; the job then resumes from
    the last complete checkpoint to the uninterrupted run's weights, bitwise."""
    timeout_s = 10
    training = {"max_steps": 40, "checkpoint_every": 10, "eval_every": 1000, "keep_last": 0}
    launch = {"collective_timeout_s": timeout_s, "shutdown_grace_s": 5}
    (tmp_path / "cut").mkdir()
    nodes = _start(tmp_path / "cut", tiny_blocks, hosts, training, nproc=1, **launch)
    run_dir = tmp_path / "cut" / "checkpoints" / f"dp2-tp1-pp1-{RDZV_ID}"
    logs = [tmp_path / "cut" / f"node{n}.log" for n in (0, 1)]
    try:
        deadline = time.monotonic() + 180
        while not list(run_dir.glob("checkpoint-*/COMPLETE")):
            assert all(p.poll() is None for p in nodes), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.05)
        hosts[1].link(up=False)
        cut_at = time.monotonic()
        code0 = wait(nodes[0], timeout_s + 60, logs[0])
        took = time.monotonic() - cut_at
        # Node 1's rank gave up at its own collective timeout: only its launcher is left,
        # waiting on the store across the dead link.
        _wait_until(lambda: workers_of(nodes[1].pid) == [], timeout_s + 20)
        # Node 0's ranks and warm-rank server end with its launcher, each as it sees the
        # launcher gone (a watch on its pid, the server's pipe): moments apart, not at once.
        _wait_until(lambda: processes_in(hosts[0].namespace) == [], 10)
        hosts[1].link(up=True)
        up_at = time.monotonic()
        code1 = wait(nodes[1], 60, logs[1])
        took_after_link = time.monotonic() - up_at
    finally:
        end(nodes)
    assert code0 != 0 and code1 != 0
    assert took < timeout_s + 10, f"node 0 took {took:.0f} s"
    assert took_after_link < 15, f"node 1 took {took_after_link:.0f} s after the link"
    # Node 1's warm-rank server ends as it sees its launcher gone, moments after it.
    _wait_until(lambda: processes_in(hosts[1].namespace) == [], 10)
    assert processes_in(hosts[0].namespace) == []
    output = [log.read_text() for log in logs]
    assert "NodeLostError" in output[0] and "node 1 (rank 1), last heard" in output[0]
    assert "stopped answering" in output[0], output[0][-3000:]
    assert "this node (launch.node_rank=1, rank 1) lost the rendezvous store" in output[1]
    print(f"node 0 ended {took:.1f} s after the cut; node 1 {took_after_link:.1f} s after the link")

    (tmp_path / "resumed").mkdir()
    shutil.copytree(run_dir.parent, tmp_path / "resumed" / "checkpoints")
    resumed = _run_to_end(
        tmp_path / "resumed", tiny_blocks, hosts, {**training, "resume_from": "latest"}, launch
    )
    (tmp_path / "straight").mkdir()
    straight = _run_to_end(tmp_path / "straight", tiny_blocks, hosts, training, launch)
    a = _weights(straight, tmp_path / "straight" / "hf")
    b = _weights(resumed, tmp_path / "resumed" / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["losses"][-1] == straight["losses"][-1]


def _wait_until(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_a_network_interface_that_does_not_exist_is_refused_with_those_that_do():
    launch = LaunchConfig(
        nnodes=2, node_rank=1, rdzv_endpoint="10.1.2.3:29500", network_interface="nope0"
    )
    with pytest.raises(ConfigError) as caught:
        node_address(launch)
    assert "`launch.network_interface=nope0` names no network interface" in str(caught.value)
    assert "it has: lo (127.0.0.1" in str(caught.value)


def _in_host(host: Host, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        host.command(sys.executable, "-c", code),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )


_CHECK = """
import time
from meshtrain.config import ConfigError, LaunchConfig
from meshtrain.launch.network import check_reachable, node_address
launch = LaunchConfig(nnodes=2, node_rank=1, rdzv_endpoint="{endpoint}")
start = time.monotonic()
try:
    check_reachable(launch, node_address(launch), timeout_s=4)
    print("reached")
except ConfigError as error:
    print(error)
print(f"after {{time.monotonic() - start:.1f}} s")
"""


def test_unreachable_endpoints_are_refused_within_the_bound_naming_them(hosts):
    """From host b: an address on no route, and one on the link that nobody holds, are
    refused; node 0's address with its store not yet open is waited for, as torchrun does."""
    a, b = hosts
    no_route = _in_host(b, _CHECK.format(endpoint="10.99.0.1:29500"))
    assert "launch.rdzv_endpoint=10.99.0.1:29500`: this host has no route" in no_route.stdout, (
        no_route.stdout + no_route.stderr
    )
    silent = _in_host(b, _CHECK.format(endpoint="10.77.0.5:29500"))
    assert "`launch.rdzv_endpoint=10.77.0.5:29500` did not answer this node" in silent.stdout
    assert f"from 10.77.0.2 on {b.interface}) within 4 s" in silent.stdout, silent.stdout
    seconds = float(silent.stdout.split("after ")[-1].split()[0])
    assert 4 <= seconds < 10, silent.stdout
    not_yet = _in_host(b, _CHECK.format(endpoint=f"{a.address}:{free_port()}"))
    assert "reached" in not_yet.stdout, not_yet.stdout + not_yet.stderr
