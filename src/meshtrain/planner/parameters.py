"""The parameter elements one rank holds, per pipeline stage, and what FSDP2 gathers at a
time: each parameter's local share is asked of the axes (`axes.local_share`: a `Share`);
the tensor-parallel split (KV heads replicated past their count) is here for
`axes.tensor` and the ranking's rough model states.

A share depends on a parameter's role, not on its layer, so the shares are asked once per
role (`ParameterShapes`): the search weighs a thousand layouts of models with tens of
thousands of parameters (Qwen3-235B's experts), which asking per parameter took 14 s."""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from meshtrain.models.llama.parameter_names import (
    EMBEDDING,
    is_kv_projection,
    is_tensor_parallel_sharded,
)
from meshtrain.planner.shapes import GatherUnits, ModelShape, StepShape

# A parameter's elements on one rank, from its name and full shape.
Share = Callable[[str, tuple[int, ...]], int]

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ParameterGroup:
    """Parameters of one role and shape: one in each of `layers` (decoder layers), or, with
    no layers, one outside them; `name` is the first of them, whose share stands for all."""

    name: str
    shape: tuple[int, ...]
    layers: tuple[int, ...] = ()


def group_parameters(shapes: Mapping[str, tuple[int, ...]]) -> tuple[ParameterGroup, ...]:
    """`shapes` by role (the name with its layer number left out) and shape."""
    if isinstance(shapes, ParameterShapes):
        return shapes.groups
    first: dict[tuple[str, tuple[int, ...]], str] = {}
    layers: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for name, shape in shapes.items():
        found = _LAYER.search(name)
        role = _LAYER.sub(".layers.*.", name, count=1) if found else name
        key = (role, tuple(shape))
        first.setdefault(key, name)
        if found:
            layers.setdefault(key, []).append(int(found.group(1)))
    return tuple(
        ParameterGroup(name, key[1], tuple(layers.get(key, ()))) for key, name in first.items()
    )


class ParameterShapes(Mapping[str, tuple[int, ...]]):
    """Every parameter's shape, grouped once (`group_parameters`) for the layouts to share."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._shapes = dict(shapes)
        self.groups = group_parameters(self._shapes)
        self.numel = sum(math.prod(shape) for shape in self._shapes.values())

    def __getitem__(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


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
    groups: tuple[ParameterGroup, ...],
    stage_layers: tuple[int, ...],
    *,
    share: Share,
    tied_embeddings: bool = False,
) -> list[int]:
    """Local parameter elements of each pipeline stage (embeddings first, head last).

    Tied embeddings over several stages: the last stage holds a copy of the embedding
    as its LM head (the shapes list the tied weight once)."""
    first_layer = list(itertools.accumulate(stage_layers, initial=0))[:-1]
    counts = [0] * len(stage_layers)
    for group in groups:
        numel = share(group.name, group.shape)
        if group.layers:
            for layer in group.layers:
                counts[bisect.bisect_right(first_layer, layer) - 1] += numel
            continue
        if group.name.rpartition(".")[0] == _EMBEDDING_MODULE:  # its weight, or its adapters
            stage = 0
            if group.name == EMBEDDING and tied_embeddings and len(stage_layers) > 1:
                counts[-1] += numel
        else:  # final norm, lm_head
            stage = len(stage_layers) - 1
        counts[stage] += numel
    return counts


def layer_parameter_count(shapes: Mapping[str, tuple[int, ...]], *, share: Share) -> int:
    """Local elements of one decoder layer (they are all alike): FSDP2's unit of gathering."""
    return sum(
        share(group.name, group.shape) for group in group_parameters(shapes) if 0 in group.layers
    )


def local_counts(
    shapes: Mapping[str, tuple[int, ...]], m: ModelShape, step: StepShape, share: Share
) -> tuple[list[int], int]:
    """Each stage's local parameter count, and one decoder layer's (`share`: the axes')."""
    counts = stage_parameter_counts(
        group_parameters(shapes), step.stage_layers, share=share, tied_embeddings=m.tied_embeddings
    )
    return counts, layer_parameter_count(shapes, share=share)


def gather_units(
    shapes: Mapping[str, tuple[int, ...]],
    m: ModelShape,
    step: StepShape,
    share: Share,
    adapters: Mapping[str, tuple[int, ...]] | None = None,
) -> GatherUnits:
    """The units of gathering of the pipeline rank holding the most parameters (with a
    LoRA run's `adapters`, gathered with their layers)."""
    counts, layer = local_counts(shapes, m, step, share)
    if adapters:
        extra, extra_layer = local_counts(adapters, m, step, share)
        counts = [a + b for a, b in zip(counts, extra, strict=True)]
        layer += extra_layer
    ranks = [step.stages_of(rank) for rank in range(step.pp)]
    mine = max(ranks, key=lambda stages_: sum(counts[s] for s in stages_))
    return GatherUnits(
        local=sum(counts[s] for s in mine),
        layer=layer,
        layers=sum(step.stage_layers[s] for s in mine),
    )
