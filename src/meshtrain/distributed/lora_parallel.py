"""Tensor parallelism for a LoRA layer: the adapters split the way their base layer is.

Under a column-parallel base (out split), A (r x in) is replicated and B (out x r) is
split on its output rows like the base; under a row-parallel base (in split), A is split
on its input columns like the base and B is replicated. So each rank's adapter output is
exactly the shard (column-parallel) or the partial sum (row-parallel) its base output is,
and the layer's one collective carries both. The gradient of the replicated matrix comes
out of the backward as a partial sum over the tp ranks; DTensor sums it when autograd
accumulates it into the replicated `.grad`. (neuronx-distributed, optimum-neuron,
torchtitan and PEFT under Transformers' TP all follow this rule.)

These styles differ from DTensor's `ColwiseParallel` / `RowwiseParallel` only in how
they place the parameters of the layer and of its two adapter children; the inputs and
outputs are laid out exactly as theirs.

The vocabulary layers follow the same rule. The LM head is column-parallel on the
vocabulary (A replicated, B split on the vocabulary). The embedding is split on the
vocabulary too (`VocabParallelEmbedding`): its A (r x vocabulary) is split on the
vocabulary like the base, B (hidden x r) replicated; each rank looks up its own
vocabulary columns of A (zero for the others' ids), so its adapter output is a partial
sum like its base output, and one reduction carries both.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshtrain.distributed.tensor_parallel import (
    OwnRows,
    VocabParallelEmbedding,
    VocabParallelLossHead,
)


def _distribute_own(
    module: nn.Module,
    placements: dict[str, Placement],
    mesh: DeviceMesh,
    src_data_rank: int | None,
) -> None:
    """Make `module`'s own parameters (not its children's) DTensors placed as named,
    keeping whether each is trained (a frozen base stays frozen)."""
    for name, parameter in list(module.named_parameters(recurse=False)):
        distributed = distribute_tensor(
            parameter, mesh, [placements[name]], src_data_rank=src_data_rank
        )
        module.register_parameter(
            name, nn.Parameter(distributed, requires_grad=parameter.requires_grad)
        )


_COLUMN_PLACEMENTS = {
    "": {"weight": Shard(0), "bias": Shard(0)},
    "lora_A": {"weight": Replicate()},
    "lora_B": {"weight": Shard(0)},
}


class _LoraColumnPartition:
    """Mixed into a column-parallel style: the base and B split on the outputs (Shard(0)),
    A replicated."""

    src_data_rank: int | None

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh):
        _distribute_own(module, _COLUMN_PLACEMENTS.get(name, {}), device_mesh, self.src_data_rank)


class LoraColwiseParallel(_LoraColumnPartition, ColwiseParallel):
    """Column-parallel base and B (Shard(0)); A replicated."""


class LoraVocabParallelLossHead(_LoraColumnPartition, VocabParallelLossHead):
    """A scoring LM head with adapters: the base and B split on the vocabulary, A
    replicated (`models.head_loss` scores the adapter's term chunk by chunk)."""


class LoraVocabParallelEmbedding(VocabParallelEmbedding):
    """A vocabulary-parallel embedding with PEFT's adapter: the base weight (Shard(0)) and
    A (Shard(1)) split on the vocabulary, B replicated."""

    _PLACEMENTS = {
        "weight": Shard(0),
        "lora_embedding_A": Shard(1),
        "lora_embedding_B": Replicate(),
    }

    def _partition_embedding_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh):
        _distribute_own(module, self._PLACEMENTS, device_mesh, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.forward = types.MethodType(_lookup_with_adapter, module)
        return module


def _lookup_with_adapter(embedding: nn.Embedding, ids: torch.Tensor) -> DTensor:
    """This rank's share of `base(ids) + (A.T[ids] @ B.T) * scaling` (PEFT's order), a
    partial sum over the tp ranks: its rows of the base and its columns of A. B's
    gradient, made of this rank's rows only, is partial too."""
    weight = embedding.weight
    rows = OwnRows(weight, ids, embedding.padding_idx)
    after_a = rows.lookup(embedding.lora_embedding_A.to_local().T)
    b = embedding.lora_embedding_B.to_local(grad_placements=[Partial()])
    looked_up = rows.lookup(weight.to_local()) + (after_a @ b.T) * embedding.scaling
    return DTensor.from_local(looked_up, weight.device_mesh, [Partial()], run_check=False)


class LoraRowwiseParallel(RowwiseParallel):
    """Row-parallel base and A (Shard(1)); B and the base's bias replicated."""

    _PLACEMENTS = {
        "": {"weight": Shard(1), "bias": Replicate()},
        "lora_A": {"weight": Shard(1)},
        "lora_B": {"weight": Replicate()},
    }

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh):
        _distribute_own(module, self._PLACEMENTS.get(name, {}), device_mesh, self.src_data_rank)
