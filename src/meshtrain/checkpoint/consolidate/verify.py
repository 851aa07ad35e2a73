"""The sha256 check of every checkpoint file, run alongside the copy instead of before it."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshtrain.checkpoint.manifest import CheckpointError

HASH_BYTES = 2**20  # the read size of the sha256 check


class Verifier:
    """Checks every file of the checkpoint against its sha256 in the manifest, on
    background threads (hashing releases the GIL), largest files first."""

    def __init__(self, root: Path, files: Mapping[str, Mapping[str, Any]]) -> None:
        self._root = root
        self._order = list(files)
        self._files = files
        self._todo = sorted(files, key=lambda rel: -files[rel]["bytes"])
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._mismatched: list[str] = []
        self._errors: list[BaseException] = []
        self._failure: BaseException | None = None
        workers = min(len(self._todo), max(1, os.cpu_count() or 1), 8)
        self._threads = [
            threading.Thread(target=self._work, name=f"sha256-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        buffer = bytearray(HASH_BYTES)
        view = memoryview(buffer)
        while not self._stop.is_set():
            with self._lock:
                if not self._todo:
                    return
                rel = self._todo.pop(0)
            try:
                digest = hashlib.sha256()
                with (self._root / rel).open("rb", buffering=0) as handle:
                    while (got := handle.readinto(buffer)) and not self._stop.is_set():
                        digest.update(view[:got])
                if not self._stop.is_set() and digest.hexdigest() != self._files[rel]["sha256"]:
                    with self._lock:
                        self._mismatched.append(rel)
                    self._stop.set()
            except BaseException as error:  # reported by `failure`
                with self._lock:
                    self._errors.append(error)
                self._stop.set()

    def failure(self, *, wait: bool) -> BaseException | None:
        """The error to raise, if any so far (with `wait`: once every file is hashed): a
        CheckpointError for a mismatch (the first file in manifest order), or a read
        error. The same object every time."""
        if wait:
            for thread in self._threads:
                thread.join()
        with self._lock:
            if self._failure is None and self._mismatched:
                first = min(self._mismatched, key=self._order.index)
                self._failure = CheckpointError(
                    f"{self._root / first} does not match its sha256 in the manifest"
                )
            elif self._failure is None and self._errors:
                self._failure = self._errors[0]
            return self._failure

    def cancel(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
