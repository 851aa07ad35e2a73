"""Data-parallel gradient averaging over the flat gradient buffer, in buckets.

The buffer is cut into buckets: contiguous ranges of at most `bucket_bytes`
that never straddle two ZeRO-1 owners. A bucket is started (asynchronously)
as soon as the backward has finished writing every gradient in it -- the
post-accumulate-grad hook of its last parameter -- so the communication of
the late layers runs while the early layers' backward still computes, as in
DDP. Without ZeRO-1 a bucket is all-reduced; with it, it is reduced to the
one rank that owns its range (that rank's AdamW is the only reader), which
sends the same bytes as a reduce-scatter while keeping each rank's range
contiguous (the checkpoint format and resharding rely on that).

Buckets are started in one fixed order on every rank (collectives must
match), the order in which the backward is expected to finish them; a
bucket that is ready early waits for those before it. Gradients that
another group must still sum first (tensor parallelism's replicated KV heads
and per-head norms) sit in buckets started only by `finish`, after that sum.
If hooks never fire (a backward that does not accumulate into `.grad`),
`finish` starts everything: the result is the same, only not overlapped.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from meshtrain.distributed.flat_buffer import FlatParameters


@dataclass(frozen=True)
class Bucket:
    start: int
    end: int
    owner: int | None  # dp rank that receives the sum (ZeRO-1); None: every rank (all-reduce)
    slots: tuple[int, ...]  # indices into flat.slots of the parameters overlapping it
    deferred: bool  # holds gradients another group sums after backward: started by finish()


def cut_buckets(
    flat: FlatParameters,
    bucket_numel: int,
    owned_ranges: list[tuple[int, int]] | None,
    deferred_names: Collection[str] = (),
) -> list[Bucket]:
    """Contiguous buckets covering the whole padded buffer, in buffer order.

    A bucket ends at the first parameter boundary after it reaches
    `bucket_numel` elements, at every owner boundary (inside a parameter if
    need be), and where the buffer passes between deferred and other
    parameters.
    """
    owner_ends = [end for _, end in owned_ranges[:-1]] if owned_ranges else []
    cuts = {0, flat.padded_numel, *owner_ends}
    start, previous = 0, None
    for slot in flat.slots:
        deferred = slot.name in deferred_names
        if previous is not None and deferred != previous:
            cuts.add(slot.offset)
            start = slot.offset
        previous = deferred
        end = slot.offset + slot.numel
        start = max([start, *(c for c in owner_ends if c < end)])
        if end - start >= bucket_numel:
            cuts.add(end)
            start = end
    edges = sorted(cuts)
    buckets = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        slots = tuple(
            i for i, s in enumerate(flat.slots) if s.offset < hi and s.offset + s.numel > lo
        )
        owner = None
        if owned_ranges is not None:
            owner = next(r for r, (first, last) in enumerate(owned_ranges) if first <= lo < last)
        deferred = any(flat.slots[i].name in deferred_names for i in slots)
        buckets.append(Bucket(lo, hi, owner, slots, deferred))
    return buckets


class GradientReducer:
    """Averages `flat.grads` over the data-parallel `group`, bucket by bucket.

    Call `expect(n)` before a step's backward passes (n: how many backward
    passes write each gradient this step: accumulation steps x pipeline
    microbatches) and `finish()` after them; then every rank's owned range
    (everything without ZeRO-1) holds the mean over the ranks.
    """

    def __init__(
        self,
        flat: FlatParameters,
        group: dist.ProcessGroup | None,
        *,
        owned_ranges: list[tuple[int, int]] | None,
        bucket_bytes: int,
        overlap: bool,
        deferred_names: Collection[str] = (),
        mean_over: int | None = None,
    ) -> None:
        """`mean_over`: how many ranks' gradients the sum is the mean of (default: the
        group's size; an expert's replicas sum what every data-parallel rank's tokens
        gave it, a mean over all of them)."""
        self.flat = flat
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.mean_over = mean_over or self.size
        self.overlap = overlap and self.size > 1
        bucket_numel = max(1, bucket_bytes // flat.grads.element_size())
        self.buckets = cut_buckets(flat, bucket_numel, owned_ranges, deferred_names)

        def finished_at(bucket: Bucket) -> tuple[bool, int]:
            # The backward finishes the model's last parameters first, so a bucket is
            # ready once its earliest parameter (in model order) has its gradient.
            first = min((flat.slots[i].position for i in bucket.slots), default=0)
            return (bucket.deferred, -first)

        self.launch_order = sorted(
            range(len(self.buckets)), key=lambda b: finished_at(self.buckets[b])
        )
        self._buckets_of_slot: list[list[int]] = [[] for _ in flat.slots]
        for b, bucket in enumerate(self.buckets):
            for i in bucket.slots:
                self._buckets_of_slot[i].append(b)
        self._owner_rank = (
            [
                None if b.owner is None else dist.get_global_rank(group, b.owner)
                for b in self.buckets
            ]
            if self.size > 1
            else []
        )
        self._armed = False
        self._remaining: list[int] = []
        self._pending: list[int] = []
        self._next = 0
        self._works: list[dist.Work] = []
        self.started_in_backward = 0  # buckets the last step's backward started
        self._started = 0  # ... and the current step's, so far
        self._hooks: list[RemovableHandle] = []
        if self.overlap:
            for i, parameter in enumerate(flat.parameters):
                self._hooks.append(
                    parameter.register_post_accumulate_grad_hook(partial(self._on_gradient, i))
                )

    def expect(self, backward_passes: int) -> None:
        """Arm the hooks: each gradient is final after `backward_passes` accumulations."""
        if not self.overlap:
            return
        self._armed = True
        self._remaining = [backward_passes] * len(self.flat.slots)
        self._pending = [len(b.slots) for b in self.buckets]
        self._next = 0
        self._started = 0

    def _on_gradient(self, index: int, _parameter: torch.Tensor) -> None:
        if not self._armed:
            return
        self._remaining[index] -= 1
        if self._remaining[index] != 0:
            return
        for b in self._buckets_of_slot[index]:
            self._pending[b] -= 1
        while self._next < len(self.launch_order):
            b = self.launch_order[self._next]
            if self._pending[b] != 0 or self.buckets[b].deferred:
                break
            self._launch(b)
            self._next += 1
            self._started += 1

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        grads = self.flat.grads[bucket.start : bucket.end]
        if bucket.owner is None:
            work = dist.all_reduce(grads, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        else:
            work = dist.reduce(
                grads, self._owner_rank[b], op=dist.ReduceOp.SUM, group=self.group, async_op=True
            )
        self._works.append(work)

    def finish(self, mean_of: torch.Tensor) -> None:
        """Start what backward did not, wait for all, divide `mean_of` (the range this
        rank reads: a view of `flat.grads`) by the number of ranks."""
        if self.size == 1:
            if self.mean_over > 1:
                mean_of.div_(self.mean_over)
            return
        if self._armed:
            late = [i for i, n in enumerate(self._remaining) if n < 0]
            if late:
                names = ", ".join(self.flat.slots[i].name for i in late[:3])
                raise RuntimeError(
                    f"gradients of {names} were accumulated after their bucket was reduced: "
                    "more backward passes than announced to GradientReducer.expect()"
                )
        start = self._next if self._armed else 0
        self.started_in_backward = self._started if self._armed else 0
        for b in self.launch_order[start:]:
            self._launch(b)
        for work in self._works:
            work.wait()
        self._works.clear()
        self._armed = False
        mean_of.div_(self.mean_over)
