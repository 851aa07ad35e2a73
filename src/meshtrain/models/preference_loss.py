"""Direct preference optimization's loss over packed pairs, with TRL's metrics.

A preference block holds whole pairs side by side: each pair's chosen sequence (prompt
and chosen completion) followed by its rejected one, positions restarting at each
(`data/preference.py`), so attention stays inside each sequence and a pair is always in
one microbatch. A sequence's log-probability is the sum of its trained (completion)
tokens'; the loss compares the policy's chosen-minus-rejected margin with the
reference's (`training.dpo`, TRL's `DPOTrainer` formulas). What a microbatch returns are
sums over its pairs; the run divides them by the global batch's pairs, so every pair
weighs the same whatever the layout, as the language-model loss does with tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshtrain.config_dpo import DpoSettings
from meshtrain.data.batch import IGNORE_INDEX, example_ids

# What a preference step reports, in the order of the vector it sums (TRL's names).
METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@dataclass(frozen=True)
class PairSums:
    """Per pair of a microbatch: summed log-probabilities and trained tokens, chosen and
    rejected (each a tensor of one value per pair)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def pair_index(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each position's slot `2 * pair + role` (role 0 chosen, 1 rejected), pairs numbered
    over the whole microbatch, and the number of pair slots (a row's padding tail makes a
    slot with no trained token, dropped by `pair_sums`)."""
    sequence = example_ids(position_ids) - 1  # 0-based within each row
    per_row = int(sequence.max()) // 2 + 1
    rows = torch.arange(position_ids.shape[0], device=position_ids.device).unsqueeze(1)
    return rows * (2 * per_row) + sequence, position_ids.shape[0] * per_row


def sequence_sums(
    token_logps: torch.Tensor, labels: torch.Tensor, slots: torch.Tensor, pairs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (pairs, 2) summed log-probabilities and trained tokens of each pair slot's
    chosen and rejected sequence (of this rank's tokens, under context parallelism)."""
    trained = (labels != IGNORE_INDEX).flatten()
    index = slots.flatten()
    sums = token_logps.new_zeros(2 * pairs).index_add(0, index, token_logps.flatten() * trained)
    counts = torch.zeros(2 * pairs, device=labels.device).index_add_(0, index, trained.float())
    return sums.view(pairs, 2), counts.view(pairs, 2)


def real_pairs(sums: torch.Tensor, counts: torch.Tensor) -> PairSums:
    """The slots whose chosen and rejected both have trained tokens (not a block's
    padding), as pairs."""
    real = (counts > 0).all(dim=1)
    return PairSums(sums[real, 0], sums[real, 1], counts[real, 0], counts[real, 1])


def pair_sums(
    token_logps: torch.Tensor, labels: torch.Tensor, slots: torch.Tensor, pairs: int
) -> PairSums:
    """Sum the (batch, sequence) log-probabilities per sequence; pairs whose chosen or
    rejected has no trained token (a block's padding) are left out."""
    return real_pairs(*sequence_sums(token_logps, labels, slots, pairs))


def preference_terms(settings: DpoSettings, policy: PairSums, reference: PairSums) -> torch.Tensor:
    """The vector of `METRICS`, each summed over the microbatch's pairs."""
    beta, smoothing = settings.beta, settings.label_smoothing
    chosen_ratio = policy.chosen - reference.chosen
    rejected_ratio = policy.rejected - reference.rejected
    delta = chosen_ratio - rejected_ratio
    if settings.loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif settings.loss_type == "ipo":
        # Normalised by the completions' lengths, as TRL does.
        per_token = chosen_ratio / policy.chosen_tokens - rejected_ratio / policy.rejected_tokens
        losses = (per_token - 1 / (2 * beta)) ** 2
    else:  # robust
        clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
        flipped = -smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * smoothing)
    chosen_reward = beta * chosen_ratio.detach()
    rejected_reward = beta * rejected_ratio.detach()
    return torch.stack(
        [
            losses.sum(),
            chosen_reward.sum(),
            rejected_reward.sum(),
            (chosen_reward > rejected_reward).float().sum(),
            (chosen_reward - rejected_reward).sum(),
            policy.chosen.detach().sum(),
            policy.rejected.detach().sum(),
        ]
    )


def count_pairs(position_ids: torch.Tensor, labels: torch.Tensor) -> int:
    """The pairs of a microbatch (the denominator's share)."""
    slots, pairs = pair_index(position_ids)
    zeros = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    return len(pair_sums(zeros, labels, slots, pairs).chosen)
