"""ZeRO-1's parameter all-gather, bucket by bucket, overlapped with the next forward.

After the update each data-parallel rank holds new values only in the range it
owns. Gathered in one all-gather, the next step cannot start until the whole
model has arrived. Instead, each gradient bucket (a contiguous range that
never straddles two owners: `data_parallel.cut_buckets`) is broadcast from its
owner, in the order the forward reads the buckets, and a forward pre-hook on
every module that holds parameters waits only for its own buckets. The update
sends the first buckets; each wait sends the next ones, keeping `prefetch`
buckets in flight ahead of the forward, as Megatron's distributed optimizer
does. The embedding and the first layers compute while the later layers'
values are still arriving; and a collective issued between the update and the
forward (the loss's all-reduce for logging) queues behind a few buckets, not
the whole model, where the backend runs a group's collectives in order
(NCCL). The bytes are the all-gather's, so the results are identical.

Whatever reads the parameters outside a module's forward (a checkpoint, the end
of training, the next update) calls `wait_all` first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from meshtrain.distributed.data_parallel import Bucket
from meshtrain.distributed.flat_buffer import FlatParameters


class ParameterGather:
    """Broadcasts each owned bucket of `flat.params` after the update; modules' forward
    pre-hooks wait for the buckets of their own parameters."""

    def __init__(
        self,
        flat: FlatParameters,
        group: dist.ProcessGroup,
        buckets: list[Bucket],
        modules: Iterable[nn.Module],
        prefetch: int = 2,
    ) -> None:
        """`prefetch`: how many buckets are in flight ahead of the one the forward waits for."""
        self.flat = flat
        self.group = group
        # Padding-only buckets hold nothing anyone reads: never sent.
        self.buckets = {b: bucket for b, bucket in enumerate(buckets) if bucket.slots}
        self._source = {b: dist.get_global_rank(group, x.owner) for b, x in self.buckets.items()}

        def first_read(b: int) -> float:
            # The forward reads the model in order: a bucket is needed at its first parameter.
            return min((flat.slots[i].position for i in self.buckets[b].slots), default=math.inf)

        self.order = sorted(self.buckets, key=first_read)
        self._place = {b: i for i, b in enumerate(self.order)}
        self.prefetch = prefetch
        self._works: dict[int, dist.Work] = {}
        self._sent = 0  # how many of `order` this round has sent
        self._active = False  # a round is under way: sent after an update, not all waited
        self._waited = 0  # buckets of this round the forward waited for
        self.rounds = 0  # updates that started a gather
        self.rounds_in_forward = 0  # of them, those whose every bucket a forward waited for
        self._hook_modules(modules)

    def _hook_modules(self, modules: Iterable[nn.Module]) -> None:
        """A forward pre-hook on every module holding parameters of `flat`: it waits for
        the buckets of those parameters, in forward order."""
        slot_of = {id(p): i for i, p in enumerate(self.flat.parameters)}
        buckets_of_slot: dict[int, list[int]] = {}
        for b, bucket in self.buckets.items():
            for i in bucket.slots:
                buckets_of_slot.setdefault(i, []).append(b)
        for module in modules:
            for sub in module.modules():
                needed = sorted(
                    {
                        b
                        for p in sub.parameters(recurse=False)
                        if id(p) in slot_of
                        for b in buckets_of_slot.get(slot_of[id(p)], ())
                    },
                    key=self._place.__getitem__,
                )
                if needed:
                    sub.register_forward_pre_hook(partial(self._wait, needed))

    def start(self) -> None:
        """After the update: send the first buckets; the forward's waits send the rest."""
        self.wait_all()
        self.rounds += 1
        self._waited = 0
        self._active = True
        self._send_through(self.prefetch)

    def _send_through(self, count: int) -> None:
        """Send the first `count` buckets of the forward order (those not yet sent)."""
        while self._sent < min(count, len(self.order)):
            b = self.order[self._sent]
            bucket = self.buckets[b]
            chunk = self.flat.params[bucket.start : bucket.end]
            self._works[b] = dist.broadcast(chunk, self._source[b], group=self.group, async_op=True)
            self._sent += 1

    def _wait(self, needed: list[int], _module: nn.Module, _args: tuple) -> None:
        if not self._active:
            return
        for b in needed:
            # Every rank sends in the same order whichever module asks first: collectives match.
            self._send_through(self._place[b] + 1 + self.prefetch)
            work = self._works.pop(b, None)
            if work is not None:
                with record_function("meshtrain.gather"):
                    work.wait()
                self._waited += 1
        if self._sent == len(self.order) and not self._works:
            self._active = False
            self.rounds_in_forward += self._waited == len(self.order)

    def wait_all(self) -> None:
        """Every bucket's new values in place (before reading the parameters elsewhere)."""
        if self._active:
            self._send_through(len(self.order))
        with record_function("meshtrain.gather"):
            for work in self._works.values():
                work.wait()
        self._works.clear()
        self._active = False
        self._sent = 0
