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
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


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


class LoraColwiseParallel(ColwiseParallel):
    """Column-parallel base and B (Shard(0)); A replicated."""

    _PLACEMENTS = {
        "": {"weight": Shard(0), "bias": Shard(0)},
        "lora_A": {"weight": Replicate()},
        "lora_B": {"weight": Shard(0)},
    }

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh):
        _distribute_own(module, self._PLACEMENTS.get(name, {}), device_mesh, self.src_data_rank)


class LoraRowwiseParallel(RowwiseParallel):
    """Row-parallel base and A (Shard(1)); B and the base's bias replicated."""

    _PLACEMENTS = {
        "": {"weight": Shard(1), "bias": Replicate()},
        "lora_A": {"weight": Shard(1)},
        "lora_B": {"weight": Replicate()},
    }

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh):
        _distribute_own(module, self._PLACEMENTS.get(name, {}), device_mesh, self.src_data_rank)
