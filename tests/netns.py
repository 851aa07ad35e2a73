"""Two "hosts" on one machine: Linux network namespaces joined by a veth pair.

Each host gets its own address on the link (10.77.0.1 and 10.77.0.2 by
default) and a second, decoy veth with an address of its own, so that
choosing an interface is a real choice. Nothing leaves the machine: the
pairs and namespaces are made here and torn down after. Needs root and
iproute2's `ip` (`.ci/run` installs it where absent).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Host:
    namespace: str
    interface: str  # the link to the other host
    address: str
    decoy: str  # a second interface, on another network

    def command(self, *argv: str) -> list[str]:
        """`argv` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def link(self, up: bool) -> None:
        """Bring this host's side of the link up or down (a cable pulled, a switch port)."""
        _ip("-n", self.namespace, "link", "set", self.interface, "up" if up else "down")


def require_namespaces() -> None:
    """Fail in CI, skip elsewhere, where this machine cannot make namespaces."""
    why = None
    if os.geteuid() != 0:
        why = "network namespaces need root"
    elif shutil.which("ip") is None:
        why = "iproute2's `ip` is not installed"
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; .ci/run installs what the tests need")
    pytest.skip(why)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@contextmanager
def two_hosts(tag: str | None = None) -> Iterator[tuple[Host, Host]]:
    """Make the two hosts (names unique to this process), yield them, always tear down."""
    tag = tag or f"mt{os.getpid() % 100000}"
    hosts = tuple(
        Host(f"{tag}{side}", f"{tag}{side}l", f"10.77.0.{n}", f"{tag}{side}d")
        for n, side in ((1, "a"), (2, "b"))
    )
    made: list[str] = []
    try:
        for host in hosts:
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        a, b = hosts
        _ip("link", "add", a.interface, "type", "veth", "peer", "name", b.interface)
        for n, host in enumerate(hosts, start=1):
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            host.link(up=True)
            # The decoy: a veth whose other end stays outside, on a network of its own.
            _ip("link", "add", host.decoy, "type", "veth", "peer", "name", f"{host.decoy}x")
            _ip("link", "set", host.decoy, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"10.88.{n}.1/24", "dev", host.decoy)
            _ip("-n", host.namespace, "link", "set", host.decoy, "up")
        yield a, b
    finally:
        for host in hosts:
            subprocess.run(["ip", "link", "del", f"{host.decoy}x"], capture_output=True)
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def processes_in(namespace: str) -> list[int]:
    """Pids of the processes still running inside `namespace`."""
    result = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(pid) for pid in result.stdout.split()]
