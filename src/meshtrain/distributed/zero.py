"""AdamW over the flat parameter buffer, with ZeRO-1 sharding of its state.

torch's `ZeroRedundancyOptimizer` refuses DTensor parameters, and the
tensor-parallel layouts need exactly that, so meshtrain shards the optimizer
itself. The flat buffer (see `flat_buffer`) is cut into `dp` equal ranges;
with ZeRO-1 each data-parallel rank

1. receives the mean of the gradients over its range only (bucket-wise
   reductions to the owner, overlapped with the backward: `data_parallel`),
2. updates its range with AdamW, holding moments for that range alone,
3. all-gathers the updated ranges so every rank has the whole model again:
   given the modules (`gather_modules`), bucket by bucket in forward order,
   each waited for by the first module that reads it (`param_gather`), so
   the gather runs under the next step's forward.

Without ZeRO-1 the range is the whole buffer and step 1 is an all-reduce.
AdamW is elementwise, so updating a slice is the same arithmetic as updating
the parameters one by one, which is why ZeRO-1 reproduces one process.

With `master_weights` (bf16 parameters) the optimizer keeps an fp32 copy of
its owned range: AdamW updates that copy with the fp32 gradients (copied up
from bf16 ones if the reduction ran in bf16), the bf16 parameters are the
copy rounded, and only those bf16 values are all-gathered. That is the
Megatron / optimum-neuron "master weights" recipe: 2 bytes of parameter and
4 of gradient per element on every rank, 12 (master, two moments) split over
dp by ZeRO-1.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.distributed.data_parallel import GradientReducer
from meshtrain.distributed.flat_buffer import FlatParameters, Slot
from meshtrain.distributed.grad_norm import clip_gradients_, global_grad_norm
from meshtrain.distributed.param_gather import ParameterGather


class ShardedAdamW:
    def __init__(
        self,
        flat: FlatParameters,
        group: dist.ProcessGroup | None,
        *,
        zero_1: bool,
        norm_groups: tuple[dist.ProcessGroup, ...] = (),
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        max_grad_norm: float,
        overlap_reduction: bool,
        bucket_bytes: int,
        backward_passes: int = 1,
        reduce_after_backward: Collection[str] = (),
        master_weights: bool = False,
        gather_modules: Iterable[nn.Module] | None = None,
        mean_over: int | None = None,
    ) -> None:
        """`backward_passes`: how often a step's backward accumulates into each gradient
        (microbatches, accumulation steps): its bucket is reduced after the last;
        `reduce_after_backward`: names of parameters whose gradients are completed
        after the backward (tensor parallelism's sums) and so reduced after it;
        `master_weights`: keep and update an fp32 copy of the owned range (bf16 parameters);
        `gather_modules`: the modules holding `flat`'s parameters, to overlap ZeRO-1's
        parameter gather with their next forward (None: gather right after the update);
        `mean_over`: the ranks the summed gradients are a mean over (default: `group`'s)."""
        self.flat = flat
        self.group = group
        self.zero_1 = zero_1
        self.norm_groups = norm_groups
        self.max_grad_norm = max_grad_norm
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        owned_ranges = None
        if zero_1:
            per_rank = flat.padded_numel // size
            owned_ranges = [(r * per_rank, (r + 1) * per_rank) for r in range(size)]
            self.start, self.end = owned_ranges[rank]
        else:
            self.start, self.end = 0, flat.padded_numel
        # The averaged gradients of the owned range: where the reductions leave them.
        self.grad_shard = flat.grads[self.start : self.end]
        self.reducer = GradientReducer(
            flat,
            group,
            owned_ranges=owned_ranges,
            bucket_bytes=bucket_bytes,
            overlap=overlap_reduction,
            deferred_names=reduce_after_backward,
            mean_over=mean_over,
        )
        self.backward_passes = backward_passes
        self.reducer.expect(backward_passes)
        self.gather = None
        if zero_1 and size > 1 and gather_modules is not None:
            self.gather = ParameterGather(flat, group, self.reducer.buckets, gather_modules)

        # What AdamW updates: the owned range of the parameters themselves, or its fp32
        # master copy; and the fp32 gradients it reads (a copy when they were reduced in
        # bf16, else the reduced range itself).
        owned = flat.params[self.start : self.end]
        self.master = owned.float() if master_weights else None
        self.state_dtype = torch.float32 if master_weights else flat.params.dtype
        updated = owned if self.master is None else self.master
        self.master_grad = (
            self.grad_shard
            if self.grad_shard.dtype == self.state_dtype
            else torch.zeros_like(self.grad_shard, dtype=self.state_dtype)
        )
        groups = self._owned_runs(updated, weight_decay)
        # Fused: one kernel over each owned run instead of a dozen elementwise passes.
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)

    def _owned_runs(self, updated: torch.Tensor, weight_decay: float) -> list[dict]:
        """AdamW's parameter groups: the owned range cut where the flat buffer's runs change
        (weight decay or not, tp copies), each a view of `updated` with its gradient view;
        padding is never updated. Also each run's weight in the gradient norm."""
        groups = []
        self._norm_pieces: list[tuple[int, int, float]] = []
        for run in self.flat.runs:
            lo, hi = max(self.start, run.start), min(self.end, run.end)
            if hi <= lo:
                continue
            master = updated[lo - self.start : hi - self.start]
            master.grad = self.master_grad[lo - self.start : hi - self.start]
            decay = weight_decay if run.weight_decay else 0.0
            groups.append({"params": [master], "weight_decay": decay, "range": (lo, hi)})
            self._norm_pieces.append((lo - self.start, hi - self.start, 1.0 / run.copies))
        return groups

    @property
    def owned_numel(self) -> int:
        return self.end - self.start

    @property
    def state_bytes(self) -> int:
        """What this optimizer holds beyond the flat buffers: AdamW's two moments of the
        owned range, and the fp32 master weights (and gradient copy) where there are any."""
        held = 2 * self.owned_numel * self.state_dtype.itemsize
        if self.master is not None:
            held += self.master.nbytes
        if self.master_grad is not self.grad_shard:
            held += self.master_grad.nbytes
        return held

    @property
    def model_states_bytes(self) -> int:
        """Parameters, gradients and this rank's optimizer states, in bytes."""
        return self.flat.params.nbytes + self.flat.grads.nbytes + self.state_bytes

    def held_tensors(self) -> list[torch.Tensor]:
        """What lives through a step beyond the modules' parameters: the flat gradient
        buffer (the gradient shard is a view of it), the fp32 master weights and gradients
        where the parameters are bf16, and AdamW's states."""
        tensors = [self.flat.params, self.flat.grads]
        if self.master is not None:
            tensors.append(self.master)
        if self.master_grad is not self.grad_shard:
            tensors.append(self.master_grad)
        for state in self.optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return tensors

    def zero_grad(self) -> None:
        """Clear the gradients and arm the bucket reductions for the next step's backward."""
        self.flat.zero_grad()
        self.reducer.expect(self.backward_passes)

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def check_views(self) -> None:
        self.flat.check_views()

    def bucket_summary(self) -> dict[str, int]:
        summary = {
            "count": len(self.reducer.buckets),
            "started_in_backward": self.reducer.started_in_backward,
        }
        if self.gather is not None:
            summary["gather_rounds"] = self.gather.rounds
            summary["gather_rounds_in_forward"] = self.gather.rounds_in_forward
        return summary

    def wait_for_parameters(self) -> None:
        """Every parameter holds its updated value: the overlapped gather has arrived.
        Call before reading the parameters other than through the modules' forward."""
        if self.gather is not None:
            self.gather.wait_all()

    def reduce_gradients(self) -> torch.Tensor:
        """The first half of an optimizer step: finish averaging the gradients (into the
        fp32 copy where they were reduced in bf16); returns their global norm. Nothing is
        updated yet, so a caller can still refuse the step (a non-finite norm)."""
        self.reducer.finish(self.grad_shard)
        if self.master_grad is not self.grad_shard:
            self.master_grad.copy_(self.grad_shard)
        return self.global_grad_norm()

    def apply(self, norm: torch.Tensor) -> None:
        """The second half of an optimizer step: clip to `norm`'s budget, update the owned
        range, and all-gather it under ZeRO-1 (overlapped: only started)."""
        self.wait_for_parameters()  # the last gather still reads the owned range
        clip_gradients_([self.master_grad], self.max_grad_norm, norm)
        self.optimizer.step()
        if self.master is not None:
            self.flat.params[self.start : self.end].copy_(self.master)
        if self.gather is not None:
            self.gather.start()
        elif self.zero_1 and self.reducer.size > 1:
            # The owned range is its own chunk of the output: gathered in place.
            owned = self.flat.params[self.start : self.end]
            dist.all_gather_single(self.flat.params, owned, group=self.group)

    def full_master(self, slot: Slot) -> torch.Tensor | None:
        """The fp32 master values of one parameter (`slot` of the flat buffer), whole, on dp
        rank 0 and None elsewhere. Collective over the dp group under ZeRO-1 (the owners of
        its elements send them to rank 0, one tensor at a time); otherwise every rank holds
        them and this is a view."""
        if self.master is None:
            raise ValueError("no master weights: the parameters are their own (not bf16_master)")
        return self.gather_slot(self.master, slot)

    def gather_slot(self, owned: torch.Tensor, slot: Slot) -> torch.Tensor | None:
        """One parameter's (`slot`'s) values of `owned`, a tensor over this rank's owned range
        (the master weights, a moment), whole, on dp rank 0 and None elsewhere: as
        `full_master` gathers the masters."""
        a, b = slot.offset, slot.offset + slot.numel
        if not (self.zero_1 and self.reducer.size > 1):
            return owned[a - self.start : b - self.start].view(slot.shape)
        rank, per_rank = dist.get_rank(self.group), self.owned_numel
        owners = range(a // per_rank, (b - 1) // per_rank + 1)
        if rank == 0:
            full = owned.new_empty(slot.numel)
            for owner in owners:
                lo, hi = max(a, owner * per_rank), min(b, (owner + 1) * per_rank)
                if owner == 0:
                    full[lo - a : hi - a] = owned[lo:hi]
                else:
                    source = dist.get_global_rank(self.group, owner)
                    dist.recv(full[lo - a : hi - a], src=source, group=self.group)
            return full.view(slot.shape)
        if rank in owners:
            lo, hi = max(a, self.start), min(b, self.end)
            part = owned[lo - self.start : hi - self.start]
            dist.send(part, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return None

    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's averaged gradient: the squares of the owned range
        (elements several tp ranks hold weighted down), summed over the dp ranks when
        ZeRO-1 split the range, and over the `norm_groups` (tp, pp)."""
        pieces = ((self.master_grad[lo:hi], weight) for lo, hi, weight in self._norm_pieces)
        groups = ((self.group,) if self.zero_1 and self.group is not None else ()) + tuple(
            self.norm_groups
        )
        return global_grad_norm(pieces, groups, device=self.master_grad.device)

    def moment_pieces(self, key: str) -> list[torch.Tensor]:
        """AdamW's moment `key` ("exp_avg" or "exp_avg_sq") over the whole owned range, as
        pieces in order: the optimizer's own state tensors (no copy), zeros where it holds
        none (padding, or before the first step). Written one after the other they are
        the owned range's moment, so a checkpoint needs no copy of the optimizer."""
        pieces, position = [], self.start
        for group in self.optimizer.param_groups:
            lo, hi = group["range"]
            if lo > position:
                pieces.append(self.master_grad.new_zeros(lo - position))
            state = self.optimizer.state.get(group["params"][0], {})
            moment = state.get(key)
            pieces.append(
                moment.detach() if moment is not None else self.master_grad.new_zeros(hi - lo)
            )
            position = hi
        if self.end > position:
            pieces.append(self.master_grad.new_zeros(self.end - position))
        return pieces

    def step_count(self) -> float:
        """How many updates AdamW has made (0 before the first)."""
        for group in self.optimizer.param_groups:
            state = self.optimizer.state.get(group["params"][0], {})
            if "step" in state:
                return float(state["step"])
        return 0.0

    def load_moments(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float):
        """Install moments for the owned range (as `moment_pieces` lays them out)."""
        if exp_avg.numel() != self.owned_numel or exp_avg_sq.numel() != self.owned_numel:
            raise ValueError("optimizer moments do not cover the owned range")
        for group in self.optimizer.param_groups:
            lo, hi = (x - self.start for x in group["range"])
            self.optimizer.state[group["params"][0]] = {
                "step": torch.tensor(float(step)),
                "exp_avg": exp_avg[lo:hi].to(self.master_grad.device, copy=True),
                "exp_avg_sq": exp_avg_sq[lo:hi].to(self.master_grad.device, copy=True),
            }
