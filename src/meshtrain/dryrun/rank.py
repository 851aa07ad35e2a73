"""One rank's training step on fake tensors, with its memory measured by category.

The rank runs the trainer's own code, through the trainer's own two calls:
`ParallelDims` (the device mesh of the whole world), `components.rank_build.build_rank`
(meta-device model, converters, pipeline stages, tensor and sequence parallelism,
activation checkpointing, FSDP2, this rank's shards allocated and initialised, the
flat buffer and ZeRO-1 or AdamW over FSDP2's shards) and `components.train_step.
optimizer_step` (the pipeline schedule with its real order of microbatches, or
forward and backward; the reduction; the update). What this module adds is the fake
world around them, the made-up data (random token ids of the planned batch shape)
and the measurement: two steps run; the second is measured (AdamW's moments exist
from the first), as the trainer's memory probe does.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch.distributed._tools.mod_tracker import ModTracker

from meshtrain.components.memory_probe import measure_peak_memory
from meshtrain.components.optimizer import ModelOptimizer
from meshtrain.components.rank_build import (
    RankParts,
    build_rank,
    plan_meta_model,
    rank_converters,
)
from meshtrain.components.train_step import optimizer_step
from meshtrain.config import RunConfig
from meshtrain.config_parsing import ConfigError
from meshtrain.data.batch import TokenBatch
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.tensor_parallel import local_tensor
from meshtrain.dryrun.experts import experts_on_fallback
from meshtrain.dryrun.fake_world import fake_process_group, fake_tensors, in_own_thread
from meshtrain.dryrun.pipeline import static_setup, told_shapes
from meshtrain.models.cpu_linear import onednn_available
from meshtrain.models.parallel_model import ParallelModel
from meshtrain.pipeline_schedules import ZERO_BUBBLE
from meshtrain.planner import Plan


@dataclass
class RankMemory:
    """What one rank held in its measured step (bytes)."""

    rank: int
    coordinates: dict[str, int]  # pp, dp, cp, tp
    peak_bytes: int
    model_states: dict[str, int]  # parameters, gradients, optimizer_states
    at_peak: dict[str, int]  # by category (memory_probe's) at the step's peak
    by_module: dict[str, int]  # made in the step and live at its peak, by module kind
    peak_at: str  # the phase and innermost module at the peak
    seconds: float

    @property
    def beyond_model_states(self) -> int:
        """Gathered parameters, activations, the loss, temporaries: the peak's remainder."""
        return self.peak_bytes - sum(self.model_states.values())


def dry_run_rank(run: RunConfig, plan: Plan, rank: int, device: torch.device) -> RankMemory:
    """Rank `rank` of the plan's world: build it and run two training steps on fake
    tensors under a fake process group; the second step's memory. (In a thread of its
    own, so that dry runs can follow each other in one process.)"""
    return in_own_thread(partial(_dry_run_rank, run, plan, rank, device))


def _dry_run_rank(run: RunConfig, plan: Plan, rank: int, device: torch.device) -> RankMemory:
    if run.training.objective != "lm":
        # DPO's pairs are found in the batch's positions, data fake tensors do not hold.
        raise ConfigError(
            "`planner.dry_run` runs the language-model loss only; DPO runs are planned by "
            "the memory model (docs/preference.md): set planner.dry_run=false."
        )
    layout, began = plan.layout, time.perf_counter()
    # The weights' values change no step's memory, and fake tensors cannot read files: a
    # dry run draws them, with `model.init_from`'s config (the plan's model) kept.
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, init_from=None))
    with fake_process_group(rank, plan.world_size):
        # The mesh is made of real (tiny) tensors: outside the fake mode.
        dims = ParallelDims.of_layout(layout, device.type)
        # The one check that runs a real product (once per process, cached) runs on real
        # tensors: the fake ones have no values to compare.
        # So does the meta model: fake tensors would keep references to its parameters,
        # which moving them to the device replaces.
        onednn_available()
        meta_model = plan_meta_model(run, plan)
        converters = rank_converters(run, plan, dims, device.type)
        for converter in converters:
            converter.convert(meta_model)
        with fake_tensors(device), static_setup(), experts_on_fallback():
            rank_parts = build_rank(
                run,
                plan,
                dims,
                device,
                meta_model=meta_model,
                converters=converters,
                seed_dropout=False,
            )
            pm, optimizer = rank_parts.pm, rank_parts.optimizer
            if pm.runner is not None:
                told_shapes(pm.runner, run, plan, device)
            batches = _batches(plan, rank_parts)
            trained_tokens = plan.global_batch_size * _block(plan)
            optimizer_step(rank_parts, 0, batches, trained_tokens)
            existing = _persistent(pm, optimizer)
            states: dict[str, int] = {}
            with (
                warnings.catch_warnings(),
                module_tracker(plan) as modules,
                measure_peak_memory(
                    device,
                    existing=existing,
                    fake=True,
                    where=lambda: _position(modules),
                    owner=lambda: _owner(modules),
                ) as (peak, phase),
            ):
                # torch's module tracker warns at every pipeline microbatch's re-entry.
                warnings.filterwarnings("ignore", message="The module hierarchy tracking")
                optimizer_step(
                    rank_parts,
                    1,
                    batches,
                    trained_tokens,
                    phase=phase,
                    after_update=lambda: states.update(_model_states(pm, optimizer)),
                )
        coordinates = {"pp": dims.pp_rank, "dp": dims.dp_rank, "tp": dims.tp_rank}
        if dims.cp > 1:
            coordinates["cp"] = dims.cp_rank
    return RankMemory(
        rank=rank,
        coordinates=coordinates,
        peak_bytes=peak.peak_bytes,
        model_states=states,
        at_peak=peak.by_category,
        by_module=peak.by_module,
        peak_at=peak.at,
        seconds=time.perf_counter() - began,
    )


def _block(plan: Plan) -> int:
    return plan.tokens_per_step // plan.global_batch_size


# Accumulation steps a dry-run step runs at most: the first (no gradients yet), one in
# the middle (gradients held, not yet reduced) and the last (reduced: FSDP2's reduce-
# scatter, the flat buffer's buckets). Every other is the middle one again, to the byte,
# and a step of 32 took 32 x the time to find the same peak.
MICROBATCHES = 3


def _batches(plan: Plan, rank: RankParts) -> list[TokenBatch]:
    """One step's microbatches on this rank (`MICROBATCHES` at most): random ids of the
    planned shape."""
    vocab = plan.model_config["vocab_size"]
    shape = (rank.batch.per_device, _block(plan))
    return [
        TokenBatch.of_ids(torch.randint(vocab, shape, device=rank.device))
        for _ in range(min(rank.batch.accumulation_steps, MICROBATCHES))
    ]


def _module_tensors(pm: ParallelModel) -> list[torch.Tensor]:
    return [t for m in pm.modules for t in (*m.parameters(), *m.buffers())]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages (a flat buffer's views count once)."""
    storages = {_storage_id(t): local_tensor(t).untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _persistent(pm: ParallelModel, optimizer: ModelOptimizer) -> dict[str, list[torch.Tensor]]:
    """What lives through a step, by the planner's categories: parameters (the modules'
    and their buffers), gradients (as the update sees them: a flat buffer's views, FSDP2's
    sharded ones), optimizer states (AdamW's, fp32 masters and their gradients)."""
    parameters = _module_tensors(pm)
    grads = [p.grad for m in pm.modules for p in m.parameters() if p.grad is not None]
    known = {_storage_id(t) for t in (*parameters, *grads)}
    states = [t for t in optimizer.held_tensors() if _storage_id(t) not in known]
    return {"parameters": parameters, "gradients": grads, "optimizer_states": states}


def _model_states(pm: ParallelModel, optimizer: ModelOptimizer) -> dict[str, int]:
    return {name: _nbytes(tensors) for name, tensors in _persistent(pm, optimizer).items()}


def _storage_id(tensor: torch.Tensor) -> int:
    return local_tensor(tensor).untyped_storage()._cdata


class _Untracked:
    """No module tracking: where the peak is is then not named."""

    parents: frozenset[str] = frozenset()
    is_bw = False

    def __enter__(self) -> _Untracked:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None


def module_tracker(plan: Plan) -> ModTracker | _Untracked:
    """torch's module tracker, which names the module at the peak; not under a
    zero-bubble pipeline schedule, whose split backward runs `autograd.grad` on the
    stages, where the tracker's backward hooks raise (torch 2.13)."""
    layout = plan.layout
    if layout.pipeline_parallel_size > 1 and layout.pipeline_schedule in ZERO_BUBBLE:
        return _Untracked()
    return ModTracker()


def _position(modules: ModTracker | _Untracked) -> str:
    """'forward'/'backward' and the innermost module the step is in."""
    innermost = max(modules.parents, key=len, default="")
    return f"{'backward' if modules.is_bw else 'forward'} {innermost}".strip()


def _owner(modules: ModTracker | _Untracked) -> str:
    """The innermost module, its decoder layer's index left out (they are all alike): what
    all layers' attention, MLP and norms hold adds up under one name each."""
    innermost = max(modules.parents, key=len, default="")
    parts = innermost.split(".")
    if "layers" in parts:
        index = parts.index("layers") + 1
        parts[index : index + 1] = ["*"] if index < len(parts) else []
    kind = "backward" if modules.is_bw else "forward"
    return f"{kind} {'.'.join(parts[1:]) or parts[0]}"
