"""The parameter elements one rank holds: its tensor-parallel share (KV heads replicated
past their count), per pipeline stage, and what FSDP2 gathers at a time."""

from __future__ import annotations

import math

from meshtrain.distributed.kv_heads import kv_replication_factor
from meshtrain.models.llama.parameter_names import (
    EMBEDDING,
    is_kv_projection,
    is_tensor_parallel_sharded,
)
from meshtrain.planner.shapes import GatherUnits, ModelShape, StepShape


def local_parameter_count(
    shapes: dict[str, tuple[int, ...]], *, tp: int, kv_replication: int = 1
) -> int:
    """Elements of all parameters one tensor-parallel rank holds."""
    return sum(_local_numel(name, shape, tp, kv_replication) for name, shape in shapes.items())


def _local_numel(name: str, shape: tuple[int, ...], tp: int, kv_replication: int) -> int:
    numel = math.prod(shape)
    if tp > 1 and is_tensor_parallel_sharded(name):
        copies = kv_replication if is_kv_projection(name) else 1
        return math.ceil(numel * copies / tp)
    return numel


def stage_parameter_counts(
    shapes: dict[str, tuple[int, ...]],
    stage_layers: tuple[int, ...],
    *,
    tp: int,
    kv_replication: int,
    tied_embeddings: bool = False,
) -> list[int]:
    """Local parameter elements of each pipeline stage (embeddings first, head last).

    Tied embeddings over several stages: the last stage holds a copy of the embedding
    as its LM head (the shapes list the tied weight once)."""
    first_layer = [sum(stage_layers[:i]) for i in range(len(stage_layers))]
    counts = [0] * len(stage_layers)
    for name, shape in shapes.items():
        numel = _local_numel(name, shape, tp, kv_replication)
        if ".layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            stage = max(i for i, start in enumerate(first_layer) if start <= layer)
        elif name == EMBEDDING:
            stage = 0
            if tied_embeddings and len(stage_layers) > 1:
                counts[-1] += numel
        else:  # final norm, lm_head
            stage = len(stage_layers) - 1
        counts[stage] += numel
    return counts


def layer_parameter_count(
    shapes: dict[str, tuple[int, ...]], *, tp: int, kv_replication: int = 1
) -> int:
    """Local elements of one decoder layer (they are all alike): FSDP2's unit of gathering."""
    return sum(
        _local_numel(name, shape, tp, kv_replication)
        for name, shape in shapes.items()
        if ".layers.0." in name
    )


def local_counts(
    shapes: dict[str, tuple[int, ...]], m: ModelShape, step: StepShape
) -> tuple[list[int], int]:
    """Each stage's local parameter count, and one decoder layer's, under step's tp."""
    kv_replication = kv_replication_factor(m.kv_heads, step.tp)
    counts = stage_parameter_counts(
        shapes,
        step.stage_layers,
        tp=step.tp,
        kv_replication=kv_replication,
        tied_embeddings=m.tied_embeddings,
    )
    return counts, layer_parameter_count(shapes, tp=step.tp, kv_replication=kv_replication)


def gather_units(shapes: dict[str, tuple[int, ...]], m: ModelShape, step: StepShape) -> GatherUnits:
    """The units of gathering of the pipeline rank holding the most parameters."""
    counts, layer = local_counts(shapes, m, step)
    stages = len(step.stage_layers)
    ranks = [list(range(rank, stages, step.pp)) for rank in range(step.pp)]
    mine = max(ranks, key=lambda stages_: sum(counts[s] for s in stages_))
    return GatherUnits(
        local=sum(counts[s] for s in mine),
        layer=layer,
        layers=sum(step.stage_layers[s] for s in mine),
    )
