"""A DPO step's forwards: the policy's token log-probabilities with their graph, the
reference's without, and the loss and metrics of the microbatch's pairs
(`models/preference_loss.py`).

The reference is what `training.dpo.reference` resolved to: a frozen copy of the starting
weights laid out like the policy (`model`), the same model with its LoRA adapters off
(`base`), or log-probabilities computed before training and carried by the batch
(`precompute`).

Under pipeline parallelism the reference's log-probabilities come first, from a
forward-only pass of its own schedule over the whole batch (the frozen copy's, or a twin
of the policy's with the adapters off); the policy's schedule then scores each microbatch
on its last stage (`microbatch_values`, the runner's `MicrobatchScorer`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.config_dpo import DpoSettings
from meshtrain.data.batch import TokenBatch
from meshtrain.distributed.context_parallel import ContextParallel, gather_sequence
from meshtrain.distributed.pipeline_parallel import PipelineRunner
from meshtrain.distributed.tensor_parallel import as_local
from meshtrain.models.lora import adapters_disabled
from meshtrain.models.packed_attention import attention_inputs
from meshtrain.models.preference_loss import (
    METRICS,
    PairSums,
    count_pairs,
    pair_index,
    preference_terms,
    real_pairs,
    sequence_sums,
)


class ScoresTokens(Protocol):
    """What scoring tokens needs of a `parallel_model.ParallelModel` (which imports this
    module)."""

    modules: list[nn.Module]
    autocast: Callable[[], AbstractContextManager]
    context: ContextParallel | None
    runner: PipelineRunner | None


@dataclass
class PreferenceObjective:
    settings: DpoSettings
    reference: str  # model, base or precompute (`DpoSettings.resolved_reference`)
    reference_model: ScoresTokens | None = None  # reference=model's frozen copy
    # reference=base under pipeline parallelism: a twin of the policy's schedule.
    reference_runner: PipelineRunner | None = None

    def values(self, pm: ScoresTokens, batch: TokenBatch) -> torch.Tensor:
        """The microbatch's summed `METRICS` (the loss first, with its graph). Under
        context parallelism `batch` is this rank's share of the tokens: each sequence's
        sums add up over the cp ranks, and every cp rank scores the same pairs."""
        # The reference first: its forward's working set then comes before the policy's
        # saved activations, not on top of them (it draws no dropout, so the order does
        # not change the policy's masks).
        with torch.no_grad():
            reference = self.reference_logps(pm, batch)
        return self._terms(pm, token_logps(pm, batch), reference, batch)

    def use_pipeline(self, pm: ScoresTokens) -> None:
        """Score `pm`'s pipeline microbatches on their last stage: the policy's schedule
        and the reference's return per-token log-probabilities."""
        pm.runner.score_tokens(functools.partial(self.microbatch_values, pm), len(METRICS))
        if self.reference == "base":
            self.reference_runner = pm.runner.twin()
            self.reference_runner.score_tokens()

    def with_reference(self, pm: ScoresTokens, batch: TokenBatch) -> TokenBatch:
        """Under pipeline parallelism, `batch` with its reference log-probabilities (from
        the reference's own forward-only schedule pass, unless precomputed)."""
        if self.reference == "precompute":
            return batch
        if self.reference == "base":
            with adapters_disabled(pm.modules):
                logps = self.reference_runner.token_logps(batch)
        else:
            logps = self.reference_model.runner.token_logps(batch)
        return dataclasses.replace(batch, reference_logps=logps)

    def microbatch_values(
        self, pm: ScoresTokens, logps: torch.Tensor, microbatch: TokenBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pipeline microbatch's loss (to the backward) and summed `METRICS` (reported:
        every cp rank scores the same pairs, so each reports its share), from the last
        stage's per-token log-probabilities and the batch's reference ones."""
        values = self._terms(pm, logps, microbatch.reference_logps, microbatch)
        return values[0], values / (1 if pm.context is None else pm.context.size)

    def _terms(
        self, pm: ScoresTokens, policy: torch.Tensor, reference: torch.Tensor, batch: TokenBatch
    ) -> torch.Tensor:
        """`METRICS` summed over the batch's pairs, from both models' token log-probs."""
        slots, pairs = self._slots(pm, batch)
        return preference_terms(
            self.settings,
            self._sums(pm, policy, batch, slots, pairs),
            self._sums(pm, reference.detach(), batch, slots, pairs),
        )

    @staticmethod
    def _slots(pm: ScoresTokens, batch: TokenBatch) -> tuple[torch.Tensor, int]:
        """Each of the batch's tokens' pair slot, found on the whole rows."""
        if pm.context is None:
            return pair_index(batch.position_ids)
        whole = gather_sequence(batch.position_ids, pm.context)
        slots, pairs = pair_index(whole)
        mine = pm.context.local_indices(whole.shape[1], whole.device)
        return slots[:, mine], pairs

    @staticmethod
    def _sums(
        pm: ScoresTokens, logps: torch.Tensor, batch: TokenBatch, slots: torch.Tensor, pairs: int
    ) -> PairSums:
        sums, counts = sequence_sums(logps, batch.labels, slots, pairs)
        if pm.context is not None:
            sums = SumOverGroup.apply(sums, pm.context.group)
            dist.all_reduce(counts, group=pm.context.group)
        return real_pairs(sums, counts)

    def reference_logps(self, pm: ScoresTokens, batch: TokenBatch) -> torch.Tensor:
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
    pm: ScoresTokens, batch: TokenBatch, around: AbstractContextManager | None = None
) -> torch.Tensor:
    """`pm`'s (batch, sequence) log-probability of each label, 0 where none (this rank's
    tokens under context parallelism, whose attention rebuilds the rows from positions)."""
    inputs = attention_inputs(batch) if pm.context is None else {"position_ids": batch.position_ids}
    with around or nullcontext(), pm.autocast():
        logps = pm.modules[0](batch.input_ids, batch.labels, per_token=True, **inputs)
    return as_local(logps)


class SumOverGroup(torch.autograd.Function):
    """The sum over a group's ranks, whose gradient passes through unchanged: each rank
    then scores the same pairs, and the backward gives each its own tokens' share (the
    data-parallel average over the ranks, scaled back by dp x cp, adds the shares)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        total = local.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205 (autograd's signature)
        return grad, None
