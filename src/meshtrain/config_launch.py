"""`launch.*`: process start-up with torchrun's meanings, and the refusal of a launch
that cannot rendezvous (asked only where this host starts workers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshtrain.config_parsing import ConfigError, out_of_range
from meshtrain.config_ranges import LAUNCH_RANGES

AUTO = "auto"
# c10d's own default port, used when launch.rdzv_endpoint names no port (as torchrun does).
DEFAULT_RDZV_PORT = 29400


@dataclass(frozen=True)
class LaunchConfig:
    """Process start-up (`launch.*`), with torchrun's meanings."""

    nproc_per_node: int = 2
    nnodes: int = 1
    node_rank: int = 0
    backend: Literal["auto", "gloo", "nccl", "neuron"] = AUTO
    rdzv_endpoint: str | None = None
    rdzv_id: str = "meshtrain"
    # Several hosts: the interface the nodes reach each other on (e.g. eth1, ib0); null:
    # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME where set, else the route to rdzv_endpoint.
    network_interface: str | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.5
    # On SIGTERM / SIGUSR1 (preemption, a SLURM time limit) the workers finish the step
    # and write a checkpoint; after this many seconds the launcher kills them anyway.
    shutdown_grace_s: float = 120.0
    # How long a collective waits for a rank that makes no progress before the job fails.
    collective_timeout_s: float = 600.0
    # Ranks forked from a server that imported torch and the engine once (`launch/warm.py`);
    # false: each rank is spawned and imports them itself.
    warm_ranks: bool = True

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


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


def check_launch(launch: LaunchConfig) -> None:
    """Refuse a launch that cannot rendezvous, naming every problem, before anything starts
    (`launch.job.run_training` asks first; planning for another cluster does not need it).

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
    problems += out_of_range(launch, LAUNCH_RANGES)
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
