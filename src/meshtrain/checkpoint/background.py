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
import hashlib
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshtrain.checkpoint import remote
from meshtrain.checkpoint.manifest import CheckpointError
from meshtrain.checkpoint.space import free_bytes, named_write_errors
from meshtrain.device import HOST_BACKEND

STAGING_ROOT = Path("/dev/shm")
# The writer threads' agreement waits for the slowest rank's copy.
_AGREEMENT_TIMEOUT = datetime.timedelta(hours=6)
_COPY_CHUNK = 8 << 20
# What a rank's writer reports: each file's description (size, sha256) by its path in the
# checkpoint; None for a failed write.
Described = dict[str, dict[str, Any]]
Destination = Path | str  # a local folder, or a URL (`checkpoint.remote`)


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


def copy_durably(source: Path, target: Path) -> Described:
    """Every file under `source` to the same place under `target`, each flushed to
    stable storage, then the folders' entries; each file's size and sha256."""
    target.mkdir(parents=True, exist_ok=True)
    folders, described = {target}, {}
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        relative = path.relative_to(source)
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        folders.add(destination.parent)
        try:
            described[relative.as_posix()] = _copy_file(path, destination)
        except OSError as error:
            error.filename = error.filename or str(destination)  # a full disk names none
            raise
    for folder in folders:
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    return described


def _copy_file(source: Path, destination: Path) -> dict[str, Any]:
    """One file copied and flushed to stable storage; its size and sha256."""
    digest, size = hashlib.sha256(), 0
    with source.open("rb") as reader, destination.open("wb") as writer:
        while block := reader.read(_COPY_CHUNK):
            digest.update(block)
            writer.write(block)
            size += len(block)
        writer.flush()
        os.fsync(writer.fileno())
    return {"bytes": size, "sha256": digest.hexdigest()}


def transfer(staged: Path, destination: Destination) -> Described:
    """The staged files to their checkpoint folder, local or on object storage; a full
    or refusing disk is named with the file, the free space and what is kept."""
    if isinstance(destination, str):
        return remote.upload_folder(staged, destination)
    with named_write_errors(destination.parent, destination):
        return copy_durably(staged, destination)


class BackgroundWriter:
    """One rank's writer of staged checkpoints; at most one save in flight."""

    def __init__(self) -> None:
        """Collective: the writer threads' own process group."""
        self.group = dist.new_group(backend=HOST_BACKEND, timeout=_AGREEMENT_TIMEOUT)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(
        self,
        staged: Path,
        destination: Destination,
        finish: Callable[[Described], None] | None,
    ) -> None:
        """Write `staged` into `destination` in the background; once every rank's files
        are durable, `finish` (rank 0's: the manifest and the marker) runs in this rank's
        thread with every rank's files described."""
        self.wait()
        self._thread = threading.Thread(
            target=self._write,
            args=(staged, destination, finish),
            name="checkpoint-writer",
            daemon=True,
        )
        self._thread.start()

    def _write(
        self,
        staged: Path,
        destination: Destination,
        finish: Callable[[Described], None] | None,
    ) -> None:
        described: Described | None = None
        try:
            described = transfer(staged, destination)
        except BaseException as error:  # noqa: BLE001 (raised in the training loop)
            self._error = error
        finally:
            shutil.rmtree(staged, ignore_errors=True)
            with contextlib.suppress(OSError):
                staged.parent.rmdir()  # this process's staging folder, when empty
        everyone: list[Described | None] = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(everyone, described, group=self.group)
        except BaseException as error:  # noqa: BLE001
            self._error = self._error or error
            return
        if any(part is None for part in everyone):
            self._error = self._error or CheckpointError(
                f"another rank could not write its part of {destination}; it is not "
                "complete, and the checkpoint before it stays the latest"
            )
            return
        if finish is not None:
            try:
                finish({name: meta for part in everyone for name, meta in part.items()})
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
