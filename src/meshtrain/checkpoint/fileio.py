"""Positional reads and writes that finish the job: the OS may move fewer bytes per call."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from meshtrain.checkpoint.manifest import CheckpointError


def _iov_max() -> int:
    """How many segments one `preadv` call takes."""
    try:
        value = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - POSIX has it
        value = -1
    return min(value, 1024) if value > 0 else 16


IOV_MAX = _iov_max()


def write_all(fd: int, data: Any, offset: int) -> None:
    """Write all of `data` (a bytes-like object) at `offset` of `fd`."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def pread_some(fd: int, view: memoryview, offset: int) -> int:
    """Read up to len(view) bytes at `offset` of `fd` into `view`; returns how many."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)  # pragma: no cover - platforms without preadv
    view[: len(data)] = data  # pragma: no cover
    return len(data)  # pragma: no cover


def read_into(fd: int, buffer: Any, offset: int, path: Path) -> None:
    """Fill `buffer` (a writable bytes-like object) from `offset` of `fd`."""
    view = memoryview(buffer).cast("B")
    while view:
        got = pread_some(fd, view, offset)
        if got == 0:
            raise CheckpointError(f"{path} ended before the data its header lists")
        view = view[got:]
        offset += got


def preadv_all(fd: int, views: list[memoryview], offset: int, path: Path) -> None:
    """Fill `views`, in order, from consecutive bytes at `offset` of `fd`."""
    index = 0
    while index < len(views):
        got = os.preadv(fd, views[index : index + IOV_MAX], offset)
        if got == 0:
            raise CheckpointError(f"{path} ended before the data its header lists")
        offset += got
        while got:  # skip the views filled; trim one filled in part (a short read)
            if got >= len(views[index]):
                got -= len(views[index])
                index += 1
            else:
                views[index] = views[index][got:]
                got = 0
