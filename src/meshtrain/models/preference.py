"""A DPO step's forwards: the policy's token log-probabilities with their graph, the
reference's without, and the loss and metrics of the microbatch's pairs
(`models/preference_loss.py`).

The reference is what `training.dpo.reference` resolved to: a frozen copy of the starting
weights laid out like the policy (`model`), the same model with its LoRA adapters off
(`base`), or log-probabilities computed before training and carried by the batch
(`precompute`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshtrain.config_dpo import DpoSettings
from meshtrain.data.batch import TokenBatch
from meshtrain.models.lora import adapters_disabled
from meshtrain.models.packed_attention import attention_inputs
from meshtrain.models.preference_loss import count_pairs, pair_index, pair_sums, preference_terms


class ParallelModel(Protocol):
    """What scoring tokens needs of a `parallel_model.ParallelModel`."""

    modules: list[nn.Module]
    autocast: Callable[[], AbstractContextManager]


def as_local(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as a plain tensor (plain tensors pass through)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


@dataclass
class PreferenceObjective:
    settings: DpoSettings
    reference: str  # model, base or precompute (`DpoSettings.resolved_reference`)
    reference_model: ParallelModel | None = None  # reference=model's frozen copy

    def values(self, pm: ParallelModel, batch: TokenBatch) -> torch.Tensor:
        """The microbatch's summed `METRICS` (the loss first, with its graph)."""
        slots, pairs = pair_index(batch.position_ids)
        # The reference first: its forward's working set then comes before the policy's
        # saved activations, not on top of them (it draws no dropout, so the order does
        # not change the policy's masks).
        with torch.no_grad():
            reference = self.reference_logps(pm, batch)
        policy = token_logps(pm, batch)
        return preference_terms(
            self.settings,
            pair_sums(policy, batch.labels, slots, pairs),
            pair_sums(reference, batch.labels, slots, pairs),
        )

    def reference_logps(self, pm: ParallelModel, batch: TokenBatch) -> torch.Tensor:
        """The reference's (batch, sequence) token log-probabilities."""
        if self.reference == "precompute":
            if batch.reference_logps is None:
                raise ValueError("reference=precompute but the batch carries no reference")
            return batch.reference_logps
        if self.reference == "base":
            return token_logps(pm, batch, adapters_disabled(pm.modules))
        return token_logps(self.reference_model, batch)

    @staticmethod
    def units(batch: TokenBatch) -> int:
        """The pairs of a batch: what the step's mean is over."""
        return count_pairs(batch.position_ids, batch.labels)


def token_logps(
    pm: ParallelModel, batch: TokenBatch, around: AbstractContextManager | None = None
) -> torch.Tensor:
    """`pm`'s (batch, sequence) log-probability of each label, 0 where none."""
    with around or nullcontext(), pm.autocast():
        logps = pm.modules[0](
            batch.input_ids, batch.labels, per_token=True, **attention_inputs(batch)
        )
    return as_local(logps)
