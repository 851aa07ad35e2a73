"""Start one worker process per rank with torch elastic, and wait for all of them.

This is torchrun's machinery called as a function: c10d rendezvous (so the
same code spans several nodes), `spawn` start method, per-rank log files. A
rank that raises makes the launcher stop the other ranks and raise
`WorkerFailedError` with that rank's own error message, so nothing hangs and
no worker is left behind.

Several nodes: every node calls `run_workers` with the same `launch.nnodes`,
`launch.rdzv_endpoint` and `launch.rdzv_id` and its own `launch.node_rank`.
Node 0 hosts the rendezvous store at the endpoint, and node n holds global
ranks `n * nproc_per_node ... (n + 1) * nproc_per_node - 1` (torchrun's
`--node-rank` meaning; plain c10d would order nodes by host name and pid), so
tensor-parallel groups stay inside a node and rank 0, which logs and writes
manifests, is on node 0.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    create_backend as create_c10d_backend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler as create_dynamic_handler,
)
from torch.distributed.launcher.api import LaunchConfig as ElasticLaunchConfig
from torch.distributed.launcher.api import elastic_launch

from meshtrain.config import ConfigError, LaunchConfig

# c10d's own default port, used when launch.rdzv_endpoint names no port (as torchrun does).
DEFAULT_RDZV_PORT = 29400
# How long the launchers wait for every node to join: nodes of one job may start minutes
# apart (container pulls, a slow shared filesystem), but a missing node must not hang forever.
JOIN_TIMEOUT_S = 600


class WorkerFailedError(RuntimeError):
    """A worker rank failed; the message carries that rank's error."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(f"training worker rank {rank} failed: {message}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`, or a bare host meaning c10d's port 29400) -> (host, port)."""
    text = endpoint.strip()
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""  # a bare host name, or a bare IPv6 address
    if not port:
        return host, DEFAULT_RDZV_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"`launch.rdzv_endpoint` got {endpoint!r}: the port must be a number from 1 to "
            "65535, as in `node001:29500`."
        )
    return host, int(port)


def is_loopback(host: str) -> bool:
    """True for `localhost` and 127.x / ::1: every node of the job is on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_launch(launch: LaunchConfig) -> None:
    """Refuse a launch that cannot rendezvous, before anything starts, naming every problem.

    On several nodes a wrong value would otherwise surface as a rendezvous that
    waits ten minutes for a node that never comes, or as two nodes that both
    think they are node 1.
    """
    problems = []
    if not 0 <= launch.node_rank < launch.nnodes:
        problems.append(
            f"`launch.node_rank={launch.node_rank}` is outside 0 .. launch.nnodes - 1 = "
            f"{launch.nnodes - 1}: each node passes its own number, 0 on the node named by "
            "launch.rdzv_endpoint (on SLURM: launch.node_rank=$SLURM_NODEID)."
        )
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        problems.append(
            f"`launch.nnodes={launch.nnodes}` needs `launch.rdzv_endpoint=HOST:PORT`, the same "
            "on every node: HOST is node 0's host name or address (on SLURM the first of "
            "`scontrol show hostnames $SLURM_JOB_NODELIST`), PORT a free port there, e.g. 29500."
        )
    if launch.rdzv_endpoint:
        try:
            host, _ = split_endpoint(launch.rdzv_endpoint)
            if not host:
                problems.append(
                    f"`launch.rdzv_endpoint={launch.rdzv_endpoint}` names no host; "
                    "write HOST:PORT, e.g. node001:29500."
                )
        except ConfigError as error:
            problems.append(str(error))
    if launch.nnodes > 1 and not launch.rdzv_id.strip():
        problems.append(
            "`launch.rdzv_id` is empty: with several nodes it must be the same on every "
            "node and new for each job, e.g. launch.rdzv_id=$SLURM_JOB_ID."
        )
    if problems:
        raise ConfigError(
            "meshtrain refused the launch before starting any worker:\n  - "
            + "\n  - ".join(problems)
        )


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


def run_workers(
    entrypoint: Callable[..., Any],
    args: tuple[Any, ...],
    launch: LaunchConfig,
    *,
    log_dir: Path,
    run_id: str,
) -> dict[int, Any]:
    """Run `entrypoint(*args)` on `launch.world_size` ranks; returns {global rank: result}.

    `entrypoint` must be a module-level function (the spawn start method
    pickles it by name) decorated with `torch.distributed.elastic...record`
    so its exceptions reach the launcher.

    On one node the dict holds every rank. On several, each node gets its
    own ranks plus rank 0's result under key 0 (sent through the rendezvous
    store, so it must be JSON-able): every node can report the run.
    """
    check_launch(launch)
    log_dir.mkdir(parents=True, exist_ok=True)
    common = {
        "min_nodes": launch.nnodes,
        "max_nodes": launch.nnodes,
        "nproc_per_node": launch.nproc_per_node,
        "run_id": run_id,
        "max_restarts": launch.max_restarts,
        "monitor_interval": launch.monitor_interval,
        "start_method": "spawn",
        "logs_specs": DefaultLogsSpecs(log_dir=str(log_dir), tee=Std.ALL),
        "log_line_prefix_template": "[rank${rank}] ",
    }
    if launch.nnodes == 1:
        config = ElasticLaunchConfig(
            **common,
            rdzv_backend="c10d",
            rdzv_endpoint=launch.rdzv_endpoint or f"127.0.0.1:{free_port()}",
            rdzv_configs={"join_timeout": JOIN_TIMEOUT_S},
            local_addr="127.0.0.1",
        )
        try:
            return elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as error:
            rank, message = _root_failure(_all_failures(error))
            raise WorkerFailedError(rank, message) from None

    host, port = split_endpoint(launch.rdzv_endpoint or "")
    config = ElasticLaunchConfig(
        **common,
        rdzv_backend=NodeRankRendezvous.BACKEND,
        rdzv_endpoint=f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
        rdzv_configs={
            "join_timeout": JOIN_TIMEOUT_S,
            # Node 0 hosts the store. c10d would guess from the host name, and with every
            # node on 127.0.0.1 each launcher guesses "me".
            "is_host": launch.node_rank == 0,
            "node_rank": launch.node_rank,
        },
        # The address the other nodes reach this one at (its workers' MASTER_ADDR when
        # it holds rank 0): loopback when the whole job is on this machine, else the
        # host's fully qualified name, as torchrun does.
        local_addr="127.0.0.1" if is_loopback(host) else None,
    )
    try:
        returned = elastic_launch(config, _run_and_share)(entrypoint, args)
    except ChildFailedError as error:
        failures = _all_failures(error)
        rank, message = _root_failure(failures)
        if all(_is_peer_symptom(text) for _, text in failures.values()):
            message = (
                f"every rank on this node (launch.node_rank={launch.node_rank}) lost a peer, "
                "so the cause is most likely on another node: look at that node's launcher "
                f"output and its logs under {log_dir.parent}. This node's first error: {message}"
            )
        raise WorkerFailedError(rank, message) from None
    except RendezvousTimeoutError as error:
        raise RendezvousTimeoutError(
            f"not all launch.nnodes={launch.nnodes} nodes joined rendezvous '{run_id}' at "
            f"{launch.rdzv_endpoint} within {JOIN_TIMEOUT_S} s: start the training on every "
            "node with the same launch.nnodes, launch.rdzv_endpoint and launch.rdzv_id, and "
            f"a different launch.node_rank. ({error})"
        ) from None
    results = {rank: own for rank, (own, _) in returned.items()}
    for _, rank0 in returned.values():
        if rank0 is not None:
            results.setdefault(0, rank0)
    return results


@record
def _run_and_share(entrypoint: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, Any]:
    """Run the entrypoint on this rank; on other nodes' first ranks, also fetch rank 0's result.

    The agents' shared store (the workers' MASTER_ADDR:MASTER_PORT) outlives every
    worker of the job, because each agent waits at the exit barrier for all others.
    """
    result = entrypoint(*args)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return result, None  # the store went with rank 0's process group: nothing to share
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if rank != 0 and local_rank != 0:
        return result, None
    store = dist.PrefixStore(
        f"meshtrain/rank0_result/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
        dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(minutes=10),
        ),
    )
    if rank == 0:
        store.set("result", json.dumps(result))
        return result, None
    return result, json.loads(store.get("result").decode())


def _all_failures(error: ChildFailedError) -> dict[int, tuple[int, str]]:
    """{global rank: (timestamp, message)} for every rank that left an error.

    The agent stops the group at the first dead rank it sees, which is often
    not the one that raised first (that one may still be writing its error
    file); so the error files of the whole attempt are read, not just the
    failures the agent had collected.
    """
    found = {r: (f.timestamp, _failure_message(f)) for r, f in error.failures.items()}
    rank, failure = next(iter(error.failures.items()))
    if not failure.error_file:
        return found
    offset = rank - failure.local_rank
    for path in Path(failure.error_file).parent.parent.glob("*/error.json"):
        if not path.parent.name.isdigit() or offset + int(path.parent.name) in found:
            continue
        try:
            message = json.loads(path.read_text())["message"]
            timestamp = int(message["extraInfo"]["timestamp"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found[offset + int(path.parent.name)] = (timestamp, _message_text(message))
    return found


# What a rank reports when a *peer* died under it: a symptom, not the cause.
_PEER_SYMPTOMS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "Broken pipe",
    "communicator was aborted",
)


def _is_peer_symptom(message: str) -> bool:
    return any(symptom in message for symptom in _PEER_SYMPTOMS)


def _root_failure(failures: dict[int, tuple[int, str]]) -> tuple[int, str]:
    """The rank whose own error started it: any real error before a peer-died symptom.

    Timestamps alone mislead: error files carry whole seconds, so the rank that
    raised and the rank whose collective then broke often tie, and a rank
    killed outright has no error file and is only noticed later.
    """

    def key(item: tuple[int, tuple[int, str]]) -> tuple[bool, int, int]:
        rank, (timestamp, message) = item
        return _is_peer_symptom(message), timestamp, rank

    rank, (_, message) = min(failures.items(), key=key)
    return rank, message


def _failure_message(failure: Any) -> str:
    """The failing rank's exception text, from the error file `record` wrote."""
    message = _message_text(failure.message)
    if not message or message == "<N/A>":
        message = f"exit code {failure.exitcode} (see the rank's log under the run's logs/)"
    return message


def _message_text(message: Any) -> str:
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        return str(extra.get("py_callstack") or message.get("message") or json.dumps(message))
    return str(message)
