"""Seconds of a ring collective over a group of ranks, on the link its span uses."""

from __future__ import annotations

from meshtrain.planner.devices import DeviceProfile


def ring(bytes_: float, ranks: int, gbps: float, latency_us: float, factor: float) -> float:
    """Seconds of a ring collective: `factor` (2 for all-reduce, 1 for gather/scatter)."""
    if ranks <= 1:
        return 0.0
    return factor * (ranks - 1) / ranks * bytes_ / (gbps * 1e9) + factor * (ranks - 1) * (
        latency_us * 1e-6
    )


def link(device: DeviceProfile, span: int) -> float:
    """GB/s of a group whose ranks span `span` consecutive devices (tp innermost)."""
    return device.intra_node_gbps if span <= device.devices_per_node else device.inter_node_gbps


def all_to_all(bytes_: float, ranks: int, gbps: float, latency_us: float) -> float:
    """Seconds of an all-to-all of `bytes_` per rank: (ranks-1)/ranks of them leave it, in
    ranks-1 pairwise exchanges (a ring gather's cost)."""
    return ring(bytes_, ranks, gbps, latency_us, 1.0)
