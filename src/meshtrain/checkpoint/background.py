"""A checkpoint written while training goes on (`training.checkpoint_async`).

At the checkpoint step each rank writes its files as a synchronous save would, but into
a staging folder in host memory (`/dev/shm`, a tmpfs): that is the snapshot, a memory
copy. A background thread then copies them into the checkpoint's folder, each file made
durable, and deletes the staging folder. The checkpoint is marked complete (manifest,
`COMPLETE`) only once every rank's files are durable: the ranks' writer threads agree
over a process group of their own, which the training loop never uses, and rank 0's
thread then writes the manifest and prunes. A writer's failure leaves no `COMPLETE`, so
the previous checkpoint stays `latest`; it is raised in the training loop by the next
`check`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.checkpoint.manifest import CheckpointError
from meshtrain.checkpoint.space import free_bytes

STAGING_ROOT = Path("/dev/shm")
# The writer threads' agreement waits for the slowest rank's copy.
_AGREEMENT_TIMEOUT = datetime.timedelta(hours=6)


def staging_available(root: Path = STAGING_ROOT) -> int:
    """The bytes a snapshot can take in host memory (0: no tmpfs to stage in)."""
    if not root.is_dir() or not os.access(root, os.W_OK):
        return 0
    return free_bytes(root)


def staging_folder(rank: int, root: Path = STAGING_ROOT) -> Path:
    """This process's staging folder (its pid in the name, so a later run can tell that a
    killed run's leftover is stale)."""
    return root / f"meshtrain-checkpoint-{os.getpid()}-rank{rank}"


def remove_stale_staging(root: Path = STAGING_ROOT) -> None:
    """Delete the staging folders of processes that are gone (killed mid-save): they hold
    host memory until removed."""
    for folder in root.glob("meshtrain-checkpoint-*-rank*") if root.is_dir() else ():
        pid = folder.name.split("-")[2]
        if not pid.isdigit():
            continue  # not a name this module gave
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


def copy_durably(source: Path, target: Path) -> None:
    """Every file under `source` to the same place under `target`, each flushed to
    stable storage, then the folders' entries."""
    target.mkdir(parents=True, exist_ok=True)
    folders = {target}
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        destination = target / path.relative_to(source)
        destination.parent.mkdir(parents=True, exist_ok=True)
        folders.add(destination.parent)
        shutil.copyfile(path, destination)
        with destination.open("rb+") as handle:
            os.fsync(handle.fileno())
    for folder in folders:
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


class BackgroundWriter:
    """One rank's writer of staged checkpoints; at most one save in flight."""

    def __init__(self) -> None:
        """Collective: the writer threads' own process group."""
        self.group = dist.new_group(backend="gloo", timeout=_AGREEMENT_TIMEOUT)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, staged: Path, root: Path, finish: Callable[[], None] | None) -> None:
        """Copy `staged` into `root` in the background; once every rank's copy is durable,
        `finish` (rank 0's: the manifest and the marker) runs in this rank's thread."""
        self.wait()
        self._thread = threading.Thread(
            target=self._write, args=(staged, root, finish), name="checkpoint-writer", daemon=True
        )
        self._thread.start()

    def _write(self, staged: Path, root: Path, finish: Callable[[], None] | None) -> None:
        written = True
        try:
            copy_durably(staged, root)
        except BaseException as error:  # noqa: BLE001 (raised in the training loop)
            self._error, written = error, False
        finally:
            shutil.rmtree(staged, ignore_errors=True)
            with contextlib.suppress(OSError):
                staged.parent.rmdir()  # this process's staging folder, when empty
        everyone = torch.tensor([int(written)])
        try:
            dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=self.group)
        except BaseException as error:  # noqa: BLE001
            self._error = self._error or error
            return
        if not everyone.item():
            self._error = self._error or CheckpointError(
                f"another rank could not write its part of {root}; it is not complete, and "
                "the checkpoint before it stays the latest"
            )
            return
        if finish is not None:
            try:
                finish()
            except BaseException as error:  # noqa: BLE001
                self._error = error

    def check(self) -> None:
        """Raise the error of a finished save that failed (without waiting)."""
        if self._error is not None and not self.in_flight:
            error, self._error = self._error, None
            raise CheckpointError(f"a background checkpoint write failed: {error}") from error

    def wait(self) -> None:
        """Wait for the save in flight; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()
