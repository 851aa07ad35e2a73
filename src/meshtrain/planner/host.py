"""The host a node's ranks share: its memory and its cores, against the plan.

The device profile bounds one rank; nothing else stops 64 ranks of 1.4 GiB each from
being started on a 24 GiB machine, where the kernel's OOM killer ends the job minutes
later, or two ranks per core from running at a fraction of the planned speed. This
runs where the ranks will start (the training node, on every node), with the memory
this host can give the job now: `MemAvailable`, or the container's cgroup limit where
that is lower.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from meshtrain.device import on_host
from meshtrain.planner.devices import BUILTIN_PROFILES
from meshtrain.planner.types import LayoutError, Plan, Refusal

GIB = 2**30
# Two ranks per core on the project's 2-core machine (the default model, 4 ranks
# against 2): the job's tokens/s over one rank per core's (A/A 1.035x), bench/
# ranks_per_core.py, docs/speed.md "Ranks and cores". More ranks buy no throughput.
TWO_PER_CORE_THROUGHPUT = 1.029


@dataclass(frozen=True)
class Host:
    """What this machine can give the job: bytes of memory and cores, with their source."""

    memory_bytes: int
    memory_source: str
    cores: int

    @classmethod
    def here(cls) -> Host:
        available = _meminfo_bytes("MemAvailable")
        source = "MemAvailable in /proc/meminfo"
        limit = _cgroup_room()
        if limit is not None and (available is None or limit < available):
            available, source = limit, "the cgroup's memory.max less memory.current"
        if available is None:  # not Linux: no refusal on a figure we cannot read
            available, source = 0, "unknown"
        return cls(available, source, len(os.sched_getaffinity(0)))


def host_bytes_per_rank(plan: Plan) -> int:
    """What one rank holds in host memory. On CPU all of it: the plan's process total.
    On an accelerator, the activations offloading keeps in host memory and the process
    itself, counted at a CPU worker's measured resident set (the cpu profile's runtime:
    torch, transformers and mlflow imported, the group joined; the accelerator runtime's
    own host share comes on top). The blocks are memory-mapped (page cache, given back
    under pressure) and checkpoints stream from the tensors' own memory, so neither
    adds a host copy."""
    memory = plan.memory_estimate_per_rank
    if on_host(plan.backend):  # the ranks are CPU processes
        return int(memory["process_total"])
    return BUILTIN_PROFILES["cpu"].runtime_bytes + int(memory.get("offloaded_to_host", 0))


def snapshot_bytes(plan: Plan) -> int:
    """A background checkpoint's snapshot of one rank in host memory (a tmpfs, at most
    what the rank stores: its parameters and optimizer states, its shares of them where
    they are sharded; `checkpoint/background.py`)."""
    memory = plan.memory_estimate_per_rank
    return int(memory["parameters"]) + int(memory["optimizer_states"])


def check_host(
    plan: Plan, ranks_here: int, host: Host | None = None, *, snapshot: bool = False
) -> list[str]:
    """Refuse `ranks_here` ranks of `plan` whose memory this host cannot hold, naming the
    arithmetic and the ranks that fit; returns the warnings (more ranks than cores).
    `snapshot`: checkpoints are written in the background, each rank's snapshot in host
    memory until it is written."""
    host = host or Host.here()
    per_rank = host_bytes_per_rank(plan)
    if snapshot:
        _check_snapshot(plan, ranks_here, host, per_rank)
        per_rank += snapshot_bytes(plan)
    need = per_rank * ranks_here
    if host.memory_bytes and per_rank and need > host.memory_bytes:
        fits = host.memory_bytes // per_rank
        fix = (
            f"Use launch.nproc_per_node<={fits} (and a layout of that many ranks per node), "
            "more nodes (launch.nnodes), or a smaller model or batch."
            if fits
            else "Use a smaller model or batch: one rank does not fit."
        )
        reason = (
            f"{ranks_here} ranks x {per_rank / GIB:.2f} GiB per rank ({_what(plan)}) = "
            f"{need / GIB:.1f} GiB, but this host has {host.memory_bytes / GIB:.1f} GiB for "
            f"the job ({host.memory_source})"
        )
        raise LayoutError([Refusal("launch.nproc_per_node", ranks_here, reason, fix)])
    warnings = []
    if on_host(plan.backend) and ranks_here > host.cores:
        warnings.append(
            f"launch.nproc_per_node={ranks_here} ranks share {host.cores} core(s) here: "
            f"each step will take about {ranks_here / host.cores:.1f}x the planned time, for "
            f"no more tokens/s (two ranks per core ran at {TWO_PER_CORE_THROUGHPUT:.2f}x the "
            "tokens/s of one per core, within the A/A noise; docs/speed.md)."
        )
    return warnings


def _check_snapshot(plan: Plan, ranks_here: int, host: Host, per_rank: int) -> None:
    """Refuse background checkpoints whose snapshots are all that does not fit."""
    snapshots = snapshot_bytes(plan) * ranks_here
    running = per_rank * ranks_here
    if not host.memory_bytes or running + snapshots <= host.memory_bytes:
        return
    if running > host.memory_bytes:
        return  # the ranks themselves do not fit: refused on that
    reason = (
        f"a background checkpoint holds each rank's snapshot in host memory: {ranks_here} x "
        f"{snapshot_bytes(plan) / GIB:.2f} GiB on top of the ranks' {running / GIB:.1f} GiB, "
        f"but this host has {host.memory_bytes / GIB:.1f} GiB for the job "
        f"({host.memory_source})"
    )
    fix = "Set training.checkpoint_async=false: a synchronous save streams from the tensors."
    raise LayoutError([Refusal("training.checkpoint_async", True, reason, fix)])


def _what(plan: Plan) -> str:
    if on_host(plan.backend):
        return "the plan's process estimate"
    return "the process and its offloaded activations"


def _meminfo_bytes(field: str) -> int | None:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024  # kB
    return None


def _cgroup_room() -> int | None:
    """The memory cgroup's limit less its usage for this process (v2: memory.max and
    memory.current; v1: memory.limit_in_bytes and memory.usage_in_bytes); None where
    there is no limit or no cgroup to read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":  # v2, unified
            folder, limit_file, usage_file = Path("/sys/fs/cgroup"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory")
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        folder = folder / group.lstrip("/")
        try:
            limit = (folder / limit_file).read_text().strip()
            usage = int((folder / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 2**60:  # v1 writes "no limit" as ~2**63
            return None
        return max(int(limit) - usage, 0)
    return None
