"""A DPO run's evaluation: how often the trained model prefers the chosen answer of each
validation pair more than its reference does, and by how much (TRL's reward accuracy and
margin), computed with plain `transformers` models as users load them.

The policy is the consolidated model; the reference is the run's starting model
(`model.init_from`), which training kept frozen (or, under LoRA, the adapters' base).
Blocks of pairs are scored as training scores them: each sequence attends only to
itself, and a sequence's log-probability is the sum over its completion tokens.
"""

from __future__ import annotations

from typing import Any

import datasets
import torch

from meshtrain.config_dpo import DpoSettings
from meshtrain.data.batch import TokenBatch
from meshtrain.models.packed_attention import attention_inputs
from meshtrain.models.preference_loss import METRICS, pair_index, pair_sums, preference_terms
from meshtrain.models.token_logps import linear_token_logps
from meshtrain.planner.loss_memory import auto_loss_chunk_tokens


def model_token_logps(model: Any, batch: TokenBatch) -> torch.Tensor:
    """Each label's log-probability under a Hugging Face causal LM, chunk by chunk."""
    device = model.get_input_embeddings().weight.device
    batch = batch.to(device)
    hidden = model.get_decoder()(
        input_ids=batch.input_ids, **attention_inputs(batch), use_cache=False
    ).last_hidden_state
    head = model.get_output_embeddings().weight
    chunk = auto_loss_chunk_tokens(head.shape[0], 1, batch.input_ids.numel())
    return linear_token_logps(hidden, head, batch.labels, chunk)


@torch.no_grad()
def preference_metrics(
    model: Any, reference: Any, batches: list[TokenBatch], settings: DpoSettings
) -> dict[str, float]:
    """`val_preference_accuracy` (pairs whose chosen reward beats the rejected one's),
    `val_reward_margin` (their mean difference) and the DPO loss over `batches`."""
    totals, pairs = torch.zeros(len(METRICS), dtype=torch.float64), 0
    for batch in batches:
        slots, count = pair_index(batch.position_ids)
        policy = pair_sums(model_token_logps(model, batch).cpu(), batch.labels, slots, count)
        fixed = pair_sums(model_token_logps(reference, batch).cpu(), batch.labels, slots, count)
        totals += preference_terms(settings, policy, fixed).double()
        pairs += len(policy.chosen)
    if pairs == 0:
        raise ValueError("the validation blocks hold no pair; raise data.validation_fraction")
    means = dict(zip(METRICS, (totals / pairs).tolist(), strict=True))
    return {
        "val_preference_accuracy": means["rewards/accuracies"],
        "val_reward_margin": means["rewards/margins"],
        "val_dpo_loss": means["loss"],
        "val_pairs": pairs,
    }


def validation_batches(
    validation: datasets.Dataset, batch_size: int, max_batches: int | None
) -> list[TokenBatch]:
    """The validation blocks the evaluation scores, as batches."""
    from meshtrain.evaluation import token_batches  # noqa: PLC0415

    count = (
        len(validation) if max_batches is None else min(len(validation), max_batches * batch_size)
    )
    return list(token_batches(validation, batch_size, count))
