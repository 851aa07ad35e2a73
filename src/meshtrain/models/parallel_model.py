"""One rank's share of a parallelised model, as the training loop sees it.

`ParallelModel` hides which parallelisms are on: the loop asks it to run a
batch forward and backward, or forward only, and gets the loss. How a
particular architecture is cut up to make one is its own `parallelize.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import record_function
from transformers import PretrainedConfig

from meshtrain.config import Layout
from meshtrain.data.batch import TokenBatch
from meshtrain.distributed.context_parallel import ContextParallel
from meshtrain.distributed.flat_buffer import collect_assigned_grads
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.pipeline_parallel import PipelineRunner, SharedWeightSync
from meshtrain.distributed.tensor_parallel import (
    ParameterSharding,
    TensorParallelGradSync,
    as_local,
)
from meshtrain.models.packed_attention import attention_inputs
from meshtrain.models.preference import PreferenceObjective, token_logps
from meshtrain.models.routing import Routing


@dataclass(kw_only=True)
class ParallelModel:
    modules: list[nn.Module]  # this rank's stages (one module without pipeline parallelism)
    parameters: dict[str, torch.Tensor]  # Hugging Face name -> parameter (maybe a DTensor)
    sharding: dict[str, ParameterSharding]
    hf_config: PretrainedConfig
    dims: ParallelDims
    layout: Layout
    autocast: Callable[[], AbstractContextManager]
    tp_sync: TensorParallelGradSync | None = None  # tensor parallelism's partial gradients
    runner: PipelineRunner | None = None  # the pipeline schedule over this rank's stages
    offload: Callable[[], AbstractContextManager] = nullcontext
    # Tied embeddings over pipeline stages: the copies' gradient sum, and on the last stage
    # the name of its copy -> the name the checkpoint stores the one weight under.
    shared_sync: SharedWeightSync | None = None
    tied_copies: dict[str, str] = field(default_factory=dict)
    # This rank's share of every sequence under context parallelism (None: off).
    context: ContextParallel | None = None
    # A mixture of experts' routing: its load-balancing loss and tokens per expert.
    routing: Routing | None = None
    # training.objective=dpo: the pairs' loss and metrics instead of the tokens' loss.
    preference: PreferenceObjective | None = None

    def use_routing(self, routing: Routing | None) -> None:
        """A mixture of experts' routing: the whole model's forward scores it, or each
        pipeline stage tallies it and the schedule's loss scores it."""
        self.routing = routing
        if routing is not None and self.runner is not None:
            self.runner.use_routing(routing)

    def use_preference(self, preference: PreferenceObjective | None) -> None:
        """DPO's objective instead of the tokens' loss (under pipeline parallelism the
        schedules score per-token log-probabilities)."""
        self.preference = preference
        if preference is not None and self.runner is not None:
            preference.use_pipeline(self)

    def loss_context(self) -> AbstractContextManager:
        # The unchunked cross-entropy on vocabulary-sharded logits: the full logits never
        # exist on one rank (the chunked loss combines the shards itself).
        return loss_parallel() if self.dims.tp > 1 else nullcontext()

    def set_training(self, training: bool) -> None:
        for module in self.modules:
            module.train(training)

    def train_batch(self, batch: TokenBatch, trained_tokens: int) -> torch.Tensor:
        """Forward and backward; returns the batch's summed loss / `trained_tokens` (those
        of the whole global batch), so the ranks' and microbatches' values add up to the
        step's mean loss.

        The backward runs on that value times dp x cp: data parallelism averages gradients
        over the ranks that hold a copy of the parameters, and the mean over the global
        batch's tokens wants their sum. Under context parallelism each rank scores its
        share of the batch's tokens. Under pipeline parallelism only the last stage knows
        the loss (0 elsewhere).
        """
        batch = self.own_tokens(batch)
        with self.loss_context(), self.offload():
            if self.runner is not None:
                with self.autocast(), record_function("meshtrain.pipeline"):
                    batch = self._pipeline_reference(batch)
                    return self.runner.train_step(batch, trained_tokens, self.dims.dp_cp)
            with record_function("meshtrain.forward"):
                loss, objective = self._objective(batch, trained_tokens)
            with record_function("meshtrain.backward"):
                (objective * self.dims.dp_cp).backward()
        return as_local(loss.detach())

    def _objective(
        self, batch: TokenBatch, trained_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's share of the step's language-model loss, and what the backward
        takes: that, plus a mixture of experts' load-balancing term where it is on. Under
        DPO, the batch's share of each of the step's `preference_loss.METRICS` (the loss
        first), the loss alone to the backward."""
        if self.preference is not None:
            # Every cp rank scores the same pairs: the reported values count once.
            values = self.preference.values(self, batch) / trained_tokens
            return values / self.dims.cp, values[0]
        if self.routing is None:
            loss = self._loss_sum(batch) / trained_tokens
            return loss, loss
        with self.routing.collecting() as logits:
            loss = self._loss_sum(batch) / trained_tokens
        term = self.routing.finish_forward(logits)
        return loss, loss if term is None else loss + term

    def _pipeline_reference(self, batch: TokenBatch) -> TokenBatch:
        """Under DPO, the batch with its reference's log-probabilities (the pipeline's last
        stage scores each microbatch's pairs with them)."""
        return batch if self.preference is None else self.preference.with_reference(self, batch)

    @torch.no_grad()
    def token_logps(self, batch: TokenBatch) -> torch.Tensor:
        """Each label's log-probability, forward only (this rank's tokens under cp; zeros
        off the last pipeline stage): the precomputed reference's pass."""
        batch = self.own_tokens(batch)
        if self.runner is None:
            return token_logps(self, batch)
        with self.autocast():
            return self.runner.token_logps(batch)

    def own_tokens(self, batch: TokenBatch) -> TokenBatch:
        """This rank's share of the batch's tokens (all of them without cp)."""
        return batch if self.context is None else self.context.shard(batch)

    def _loss_sum(self, batch: TokenBatch) -> torch.Tensor:
        # Under cp the model builds its view of the whole sequence from the positions.
        inputs = (
            attention_inputs(batch)
            if self.context is None
            else {"position_ids": batch.position_ids}
        )
        with self.autocast():
            loss = self.modules[0](batch.input_ids, batch.labels, **inputs)
        return as_local(loss)

    @torch.no_grad()
    def eval_batch(self, batch: TokenBatch) -> torch.Tensor:
        """Summed loss over the batch's trained tokens, forward only (0 off the last
        pipeline stage; this rank's share of them under cp)."""
        batch = self.own_tokens(batch)
        with self.loss_context(), self.autocast():
            if self.runner is not None:
                return self.runner.eval_step(self._pipeline_reference(batch))
            if self.preference is not None:
                return self.preference.values(self, batch) / self.dims.cp
            return as_local(self._loss_sum(batch))

    def units(self, batch: TokenBatch) -> int:
        """What a step's loss is a mean over: the batch's trained tokens, or its pairs
        under DPO."""
        if self.preference is not None:
            return self.preference.units(batch)
        return batch.trained_tokens

    @property
    def backward_passes_per_batch(self) -> int:
        """How often one `train_batch` accumulates into each gradient."""
        return self.layout.pipeline_parallel_num_microbatches if self.runner else 1

    @property
    def gradients_finished_after_backward(self) -> frozenset[str]:
        """Parameters whose gradients `finish_gradients` completes (data parallelism waits
        for those before reducing them)."""
        names = frozenset()
        for sync in (self.tp_sync, self.shared_sync):
            if sync is not None:
                names |= sync.parameter_names
        return names

    def finish_gradients(self) -> None:
        """The sums the backward leaves to do: tensor parallelism's partial gradients, then
        the tied embedding's two copies (after a zero-bubble schedule's weight passes put
        what they assigned where the accumulated gradients are)."""
        if self.runner is not None and self.runner.splits_backward:
            collect_assigned_grads(self.parameters.values())
        if self.tp_sync is not None:
            self.tp_sync()
        if self.shared_sync is not None:
            self.shared_sync()
