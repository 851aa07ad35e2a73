"""What `distributed.zero.ShardedAdamW` writes into a checkpoint, and how it reads it back.

Per (tp, pp) coordinate, dp rank 0 writes the parameters (the fp32 master
weights under bf16 parameters, gathered from their ZeRO-1 owners one tensor
at a time) and where each sits in the flat buffer; every ZeRO-1 owner (dp rank
0 alone without ZeRO-1) writes AdamW's moments over its range of that buffer.
Reading rebuilds each tensor at its full size from any layout's files
(`checkpoint.load.CheckpointReader`) and keeps this rank's piece and range.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from meshtrain.checkpoint import files
from meshtrain.checkpoint.load import CheckpointReader
from meshtrain.checkpoint.manifest import write_json_atomic
from meshtrain.checkpoint.safetensors_format import SafetensorsWriter, TensorSpec, save_safetensors
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.tensor_parallel import ParameterSharding, local_tensor
from meshtrain.distributed.zero import ShardedAdamW

MOMENTS = ("exp_avg", "exp_avg_sq")


def writes_moments(optimizer: ShardedAdamW, dims: ParallelDims) -> bool:
    """Every ZeRO-1 owner writes its range; without ZeRO-1 dp rank 0 writes the whole."""
    return optimizer.zero_1 or dims.dp_rank == 0


def checkpoint_bytes(
    optimizer: ShardedAdamW, parameters: Mapping[str, torch.Tensor], dims: ParallelDims
) -> int:
    """The tensor bytes this rank writes: its coordinate's weights (dp rank 0) at the
    stored precision, and its range of the optimizer's moments."""
    itemsize = optimizer.state_dtype.itemsize
    total = 0
    if dims.dp_rank == 0:
        total += sum(local_tensor(p).numel() for p in parameters.values()) * itemsize
    if writes_moments(optimizer, dims):
        total += 2 * optimizer.owned_numel * itemsize
    return total


def save_state(
    optimizer: ShardedAdamW, root: Path, parameters: Mapping[str, torch.Tensor], dims: ParallelDims
) -> None:
    """This rank's share of the checkpoint: its (tp, pp) coordinate's parameter shard and
    flat index (dp rank 0 only), and its range of the optimizer's moments."""
    weights = files.shard_weights(root, dims.tp_rank, dims.pp_rank)
    if dims.dp_rank == 0:
        weights.parent.mkdir(parents=True, exist_ok=True)
    if optimizer.master is not None:
        _write_master_weights(optimizer, weights, parameters, dims)
    elif dims.dp_rank == 0:
        tensors = {n: local_tensor(p).detach() for n, p in parameters.items()}
        # Streamed tensor by tensor from the parameters' own memory: no serialised copy.
        save_safetensors(tensors, weights, metadata={"format": "pt"})
    if dims.dp_rank == 0:
        # Where each parameter sits in this coordinate's flat buffer, so optimizer moments
        # (saved as flat ranges) can be resharded onto another layout.
        write_json_atomic(
            files.flat_index(root, dims.tp_rank, dims.pp_rank), optimizer.flat.index()
        )
    if writes_moments(optimizer, dims):
        opt_dir = root / files.OPTIMIZER
        opt_dir.mkdir(parents=True, exist_ok=True)
        name = files.optimizer_file_name(dims.dp_rank, dims.tp_rank, dims.pp_rank)
        _write_moments(optimizer, opt_dir / name)


def _write_master_weights(
    optimizer: ShardedAdamW, path: Path, parameters: Mapping[str, torch.Tensor], dims: ParallelDims
) -> None:
    """Under bf16 parameters the checkpoint holds the fp32 master weights (so resume is
    exact and consolidation loses nothing). Under ZeRO-1 they are spread over the dp
    ranks: each tensor is gathered to dp rank 0 as it is written, one at a time."""
    slots = [slot for slot in optimizer.flat.slots if slot.name in parameters]
    if dims.dp_rank != 0:
        for slot in slots:
            optimizer.full_master(slot)  # the sends of this rank's elements
        return
    specs = [TensorSpec(slot.name, optimizer.state_dtype, slot.shape) for slot in slots]
    with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as writer:
        for slot in slots:
            writer.write(slot.name, optimizer.full_master(slot))


def _write_moments(optimizer: ShardedAdamW, path: Path) -> None:
    """This rank's AdamW moments over its owned range, and the step count, streamed from
    the optimizer's state pieces (no copy of the optimizer is made to save it)."""
    numel, dtype = optimizer.owned_numel, optimizer.state_dtype
    specs = [
        TensorSpec("exp_avg", dtype, (numel,)),
        TensorSpec("exp_avg_sq", dtype, (numel,)),
        TensorSpec("step", torch.float32, (1,)),
    ]
    metadata = {"range": json.dumps([optimizer.start, optimizer.end])}
    with SafetensorsWriter(path, specs, metadata=metadata) as writer:
        for name in writer.names:
            if name == "step":
                writer.write(name, torch.tensor([optimizer.step_count()], dtype=torch.float32))
            else:
                writer.write(name, optimizer.moment_pieces(name))


def load_state(
    optimizer: ShardedAdamW,
    reader: CheckpointReader,
    sharding: Mapping[str, ParameterSharding],
    dims: ParallelDims,
    stored_as: Mapping[str, str],
) -> None:
    """Fill the flat buffer, and the moments (and masters) of the owned range."""
    flat = optimizer.flat
    start, end = optimizer.start, optimizer.end
    moments = {key: torch.zeros(end - start, dtype=optimizer.state_dtype) for key in MOMENTS}
    for slot in flat.slots:
        spec, name = sharding[slot.name], stored_as.get(slot.name, slot.name)
        local = spec.local_piece(reader.parameter(name), dims.tp_rank, dims.tp).reshape(-1)
        flat.params[slot.offset : slot.offset + slot.numel].copy_(local)
        lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
        if lo >= hi:
            continue
        if optimizer.master is not None:
            # At the precision stored: fp32 masters (or an fp32 run's weights) stay exact.
            optimizer.master[lo - start : hi - start] = local[lo - slot.offset : hi - slot.offset]
        for key, target in moments.items():
            moment = spec.local_piece(reader.moment(name, key), dims.tp_rank, dims.tp).reshape(-1)
            target[lo - start : hi - start] = moment[lo - slot.offset : hi - slot.offset]
    optimizer.load_moments(moments["exp_avg"], moments["exp_avg_sq"], reader.step())


@dataclass(frozen=True)
class ZeroState:
    """`ShardedAdamW`'s side of a checkpoint (`checkpoint.checkpointer.OptimizerState`)."""

    optimizer: ShardedAdamW

    @property
    def state_dtype(self) -> torch.dtype:
        return self.optimizer.state_dtype

    def checkpoint_bytes(
        self,
        parameters: Mapping[str, torch.Tensor],
        sharding: Mapping[str, ParameterSharding],
        dims: ParallelDims,
    ) -> int:
        return checkpoint_bytes(self.optimizer, parameters, dims)

    def save_state(
        self,
        root: Path,
        parameters: Mapping[str, torch.Tensor],
        sharding: Mapping[str, ParameterSharding],
        dims: ParallelDims,
    ) -> None:
        save_state(self.optimizer, root, parameters, dims)

    def load_state(
        self,
        reader: CheckpointReader,
        sharding: Mapping[str, ParameterSharding],
        dims: ParallelDims,
        stored_as: Mapping[str, str],
    ) -> None:
        load_state(self.optimizer, reader, sharding, dims, stored_as)
