"""The deterministic global sampler behind the layout-independence invariant.

The sample order is a function of (seed, global batch size) only. Step `s`
consumes global positions `s*G .. s*G+G-1` of an endless stream made of one
seeded permutation of the training blocks per epoch. A layout only decides
how a step's `G` samples are cut up: each data-parallel rank takes a
contiguous slice of `G/dp`, and cuts it into accumulation microbatches. The
union, in order, is the same for every layout, so the loss (a mean over the
global batch) is too.
"""

from __future__ import annotations

import torch


class GlobalBatchSampler:
    """Global sample indices per step, and each rank's share of them."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError("the training split has no blocks")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._epoch_cache: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        perm = self._epoch_cache.get(epoch)
        if perm is None:
            # Distinct streams per (seed, epoch): seed s's epoch 1 is not seed s+1's epoch 0.
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.num_samples, generator=generator)
            self._epoch_cache = {epoch: perm}  # steps move forward: keep only the current epoch
        return perm

    def global_indices(self, step: int) -> list[int]:
        """The `G` sample indices of optimizer step `step`, in order."""
        start = step * self.global_batch_size
        indices = []
        for position in range(start, start + self.global_batch_size):
            epoch, offset = divmod(position, self.num_samples)
            indices.append(int(self._permutation(epoch)[offset]))
        return indices

    def rank_microbatches(
        self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int
    ) -> list[list[int]]:
        """Rank `dp_rank`'s slice of step `step`, cut into microbatches of `micro_batch_size`."""
        per_rank, remainder = divmod(self.global_batch_size, dp_size)
        if remainder or per_rank % micro_batch_size:
            raise ValueError(
                f"global batch {self.global_batch_size} does not split into {dp_size} ranks "
                f"of microbatches of {micro_batch_size}"
            )
        mine = self.global_indices(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        return [mine[i : i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]

    def epoch_of(self, step: int) -> float:
        """Fractional epochs consumed after `step` steps, for logging."""
        return step * self.global_batch_size / self.num_samples
