"""Which network address and interface this node uses to reach the other nodes.

On one machine every node is on loopback. On several hosts three things must
agree: the address a launcher advertises for its workers' bootstrap store
(torch elastic's `local_addr`), the interface gloo and NCCL bind their
connections to, and the route to node 0. Left alone, torch elastic advertises
the host's name and gloo binds to whatever that name resolves to, and
Debian, Ubuntu and many container images map the host name to 127.0.0.1 or
127.0.1.1: the other hosts are then sent to their own loopback, and every
rank waits in silence until the collective timeout.

So meshtrain chooses the interface deliberately, once, on each node: the one
`launch.network_interface` names, else the one `GLOO_SOCKET_IFNAME` (or
`NCCL_SOCKET_IFNAME`) names, else the one the kernel routes to the
rendezvous host through. Its address is what the launcher advertises, and its
name goes to the workers as both `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME`.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil

from meshtrain.config import ConfigError, LaunchConfig, split_endpoint

# How long a node other than node 0 keeps trying to reach the rendezvous endpoint when
# its packets go unanswered (a wrong address, a firewall that drops, a link that is
# down). A refused connection is an answer: node 0 has not started yet, and the
# rendezvous waits for it as torchrun does.
REACH_TIMEOUT_S = 30.0
# One attempt's connect timeout within that bound.
_CONNECT_TIMEOUT_S = 5.0

# The variables that pick gloo's and NCCL's interface in the workers.
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class NodeAddress:
    """This node's interface and address for the job, and why they were chosen."""

    interface: str
    address: str
    chosen_by: str

    def describe(self, node_rank: int) -> str:
        return (
            f"node {node_rank}: network interface {self.interface} ({self.address}), "
            f"chosen by {self.chosen_by}"
        )


def is_loopback(host: str) -> bool:
    """True for `localhost` and 127.x / ::1: every node of the job is on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_addresses() -> dict[str, list[str]]:
    """{interface name: its IPv4 and global IPv6 addresses}, as the kernel lists them."""
    found: dict[str, list[str]] = {}
    for name, addresses in psutil.net_if_addrs().items():
        found[name] = [
            a.address.split("%")[0]
            for a in addresses
            if a.family == socket.AF_INET
            or (a.family == socket.AF_INET6 and not a.address.lower().startswith("fe80"))
        ]
    return found


def _listing(found: dict[str, list[str]]) -> str:
    return ", ".join(
        f"{name} ({', '.join(addresses) or 'no address'})" for name, addresses in found.items()
    )


def node_address(launch: LaunchConfig) -> NodeAddress | None:
    """This node's address for a job across hosts; None when every node is on this machine.

    Refuses, naming the parameter and this host's interfaces, an interface that
    does not exist or has no address, an endpoint host that does not resolve,
    and an endpoint this host has no route to.
    """
    if launch.nnodes == 1 or not launch.rdzv_endpoint:
        return None
    host, port = split_endpoint(launch.rdzv_endpoint)
    if is_loopback(host) and not launch.network_interface:
        return None
    found = interface_addresses()
    named, chosen_by = _named_interface(launch)
    if named is not None:
        if named not in found:
            raise ConfigError(
                f"`{chosen_by}={named}` names no network interface of this host; it has: "
                f"{_listing(found)}. Name the interface the nodes reach each other on."
            )
        if not found[named]:
            raise ConfigError(
                f"`{chosen_by}={named}`: that interface has no IP address; this host has: "
                f"{_listing(found)}."
            )
        return NodeAddress(named, found[named][0], chosen_by)
    address = _route_source(host, port, launch.rdzv_endpoint)
    for name, addresses in found.items():
        if address in addresses:
            return NodeAddress(name, address, f"the route to launch.rdzv_endpoint's {host}")
    raise ConfigError(
        f"this host reaches launch.rdzv_endpoint={launch.rdzv_endpoint} from {address}, "
        f"which no interface holds ({_listing(found)}): name one with "
        "launch.network_interface."
    )


def _named_interface(launch: LaunchConfig) -> tuple[str | None, str]:
    """The interface the user named: the parameter, else gloo's or NCCL's variable when it
    holds one plain name (lists, NCCL's prefix and exclusion forms pass on untouched)."""
    if launch.network_interface:
        return launch.network_interface, "launch.network_interface"
    for variable in IFNAME_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if value and not any(mark in value for mark in ",^="):
            return value, variable
    return None, ""


def _resolve(host: str, port: int, endpoint: str) -> tuple[int, tuple]:
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise ConfigError(
            f"`launch.rdzv_endpoint={endpoint}`: this host cannot resolve {host!r} "
            f"({error.strerror}); use node 0's address, or a name every node resolves."
        ) from None
    return family, sockaddr


def _route_source(host: str, port: int, endpoint: str) -> str:
    """The local address the kernel would send from to reach `host` (no packet is sent)."""
    family, sockaddr = _resolve(host, port, endpoint)
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(sockaddr)
        except OSError as error:
            raise ConfigError(
                f"`launch.rdzv_endpoint={endpoint}`: this host has no route to {host} "
                f"({error.strerror}); its interfaces: {_listing(interface_addresses())}."
            ) from None
        return probe.getsockname()[0]


def check_reachable(launch: LaunchConfig, node: NodeAddress, timeout_s: float) -> None:
    """On a node other than node 0, refuse an endpoint that gives no answer within
    `timeout_s`, naming it and the address this node tried from.

    A refused connection means node 0 is up but has not opened the store yet
    (or has not started): the rendezvous then waits, as torchrun's does.
    """
    if launch.node_rank == 0 or not launch.rdzv_endpoint:
        return
    host, port = split_endpoint(launch.rdzv_endpoint)
    family, sockaddr = _resolve(host, port, launch.rdzv_endpoint)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while (left := deadline - time.monotonic()) > 0:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.settimeout(min(_CONNECT_TIMEOUT_S, left))
            try:
                probe.bind((node.address, 0))
                probe.connect(sockaddr)
                return
            except ConnectionRefusedError:
                return
            except OSError as error:
                last = _why(error)
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    raise ConfigError(
        f"`launch.rdzv_endpoint={launch.rdzv_endpoint}` did not answer this node "
        f"(launch.node_rank={launch.node_rank}, from {node.address} on {node.interface}) "
        f"within {timeout_s:g} s: {last}. Check that it is node 0's address as this host "
        "reaches it, that the link is up, and that no firewall drops the port."
    )


def _why(error: OSError) -> str:
    if isinstance(error, TimeoutError) or error.errno == errno.ETIMEDOUT:
        return "every connection attempt timed out"
    return error.strerror or str(error)


@contextmanager
def worker_interface(node: NodeAddress | None) -> Iterator[None]:
    """Name the chosen interface to the workers (spawned with this process's environment)
    for the duration of the launch, without overriding a variable the user set."""
    if node is None:
        yield
        return
    added = [v for v in IFNAME_VARIABLES if not os.environ.get(v)]
    for variable in added:
        os.environ[variable] = node.interface
    try:
        yield
    finally:
        for variable in added:
            os.environ.pop(variable, None)


def connected_peers() -> str:
    """Where this process's TCP connections go (a rank's view of the job's network, for
    its log): the peer addresses with a count of connections to each."""
    peers: dict[str, int] = {}
    for connection in psutil.Process().net_connections(kind="inet"):
        if connection.status == psutil.CONN_ESTABLISHED and connection.raddr:
            ip = connection.raddr.ip.removeprefix("::ffff:")  # IPv4 on an IPv6 socket
            peers[ip] = peers.get(ip, 0) + 1
    return ", ".join(f"{ip} x{count}" for ip, count in sorted(peers.items())) or "none"
