"""The rendezvous of several nodes: c10d's, with the nodes numbered by `launch.node_rank`.

Node 0 hosts the rendezvous store at `launch.rdzv_endpoint`, and node n holds
global ranks `n * nproc_per_node ... (n + 1) * nproc_per_node - 1` (torchrun's
`--node-rank` meaning; plain c10d would order nodes by host name and pid), so
tensor-parallel groups stay inside a node and rank 0, which logs and writes
manifests, is on node 0.
"""

from __future__ import annotations

import ipaddress
import socket

from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    create_backend as create_c10d_backend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler as create_dynamic_handler,
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_loopback(host: str) -> bool:
    """True for `localhost` and 127.x / ::1: every node of the job is on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class NodeRankRendezvous(RendezvousHandler):
    """c10d dynamic rendezvous whose node (group) ranks are the nodes' `launch.node_rank`.

    c10d numbers nodes by sorting (host name, pid), so on two machines node
    `b` may get rank 0 and on one machine the order is whichever launcher
    started first. After the c10d round completes, every node publishes its
    node rank in the round's store; the set must be 0 .. nnodes-1 exactly
    (two launchers with the same node rank are refused on every node), and
    the agent is then given the node's own rank. Everything else (the store,
    the workers' bootstrap address, keep-alives, shutdown) is c10d's.
    """

    BACKEND = "meshtrain-c10d"

    def __init__(self, inner: RendezvousHandler, node_rank: int) -> None:
        self._inner = inner
        self._node_rank = node_rank

    def get_backend(self) -> str:
        return self.BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        store, nodes = info.store, info.world_size
        store.set(f"meshtrain/node_rank/{info.rank}", str(self._node_rank))
        claimed = [int(store.get(f"meshtrain/node_rank/{rank}").decode()) for rank in range(nodes)]
        if sorted(claimed) != list(range(nodes)):
            raise RendezvousError(
                f"the {nodes} launchers that joined rendezvous '{self.get_run_id()}' have "
                f"launch.node_rank values {sorted(claimed)}; each node must pass a different "
                f"one of 0 .. {nodes - 1} (on SLURM: launch.node_rank=$SLURM_NODEID)."
            )
        return RendezvousInfo(store, self._node_rank, nodes, info.bootstrap_store_info)

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _create_node_rank_handler(params: RendezvousParameters) -> RendezvousHandler:
    backend, store = create_c10d_backend(params)
    inner = create_dynamic_handler(store, backend, params)
    return NodeRankRendezvous(inner, int(params.get_as_int("node_rank", 0)))


rendezvous_handler_registry.register(NodeRankRendezvous.BACKEND, _create_node_rank_handler)
