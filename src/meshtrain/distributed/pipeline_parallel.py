"""Pipeline parallelism on `torch.distributed.pipelining`: stages, schedules, one step.

The model is cut into `pp x v` stages of consecutive decoder layers (`v`
stages per rank: `parallel.pipeline_parallel_virtual_stages` for the looped
interleaved schedules, two for the V-shaped ones, else 1); which rank holds
which stage is `meshtrain.pipeline_schedules`'. The schedules themselves are
torch's; this module chooses and drives them. The zero-bubble ones run each
backward as its input-gradient part and, later, its weight-gradient part:
torch assigns the weight gradients without the post-accumulate hooks, so data
parallelism reduces them after the step (`data_parallel.finish`).

A mixture of experts' stages also pass a small tally of its routing along the pipeline
(`models.routing`): the last stage returns (summed loss, tally), and the loss function
adds the load-balancing term the tally gives.

Under DPO the last stage returns each label's log-probability instead, and the loss
function scores the microbatch's pairs (`MicrobatchScorer`): the schedule's target is
the microbatch's row numbers, which pick its labels, positions and reference
log-probabilities out of the batch (`TokenBatch.rows`). A forward-only pass of the same
kind gives the reference's log-probabilities first (`PipelineRunner.token_logps`).

Gradient scaling: torch's `scale_grads` divides the accumulated gradients at
the end of every `step`, which would also shrink what earlier accumulation
steps left there; so it is off, and the loss function divides each
microbatch's summed loss by the global batch's trained tokens itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FULL_BACKWARD,
    RECV_B,
    REDUCE_GRAD,
    SEND_B,
    _PipelineScheduleRuntime,
    get_schedule_class,
)

from meshtrain.data.batch import TokenBatch
from meshtrain.distributed.tensor_parallel import accumulated_grad
from meshtrain.pipeline_schedules import TORCH_NAMES, V_SHAPED, ZERO_BUBBLE

BACKWARD_ACTIONS = (FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, SEND_B, RECV_B, REDUCE_GRAD)
ONE_STAGE = ("gpipe", "1f1b")  # torch's single-stage schedules take the stage, not a list


def stage_layer_ranges(layers_per_stage: list[int]) -> list[range]:
    """Consecutive decoder-layer indices of each stage."""
    ranges, start = [], 0
    for count in layers_per_stage:
        ranges.append(range(start, start + count))
        start += count
    return ranges


class SharedWeightSync:
    """Sums the gradient of a weight the first and the last pipeline stage both hold.

    Tied input and output embeddings: pipeline parallelism puts the embedding
    on the first stage and the LM head on the last, so each of those stages
    keeps a copy (initialised identically, since every rank builds the model
    from the same seed or checkpoint). Each copy's gradient covers one use;
    summing them gives both the tied gradient, so identical updates keep the
    copies equal. Where two ranks hold them, the sum runs over a group of
    exactly those two (one group per (dp, tp) coordinate: Megatron's embedding
    group); every rank must construct it (creating the groups is collective),
    ranks of the middle stages hold no copy and only take part in that. Where
    one rank holds both (a V-shaped schedule puts the first and the last stage
    on pipeline rank 0), it adds them itself.
    """

    def __init__(self, copies: dict[str, torch.Tensor], mesh: DeviceMesh, last_rank: int) -> None:
        """`copies`: this rank's copies by name (none on the middle stages); `last_rank`:
        the pipeline rank of the last stage (that of the first is 0)."""
        self.copies = list(copies.values())
        # Their gradients are final only after this sum (data parallelism waits for it).
        self.parameter_names = frozenset(copies)
        self.group = None
        if last_rank == 0:
            return
        # The mesh is row-major with pp outermost (`ParallelDims`): the first stage's ranks
        # are 0 .. world/pp - 1, the last stage's the same offsets in its block.
        # (Arithmetic, not the mesh tensor: a dry run's tensors are fake.)
        me, per_stage = dist.get_rank(), mesh.size() // mesh["pp"].size()
        last_block = last_rank * per_stage
        for first in range(per_stage):
            last = last_block + first
            group = dist.new_group([first, last])
            if me in (first, last):
                self.group = group

    def __call__(self) -> None:
        if self.group is not None:
            for weight in self.copies:
                dist.all_reduce(accumulated_grad(weight), op=dist.ReduceOp.SUM, group=self.group)
        elif len(self.copies) == 2:
            first, last = (accumulated_grad(weight) for weight in self.copies)
            first.add_(last)
            last.copy_(first)


@dataclass(frozen=True)
class Span:
    """One forward or backward of one microbatch on one stage, in seconds (perf_counter)."""

    stage: int
    microbatch: int
    kind: str  # "forward" | "backward" | "weight" (a zero-bubble schedule's weight gradients)
    start: float
    end: float


class SpanRecorder:
    """Times every forward and backward chunk a stage runs, while `enabled`.

    Wraps the two methods each torch schedule calls on a stage, so the record
    is the schedule's real order and timing on this rank, bubbles included.
    """

    def __init__(self, stages: list[PipelineStage]) -> None:
        self.enabled = False
        self.spans: list[Span] = []
        for stage in stages:
            stage.forward_one_chunk = self._timed(stage, stage.forward_one_chunk, "forward")
            stage.backward_one_chunk = self._timed(stage, stage.backward_one_chunk, "backward")
            stage.backward_weight_one_chunk = self._timed(
                stage, stage.backward_weight_one_chunk, "weight"
            )

    def _timed(self, stage: PipelineStage, method: Callable, kind: str) -> Callable:
        def run(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return method(chunk_id, *args, **kwargs)
            start = time.perf_counter()
            result = method(chunk_id, *args, **kwargs)
            self.spans.append(Span(stage.stage_index, chunk_id, kind, start, time.perf_counter()))
            return result

        return run


def idle_fraction(spans_by_rank: dict[int, list[Span]]) -> dict[int, float]:
    """Per rank, the share of the step's wall window (first start to last end, over all
    ranks) spent outside any forward or backward: the pipeline bubble as measured."""
    everything = [s for spans in spans_by_rank.values() for s in spans]
    if not everything:
        return {}
    window = max(s.end for s in everything) - min(s.start for s in everything)
    return {
        rank: 1.0 - sum(s.end - s.start for s in spans) / window
        for rank, spans in spans_by_rank.items()
    }


def forward_only(
    schedule: Any, stages: list[PipelineStage], microbatches: int, loss_fn: Callable
) -> _PipelineScheduleRuntime:
    """The forwards of `schedule` alone, in its order, over the same stages: torch's
    V-shaped schedules run their backward actions in `eval` too, and the one that hands
    a gradient from the rank's second stage to its first (the V's turn, on one rank)
    fails there. torch lowers (and validates) the whole order to its sends and
    receives; the backward passes and their sends are then left out."""
    runtime = _PipelineScheduleRuntime(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    runtime._prepare_schedule_with_comms(schedule.pipeline_order)
    runtime.pipeline_order_with_comms = {
        rank: [
            part
            for action in actions
            for part in (action.sub_actions or (action,))  # DualPipeV's overlapped F and B
            if part.computation_type not in BACKWARD_ACTIONS
        ]
        for rank, actions in runtime.pipeline_order_with_comms.items()
    }
    return runtime


class TallyScorer(Protocol):
    """What scores a microbatch's routing tally (`models.routing.Routing`)."""

    sparse_layers: list[int]
    experts: int

    def score(
        self, tally: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]: ...

    def record(self, counts: torch.Tensor, loss: torch.Tensor | None) -> None: ...


class MicrobatchScorer(Protocol):
    """What scores a microbatch from the last stage's per-token log-probabilities (DPO:
    `models.preference.PreferenceObjective`)."""

    def __call__(
        self, logps: torch.Tensor, microbatch: TokenBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the backward takes, and the values reported (both summed over the
        microbatch)."""
        ...


class PipelineRunner:
    """Runs one training or evaluation batch through this rank's stages with the schedule."""

    def __init__(
        self,
        stage_modules: list[nn.Module],
        stage_ids: list[int],
        num_stages: int,
        mesh: DeviceMesh,
        device: torch.device,
        *,
        schedule: str,
        num_microbatches: int,
    ) -> None:
        """The last stage's module scores its microbatch itself (it is handed the labels)
        and returns the summed loss, which the schedule's loss function only scales."""
        self._arguments = {
            "stage_modules": stage_modules,
            "stage_ids": stage_ids,
            "num_stages": num_stages,
            "mesh": mesh,
            "device": device,
            "schedule": schedule,
            "num_microbatches": num_microbatches,
        }
        group = mesh.get_group("pp")
        self.stages = [
            PipelineStage(module, stage_id, num_stages, device, group=group)
            for module, stage_id in zip(stage_modules, stage_ids, strict=True)
        ]
        # The weight gradients are assigned by a later pass, not accumulated by autograd.
        self.splits_backward = schedule in ZERO_BUBBLE
        self.holds_first = 0 in stage_ids
        self.holds_last = num_stages - 1 in stage_ids
        self.num_microbatches = num_microbatches
        self.loss_scale = 1.0
        self.data_parallel = 1
        self.training = True
        self.routing: TallyScorer | None = None
        # Per-token outputs: scored by `scorer` (DPO), or kept as they are (`token_logps`).
        self.per_token = False
        self.scorer: MicrobatchScorer | None = None
        self.reported_width = 1  # values reported per microbatch (a vector's length)
        self._batch: TokenBatch | None = None  # the batch the schedule is running
        # Per microbatch scored: its language-model loss, and its routing where scored.
        self._scores: list[tuple[torch.Tensor, tuple[torch.Tensor, Any] | None]] = []
        schedule_class = get_schedule_class(TORCH_NAMES[schedule])
        stages: Any = self.stages[0] if schedule in ONE_STAGE else self.stages
        self.schedule = schedule_class(
            stages, num_microbatches, loss_fn=self._scaled_loss, scale_grads=False
        )
        self._forward_schedule = (
            forward_only(self.schedule, self.stages, num_microbatches, self._scaled_loss)
            if schedule in V_SHAPED
            else self.schedule
        )
        self.recorder = SpanRecorder(self.stages)

    def use_routing(self, routing: TallyScorer) -> None:
        """A mixture of experts: every stage tallies its routing, the loss scores it."""
        self.routing = routing
        for stage in self.stages:
            stage.submod.routing = routing

    def twin(self) -> PipelineRunner:
        """Another schedule over the same stages, for forward-only passes beside this
        one's training steps: torch infers every stage's shapes again at each switch
        between training and evaluation (one more microbatch's work each time)."""
        return PipelineRunner(**self._arguments)

    def score_tokens(self, scorer: MicrobatchScorer | None = None, width: int = 1) -> None:
        """The last stage returns each label's log-probability; `scorer` turns a
        microbatch's into its objective and `width` values to report (None: they are only
        collected, `token_logps`)."""
        self.per_token, self.scorer, self.reported_width = True, scorer, width
        for stage in self.stages:
            stage.submod.per_token = True

    def _scaled_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The objective of one microbatch on the last stage: its summed loss scaled (or
        its pairs' under DPO: `target` holds its rows), plus the load-balancing term of
        its routing tally while training."""
        tally = None
        if self.routing is not None:
            output, tally = output
        if self.per_token and self.scorer is None:  # `token_logps` keeps the outputs
            return output.new_zeros(())
        objective = reported = output
        if self.scorer is not None:
            objective, reported = self.scorer(output, self._batch.rows(target))
        loss, reported = objective * self.loss_scale, reported.detach() * self.loss_scale
        if tally is None or not self.training:
            self._scores.append((reported, None))
            return loss
        term, counts, routed_loss = self.routing.score(tally)
        self._scores.append((reported, (counts, routed_loss)))
        return loss if term is None else loss + term * self.data_parallel

    def _run(self, method: Callable, batch: TokenBatch) -> list[torch.Tensor]:
        """The schedule over one batch; the language-model loss of each microbatch (none
        off the last stage), or what the scorer reports. Only the last `num_microbatches`
        scores count: in a stage's first step, and the first after switching between
        training and evaluation, torch infers the stages' shapes with one more pass,
        through the loss function too."""
        self._scores = []
        self._schedule(method, batch, return_outputs=False)
        scores = self._scores[-self.num_microbatches :] if self.holds_last else []
        for _, routed in scores:
            if routed is not None and self.routing is not None:
                self.routing.record(*routed)
        return [loss for loss, _ in scores]

    def _schedule(self, method: Callable, batch: TokenBatch, *, return_outputs: bool) -> Any:
        """`method` (the schedule's `step` or `eval`) over `batch`; the last stage's outputs
        merged where asked."""
        args = (batch.input_ids,) if self.holds_first else ()
        target = None
        if self.holds_last:
            rows = torch.arange(len(batch.input_ids), device=batch.input_ids.device)
            target = rows if self.per_token else batch.labels
        # The labels (and packed examples' positions) go to every stage as keyword inputs,
        # which are not sent along the pipeline: each rank cuts its own copy into the same
        # microbatches, and the last stage scores its microbatch with them.
        inputs = {"labels": batch.labels}
        if batch.position_ids is not None:
            inputs["position_ids"] = batch.position_ids
        self._batch = batch
        try:
            return method(*args, target=target, losses=[], return_outputs=return_outputs, **inputs)
        finally:
            self._batch = None

    def _summed(self, scores: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """The microbatches' scores added up (zeros off the last stage)."""
        if scores:
            return torch.stack(scores).sum(dim=0)
        width = () if self.scorer is None else (self.reported_width,)
        return torch.zeros(width, device=like.device)

    def train_step(self, batch: TokenBatch, trained_tokens: int, dp: int) -> torch.Tensor:
        """Forward and backward of one batch; returns its summed loss / `trained_tokens`
        (those of the global batch; under DPO the scorer's values / its pairs), the
        backward running on that times `dp` (data parallelism averages the gradients).

        The loss is only known on the rank holding the last stage; elsewhere 0.
        """
        self.loss_scale, self.data_parallel, self.training = dp / trained_tokens, dp, True
        losses = self._run(self.schedule.step, batch)
        return self._summed(losses, batch.input_ids) / dp

    @torch.no_grad()
    def eval_step(self, batch: TokenBatch) -> torch.Tensor:
        """Summed loss over one batch's trained tokens, forward only (0 where the last
        stage is not held)."""
        self.loss_scale, self.training = 1.0, False
        return self._summed(self._run(self._forward_schedule.eval, batch), batch.input_ids)

    @torch.no_grad()
    def token_logps(self, batch: TokenBatch) -> torch.Tensor:
        """Each label's (batch, sequence) log-probability, forward only (zeros where the
        last stage is not held). The runner must `score_tokens` without a scorer."""
        self.training = False
        logps = self._schedule(self._forward_schedule.eval, batch, return_outputs=True)
        if not self.holds_last:
            return torch.zeros(batch.labels.shape, device=batch.labels.device)
        return logps
