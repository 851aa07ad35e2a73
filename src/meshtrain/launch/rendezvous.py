"""The rendezvous of several nodes: c10d's, with the nodes numbered by `launch.node_rank`.

Node 0 hosts the rendezvous store at `launch.rdzv_endpoint`, and node n holds
global ranks `n * nproc_per_node ... (n + 1) * nproc_per_node - 1` (torchrun's
`--node-rank` meaning; plain c10d would order nodes by host name and pid), so
tensor-parallel groups stay inside a node and rank 0, which logs and writes
manifests, is on node 0.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler as create_dynamic_handler,
)

# How long one operation on the rendezvous store may take before it counts as lost (c10d
# uses 60 s). The agents poll the store every monitor interval, so this bounds how long a
# node whose link failed keeps its ranks waiting before it gives up.
STORE_TIMEOUT_S = 15
# Each launcher bumps its node's counter in the store this often; a node whose counter
# has not moved for SILENT_AFTER_S has stopped answering.
HEARTBEAT_S = 2.0
SILENT_AFTER_S = 3 * HEARTBEAT_S


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

    def __init__(
        self, inner: RendezvousHandler, node_rank: int, liveness: NodeLiveness | None
    ) -> None:
        self._inner = inner
        self._node_rank = node_rank
        self._liveness = liveness

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
        if self._liveness is not None:
            self._liveness.start(store, self._node_rank, nodes)
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


class NodeLiveness:
    """Which nodes of the job still answer: every launcher bumps its node's counter in the
    rendezvous store every HEARTBEAT_S and reads everyone's, so that when ranks time out
    in a collective the launcher can name the node that went silent (a failed link, a
    frozen machine), or say that it is itself cut off from the store."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._changed: dict[int, tuple[int, float]] = {}  # node: (counter, when it moved)
        self._store_seen = time.monotonic()
        self._thread: threading.Thread | None = None

    def start(self, store: dist.Store, node_rank: int, nodes: int) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._beat, args=(store, node_rank, nodes), daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def _beat(self, store: dist.Store, node_rank: int, nodes: int) -> None:
        keys = [f"meshtrain/alive/{n}" for n in range(nodes)]
        while not self._stop.is_set():
            try:
                store.add(keys[node_rank], 1)
                counters = [store.add(key, 0) for key in keys]
            except (RuntimeError, TimeoutError, ValueError):
                counters = None
            now = time.monotonic()
            with self._lock:
                if counters is not None:
                    self._store_seen = now
                    for node, counter in enumerate(counters):
                        if self._changed.get(node, (None, 0.0))[0] != counter:
                            self._changed[node] = (counter, now)
            self._stop.wait(HEARTBEAT_S)

    def silent(self) -> dict[int, float] | None:
        """{node: seconds since it was last heard} for nodes silent longer than
        SILENT_AFTER_S; None when this node itself has lost the store that long."""
        now = time.monotonic()
        with self._lock:
            if now - self._store_seen > SILENT_AFTER_S:
                return None
            return {
                node: now - moved
                for node, (_, moved) in self._changed.items()
                if now - moved > SILENT_AFTER_S
            }


def _rendezvous_store(params: RendezvousParameters, is_host: bool) -> dist.TCPStore:
    """The store at the endpoint, hosted by node 0.

    One operation waits at most STORE_TIMEOUT_S, and so does a reconnection after one
    fails (the client reconnects with its constructor's timeout: built with the join
    timeout, a node whose link went down would wait that long on every call). Node 0
    may still start up to the join timeout after the others: they retry until then.
    """
    host, _, port = params.endpoint.rpartition(":")
    deadline = time.monotonic() + int(params.get_as_int("join_timeout", 600))
    while True:
        try:
            return dist.TCPStore(
                host.strip("[]"),
                int(port),
                is_master=is_host,
                multi_tenant=True,
                timeout=timedelta(seconds=STORE_TIMEOUT_S),
            )
        except (RuntimeError, TimeoutError) as error:  # DistNetworkError: not open yet
            if is_host or time.monotonic() > deadline:
                raise RendezvousConnectionError(
                    f"no rendezvous store answered at {params.endpoint}: {error}"
                ) from None


def _create_node_rank_handler(params: RendezvousParameters) -> RendezvousHandler:
    store = _rendezvous_store(params, bool(params.get_as_bool("is_host", False)))
    inner = create_dynamic_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    node_rank = int(params.get_as_int("node_rank", 0))
    return NodeRankRendezvous(inner, node_rank, params.config.get("liveness"))


rendezvous_handler_registry.register(NodeRankRendezvous.BACKEND, _create_node_rank_handler)
