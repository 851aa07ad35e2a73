"""One batch of training tokens: the ids, what each position must predict, and where each
packed example starts.

Pretraining blocks are one stream of documents: every position predicts the next token.
Fine-tuning blocks hold whole examples packed side by side (`data/bfd.py`): a
position is trained only when the next token belongs to the same example and is one the
run learns (`data.loss_on`), and positions restart at each example so attention can be
kept inside it (`models/packed_attention.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

IGNORE_INDEX = -100
"""The label of a position that trains nothing (cross-entropy's `ignore_index`)."""


def next_token_labels(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Position t's target is token t+1, kept only where t+1 continues t's example and is
    trained; the last position of a row has no target."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    keep = torch.ones_like(input_ids[:, 1:], dtype=torch.bool)
    if loss_mask is not None:
        keep &= loss_mask[:, 1:].bool()
    if position_ids is not None:
        keep &= position_ids[:, 1:] != 0  # the next token starts another example
    labels[:, :-1].masked_fill_(~keep, IGNORE_INDEX)
    return labels


def example_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which packed example each position belongs to, numbered from 1 along each row."""
    return (position_ids == 0).cumsum(dim=1)


class BlockRows(Protocol):
    """A table with one row per block: a tensor, or rows memory-mapped from a file."""

    def __getitem__(self, indices: list[int]) -> torch.Tensor: ...


@dataclass(frozen=True)
class TokenBatch:
    """What one forward needs: ids, targets and, for packed examples, their positions."""

    input_ids: torch.Tensor  # (batch, sequence)
    labels: torch.Tensor  # (batch, sequence): next-token targets, IGNORE_INDEX elsewhere
    position_ids: torch.Tensor | None = None  # restart at 0 per example; None: one per row
    real_tokens: int | None = None  # tokens that are not padding; None: all of them
    # DPO: the reference's log-probability of each label (batch, sequence), computed before
    # training (training.dpo.reference=precompute), or by the reference's own pass over
    # the batch under pipeline parallelism.
    reference_logps: torch.Tensor | None = None

    @classmethod
    def of_ids(cls, input_ids: torch.Tensor) -> TokenBatch:
        """A batch of pretraining blocks: every next token is a target."""
        return cls(input_ids, next_token_labels(input_ids))

    @property
    def trained_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def num_real_tokens(self) -> int:
        return self.input_ids.numel() if self.real_tokens is None else self.real_tokens

    def with_reference(self, table: BlockRows | None, indices: list[int]) -> TokenBatch:
        """The batch of blocks `indices` with their rows of `table`, precomputed reference
        log-probabilities (None: the batch as it is)."""
        if table is None:
            return self
        return dataclasses.replace(self, reference_logps=table[indices])

    def rows(self, index: torch.Tensor) -> TokenBatch:
        """The rows `index` of every tensor: a pipeline microbatch, to score (its count of
        real tokens is not kept)."""
        return TokenBatch(
            self.input_ids[index],
            self.labels[index],
            None if self.position_ids is None else self.position_ids[index],
            None,
            None if self.reference_logps is None else self.reference_logps[index],
        )

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(
            self.input_ids.to(device, non_blocking=True),
            self.labels.to(device, non_blocking=True),
            None if self.position_ids is None else self.position_ids.to(device),
            self.real_tokens,
            None if self.reference_logps is None else self.reference_logps.to(device),
        )
