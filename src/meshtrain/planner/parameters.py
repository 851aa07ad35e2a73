"""The parameter elements one rank holds, per pipeline stage, and what FSDP2 gathers at a
time: each parameter's local share is asked of the axes (`axes.local_share`: a `Share`);
the tensor-parallel split (KV heads replicated past their count) is here for
`axes.tensor` and the ranking's rough model states."""

from __future__ import annotations

import math
from collections.abc import Callable

from meshtrain.models.llama.parameter_names import (
    EMBEDDING,
    is_kv_projection,
    is_tensor_parallel_sharded,
)
from meshtrain.planner.shapes import GatherUnits, ModelShape, StepShape

# A parameter's elements on one rank, from its name and full shape.
Share = Callable[[str, tuple[int, ...]], int]


def local_parameter_count(
    shapes: dict[str, tuple[int, ...]], *, tp: int, kv_replication: int = 1
) -> int:
    """Elements of all parameters one tensor-parallel rank holds."""
    return sum(
        tensor_parallel_numel(name, math.prod(shape), tp, kv_replication)
        for name, shape in shapes.items()
    )


def tensor_parallel_numel(name: str, numel: int, tp: int, kv_replication: int) -> int:
    """A parameter's elements on one tp rank (the KV projections replicated first)."""
    if tp > 1 and is_tensor_parallel_sharded(name):
        copies = kv_replication if is_kv_projection(name) else 1
        return math.ceil(numel * copies / tp)
    return numel


_EMBEDDING_MODULE = EMBEDDING.rpartition(".")[0]


def stage_parameter_counts(
    shapes: dict[str, tuple[int, ...]],
    stage_layers: tuple[int, ...],
    *,
    share: Share,
    tied_embeddings: bool = False,
) -> list[int]:
    """Local parameter elements of each pipeline stage (embeddings first, head last).

    Tied embeddings over several stages: the last stage holds a copy of the embedding
    as its LM head (the shapes list the tied weight once)."""
    first_layer = [sum(stage_layers[:i]) for i in range(len(stage_layers))]
    counts = [0] * len(stage_layers)
    for name, shape in shapes.items():
        numel = share(name, shape)
        if ".layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            stage = max(i for i, start in enumerate(first_layer) if start <= layer)
        elif name.rpartition(".")[0] == _EMBEDDING_MODULE:  # its weight, or its adapters
            stage = 0
            if name == EMBEDDING and tied_embeddings and len(stage_layers) > 1:
                counts[-1] += numel
        else:  # final norm, lm_head
            stage = len(stage_layers) - 1
        counts[stage] += numel
    return counts


def layer_parameter_count(shapes: dict[str, tuple[int, ...]], *, share: Share) -> int:
    """Local elements of one decoder layer (they are all alike): FSDP2's unit of gathering."""
    return sum(share(name, shape) for name, shape in shapes.items() if ".layers.0." in name)


def local_counts(
    shapes: dict[str, tuple[int, ...]], m: ModelShape, step: StepShape, share: Share
) -> tuple[list[int], int]:
    """Each stage's local parameter count, and one decoder layer's (`share`: the axes')."""
    counts = stage_parameter_counts(
        shapes, step.stage_layers, share=share, tied_embeddings=m.tied_embeddings
    )
    return counts, layer_parameter_count(shapes, share=share)


def gather_units(
    shapes: dict[str, tuple[int, ...]], m: ModelShape, step: StepShape, share: Share
) -> GatherUnits:
    """The units of gathering of the pipeline rank holding the most parameters."""
    counts, layer = local_counts(shapes, m, step, share)
    stages = len(step.stage_layers)
    ranks = [list(range(rank, stages, step.pp)) for rank in range(step.pp)]
    mine = max(ranks, key=lambda stages_: sum(counts[s] for s in stages_))
    return GatherUnits(
        local=sum(counts[s] for s in mine),
        layer=layer,
        layers=sum(step.stage_layers[s] for s in mine),
    )
