"""Room on disk for a checkpoint: checked before its first byte, and a failed write named.

A checkpoint that does not fit must not cost the run what it already has: the
previous complete checkpoint stays untouched (pruning happens only after a new
one is marked complete) and stays `latest`, and a half-written folder carries no
completion marker, so `latest` and consolidation never take it (the next save of
that step replaces it).
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from meshtrain.checkpoint.manifest import CheckpointError, list_checkpoints

MB = 10**6
# Besides the tensors: headers, the manifest, config and trainer state, RNG states.
OVERHEAD_BYTES = 1 * MB
# Errors that mean "this filesystem will not take the checkpoint", not a bug.
_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG}


class CheckpointSpaceError(CheckpointError):
    """A checkpoint could not be written (no room, no permission); nothing was lost."""


def folder_bytes(folder: Path | None) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder else 0


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def room_problem(run_dir: Path, root: Path, needed: int) -> str | None:
    """Why checkpoint folder `root` (about `needed` bytes) cannot be written, or None."""
    free = free_bytes(run_dir)
    if needed + OVERHEAD_BYTES <= free:
        return None
    return (
        f"not enough room for {root.name} in {run_dir}: it needs about "
        f"{(needed + OVERHEAD_BYTES) / MB:,.1f} MB and the filesystem has {free / MB:,.1f} MB "
        f"free. Nothing of it was written; {_kept(run_dir)}. Free space there or point "
        "training.output_dir at a larger filesystem, then resume with "
        "training.resume_from=latest."
    )


@contextmanager
def named_write_errors(run_dir: Path, root: Path) -> Iterator[None]:
    """Turn a failed write (disk full, quota, permission) into a CheckpointSpaceError that
    names the file, the free space and what is kept."""
    try:
        yield
    except OSError as error:
        if error.errno not in _DISK_ERRORS:
            raise
        where = error.filename or root
        raise CheckpointSpaceError(
            f"could not write {where}: {error.strerror} ({free_bytes(run_dir) / MB:,.1f} MB "
            f"free there). {root.name} is incomplete (no marker: `latest` never takes it); "
            f"{_kept(run_dir)}. Free space or fix the permissions, or point "
            "training.output_dir elsewhere, then resume with training.resume_from=latest."
        ) from None


def _kept(run_dir: Path) -> str:
    complete = list_checkpoints(run_dir)
    if not complete:
        return "the run has no earlier complete checkpoint"
    return f"{complete[-1][1].name} is untouched and still the latest complete checkpoint"
