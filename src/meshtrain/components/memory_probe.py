"""Measure the peak memory of live tensors on one rank during one training step.

On an accelerator its allocator keeps the number (`device.peak_allocated_bytes`). On
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
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from meshtrain.device import is_accelerator, peak_allocated_bytes, reset_peak_memory, synchronize


@dataclass
class PeakMemory:
    """Peak bytes of live tensors during the measured block (on CPU and under fake tensors,
    also what they were at that moment, by category, and where the step was)."""

    peak_bytes: int = 0
    by_category: dict[str, int] = field(default_factory=dict)
    by_module: dict[str, int] = field(default_factory=dict)  # what each module made, live
    at: str = ""


# What a storage that exists before the measured block holds, and what one an operator
# creates during it holds, by the step's phase then; FSDP2's gathered parameters and
# unsharded gradients grow storage in place (`resize_`) and count as `gathered`.
EXISTING = "existing"
NEW_IN = {"forward": "activations", "backward": "backward", "optimizer": "optimizer_step"}
GATHERED = "gathered"


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
    """Adds up the bytes of the storages that operators create, until each is freed, by
    category; keeps the categories and `where()` at each new peak.

    Storages are told apart by their StorageImpl (`_cdata`), which fake tensors have too
    (their data pointer is 0); `fake`: count meta storages, which under fake tensors are
    every tensor's."""

    def __init__(
        self,
        existing: dict[str, Iterable[torch.Tensor]],
        *,
        fake: bool = False,
        where: Callable[[], str] = lambda: "",
        owner: Callable[[], str] = lambda: "",
    ) -> None:
        super().__init__()
        self._refs: dict[int, tuple[weakref.ref, str, str, int]] = {}
        self._resized: set[int] = set()  # storages counted by their in-place resizes
        self.fake, self.where, self.owner, self.phase = fake, where, owner, "forward"
        self.live: dict[str, int] = defaultdict(int)
        self.live_by_module: dict[str, int] = defaultdict(int)
        self.by_module_at_peak: dict[str, int] = {}
        self.total = self.peak = 0
        self._pending = False  # a new peak whose breakdown is taken once it ends
        for category, tensors in existing.items():
            for tensor in tensors:
                for plain in _plain_tensors(tensor):
                    self._track(plain.untyped_storage(), category)
        self.existing = dict(self.live)
        self.total = self.peak = 0  # what the step adds on top of `existing`
        self.live = defaultdict(int)
        self.at_peak: dict[str, int] = {}
        self.peak_at, self._pending = "", False

    def _track(self, storage: torch.UntypedStorage, category: str | None = None) -> int:
        key, nbytes = storage._cdata, storage.nbytes()
        if nbytes == 0 or key in self._refs or key in self._resized:
            return 0
        if storage.device.type == "meta" and not self.fake:
            return 0
        owner = "" if category else self.owner()
        category = category or NEW_IN[self.phase]
        ref = weakref.ref(storage, lambda _, key=key: self._free(key))
        self._refs[key] = (ref, category, owner, nbytes)
        self._grow(category, nbytes, owner)
        return nbytes

    def _grow(self, category: str, nbytes: int, owner: str = "") -> None:
        if nbytes < 0 and self._pending:
            self._take_peak()
        self.live[category] += nbytes
        if owner:
            self.live_by_module[owner] += nbytes
        self.total += nbytes
        if self.total > self.peak:
            self.peak, self._pending = self.total, True
            self.peak_at = self.where()

    def _take_peak(self) -> None:
        self.at_peak, self._pending = dict(self.live), False
        self.by_module_at_peak = {k: v for k, v in self.live_by_module.items() if v}

    def _free(self, key: int) -> None:
        entry = self._refs.pop(key, None)
        if entry is not None:
            _, category, owner, nbytes = entry
            self._grow(category, -nbytes, owner)

    def result(self) -> PeakMemory:
        if self._pending:
            self._take_peak()
        by_category = {**self.existing, **{k: v for k, v in self.at_peak.items() if v}}
        for name, nbytes in self.existing.items():
            by_category[name] = nbytes + self.at_peak.get(name, 0)
        total = sum(self.existing.values()) + self.peak
        return PeakMemory(total, by_category, self.by_module_at_peak, self.peak_at)

    def resized(self, storage: torch.UntypedStorage, before: int, after: int) -> None:
        """`storage` grew or shrank in place by `after - before` bytes. It is counted from
        now on by its resizes alone: the tensors FSDP2 then makes of it (its gathered
        parameters, views) are not new memory."""
        key = storage._cdata
        self._resized.add(key)
        entry = self._refs.get(key)
        if entry is not None:  # made during the block, then resized: follow its size
            ref, category, owner, nbytes = entry
            self._refs[key] = (ref, category, owner, after)
            self._grow(category, after - before, owner)
            return
        self._grow(GATHERED, after - before)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                for plain in _plain_tensors(value):
                    self._track(plain.untyped_storage())
        return out


@contextlib.contextmanager
def measure_peak_memory(
    device: torch.device,
    *,
    existing: Iterable[torch.Tensor] | dict[str, Iterable[torch.Tensor]],
    fake: bool = False,
    where: Callable[[], str] = lambda: "",
    owner: Callable[[], str] = lambda: "",
) -> Iterator[tuple[PeakMemory, Callable[[str], None]]]:
    """Measure the block; `PeakMemory` is filled in when the block ends. Yields it and a
    function that names the step's phase (`NEW_IN`'s keys) for what is created next.

    `existing`: every tensor that lives before the block and through it (parameters,
    gradient buffers, optimizer states, persistent buffers), by category if a dict.
    `fake`: the block runs on fake tensors (`meshtrain.dryrun`), which an accelerator's allocator
    never sees, so they are followed as on CPU; `where`: the step's position, kept at
    each new peak; `owner`: the module an operator runs in, by which what it makes is
    added up.
    """
    result = PeakMemory()
    if is_accelerator(device) and not fake:
        synchronize(device)
        reset_peak_memory(device)
        yield result, lambda phase: None
        synchronize(device)
        result.peak_bytes = peak_allocated_bytes(device)
        return
    if not isinstance(existing, dict):
        existing = {EXISTING: existing}
    tracker = _LiveStorages(existing, fake=fake, where=where, owner=owner)
    with tracker, _following_resizes(tracker):
        yield result, partial(setattr, tracker, "phase")
    measured = tracker.result()
    result.peak_bytes, result.by_category = measured.peak_bytes, measured.by_category
    result.by_module, result.at = measured.by_module, measured.at


@contextlib.contextmanager
def _following_resizes(tracker: _LiveStorages) -> Iterator[None]:
    """Report every in-place storage resize to `tracker` while the block runs."""
    original = torch.UntypedStorage.resize_

    def resize(storage: torch.UntypedStorage, size: int):
        before = storage.nbytes()
        out = original(storage, size)
        tracker.resized(storage, before, storage.nbytes())
        return out

    torch.UntypedStorage.resize_ = resize
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original
