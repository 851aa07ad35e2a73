"""Pipeline schedules under a fake process group: their stages told their shapes up front.

Before its first microbatch a torch schedule sets its stages up with their neighbours:
a vote (each stage says whether it knows its input and output shapes; the product
travels down the pipeline and back, and is read with `.item()`), then, unless every
stage knew, an exchange of shapes by send/recv of pickled objects. A fake process
group delivers nothing and fake tensors have no values, so neither can run. What they
would settle is known from the plan: every stage but the first takes the hidden states
of one microbatch (this rank's sequence shard under sequence parallelism) in the
residual stream's dtype, and every stage but the last gives the same; the first takes
token ids, the last gives its summed loss; a mixture of experts' stages pass their
routing tally beside (`models.routing`). `told_shapes` hands each stage those
(`PipelineStage`'s static metadata) and `static_setup` settles the vote as torch would
with every stage's shapes known: static. Nothing else of the schedule changes: its
order of forwards and backwards is the real one.

Written against torch 2.13's `torch.distributed.pipelining` (`_PipelineSchedule.
_warmup_p2p`, `PipelineStage._user_meta`, `InferenceMode`); an older torch sets its
stages up differently, and the dry run then refuses pipeline layouts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.pipelining import schedules

from meshtrain.config import RunConfig
from meshtrain.distributed.pipeline_parallel import PipelineRunner
from meshtrain.planner import Plan


def told_shapes(runner: PipelineRunner, run: RunConfig, plan: Plan, device: torch.device) -> None:
    """Give each of the rank's stages the shapes its neighbours would have sent."""
    layout = plan.layout
    microbatch = plan.per_device_train_batch_size // layout.pipeline_parallel_num_microbatches
    # The rank's share of each block: 1 / cp of its tokens under context parallelism.
    block = plan.tokens_per_step // plan.global_batch_size // layout.context_parallel_size
    sequence = block // layout.tensor_parallel_size if layout.sequence_parallel else block
    stream = torch.bfloat16 if run.training.mixed_precision == "bf16_master" else torch.float32
    hidden_size = plan.model_config["hidden_size"]
    # What travels between stages needs its gradient sent back: it requires one.
    hidden = torch.empty(microbatch, sequence, hidden_size, dtype=stream, device=device)
    hidden.requires_grad_(True)
    ids = torch.empty(microbatch, block, dtype=torch.long, device=device)
    loss = torch.empty((), dtype=torch.float32, device=device, requires_grad=True)
    beside = ()
    if (routing := runner.routing) is not None:
        rows = len(routing.sparse_layers) + 1
        beside = (torch.empty(rows, routing.experts, device=device, requires_grad=True),)
    from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas  # noqa: PLC0415

    for stage in runner.stages:
        inputs = (ids,) if stage.is_first else (hidden, *beside)
        outputs = (loss if stage.is_last else hidden, *beside)
        stage._user_meta = _StageMeta(
            inputs=extract_tensor_metas(inputs), outputs=extract_tensor_metas(outputs)
        )


@contextlib.contextmanager
def static_setup() -> Iterator[None]:
    """Every schedule settles its stages' vote as static, sending nothing (where this
    torch votes at all; elsewhere the dry run refuses pipeline layouts)."""
    if not supported():
        yield
        return
    from torch.distributed.pipelining._utils import InferenceMode  # noqa: PLC0415

    original = schedules._PipelineSchedule._warmup_p2p

    def settle(self: Any, stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = settle
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = original


def supported() -> bool:
    """Whether this torch's schedules set their stages up the way this module settles."""
    from torch.distributed.pipelining import _utils  # noqa: PLC0415

    return hasattr(schedules._PipelineSchedule, "_warmup_p2p") and hasattr(_utils, "InferenceMode")
