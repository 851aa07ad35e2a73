"""Attention kept inside each packed example.

Fine-tuning blocks hold several examples side by side; positions restart at 0 where an
example starts. The mask is causal within an example and blocks every pair across two
(block-diagonal causal), so a packed example's logits are exactly those it has alone.
On CPU sdpa takes the boolean mask as is (exact); pretraining blocks pass no mask and
keep sdpa's causal fast path.
"""

from __future__ import annotations

import torch

from meshtrain.data.batch import TokenBatch, example_ids


def attention_inputs(batch: TokenBatch) -> dict[str, torch.Tensor | None]:
    """The positions and mask of packed examples (none for a pretraining block)."""
    if batch.position_ids is None:
        return {}
    return {
        "position_ids": batch.position_ids,
        "attention_mask": packed_causal_mask(batch.position_ids),
    }


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """A (batch, 1, sequence, sequence) boolean mask, True where a query may attend a key:
    same example, key not after the query."""
    length = position_ids.shape[1]
    examples = example_ids(position_ids)
    same = examples[:, :, None] == examples[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)
