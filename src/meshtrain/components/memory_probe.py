"""Measure the peak memory of live tensors on one rank during one training step.

On CUDA the allocator keeps the number (`torch.cuda.max_memory_allocated`). On
CPU nothing does (the process RSS also counts the Python heap, libraries and
freed-but-cached pages), so a dispatch mode follows every tensor storage that
an operator creates during the step until it is freed, on top of the storages
that already live (parameters, gradients, optimizer states), each counted
once however many views point into it. That is what the planner's memory
model predicts, so the two compare one to one. Storages that grow and shrink
in place (FSDP2 gathers a layer into storage it resizes, not a new one) are
followed too, by watching `UntypedStorage.resize_` during the block.

(torch's `MemTracker` does the same but refuses a module called several times
in one step, which is what a pipeline schedule does with its microbatches.)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


@dataclass
class PeakMemory:
    """Peak bytes of live tensors during the measured block."""

    peak_bytes: int = 0


def _plain_tensors(value: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that own memory: a DTensor's local shard, not the wrapper."""
    if is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        for name in names:
            inner = getattr(value, name)
            if isinstance(inner, torch.Tensor):
                yield from _plain_tensors(inner)
    elif isinstance(value, torch.Tensor):
        yield value


class _LiveStorages(TorchDispatchMode):
    """Adds up the bytes of the storages that operators create, until each is freed."""

    def __init__(self, existing: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._refs: dict[int, weakref.ref] = {}
        self.live = self.peak = self.existing = 0
        for tensor in existing:
            for plain in _plain_tensors(tensor):
                self.existing += self._track(plain.untyped_storage())
        self.live = self.peak = 0  # what the step adds on top of `existing`

    def _track(self, storage: torch.UntypedStorage) -> int:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._refs or storage.device.type == "meta":
            return 0
        self._refs[key] = weakref.ref(storage, lambda _, key=key, n=nbytes: self._free(key, n))
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        return nbytes

    def _free(self, key: int, nbytes: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= nbytes

    def resized(self, before: int, after: int) -> None:
        """A storage grew or shrank in place by `after - before` bytes."""
        self.live += after - before
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                for plain in _plain_tensors(value):
                    self._track(plain.untyped_storage())
        return out


@contextlib.contextmanager
def measure_peak_memory(
    device: torch.device, *, existing: Iterable[torch.Tensor]
) -> Iterator[PeakMemory]:
    """Measure the block; `PeakMemory` is filled in when the block ends.

    `existing`: every tensor that lives before the block and through it
    (parameters, gradient buffers, optimizer states, persistent buffers).
    """
    result = PeakMemory()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result.peak_bytes = torch.cuda.max_memory_allocated(device)
        return
    tracker = _LiveStorages(existing)
    with tracker, _following_resizes(tracker):
        yield result
    result.peak_bytes = tracker.existing + tracker.peak


@contextlib.contextmanager
def _following_resizes(tracker: _LiveStorages) -> Iterator[None]:
    """Report every in-place storage resize to `tracker` while the block runs."""
    original = torch.UntypedStorage.resize_

    def resize(storage: torch.UntypedStorage, size: int):
        before = storage.nbytes()
        out = original(storage, size)
        tracker.resized(before, storage.nbytes())
        return out

    torch.UntypedStorage.resize_ = resize
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original
