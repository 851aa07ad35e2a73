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
import socket
from pathlib import Path

import pytest

from meshtrain.launch.rendezvous import free_port
from tests.conftest import TINY_MODEL
from tests.distributed.reference import assert_matches_reference, reference_run
from tests.netns import Host, require_namespaces, two_hosts
from tests.test_multinode import LAYOUT, RDZV_ID, end, start_node, wait


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
