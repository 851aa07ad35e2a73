"""What `distributed.zero.ShardedAdamW` writes into a checkpoint, and how it reads it back.

Per (tp, pp) coordinate, dp rank 0 writes the parameters (the fp32 master
weights under bf16 parameters, gathered from their ZeRO-1 owners one tensor
at a time) and where each sits in the flat buffer; every ZeRO-1 owner (dp rank
0 alone without ZeRO-1) writes AdamW's moments over its range of that buffer.
Reading rebuilds each tensor at its full size from any layout's files
(`checkpoint.load.CheckpointReader`) and keeps this rank's piece and range.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from meshtrain.checkpoint import files
from meshtrain.checkpoint.load import CheckpointReader
from meshtrain.checkpoint.manifest import write_json_atomic
from meshtrain.checkpoint.safetensors_format import SafetensorsWriter, TensorSpec, save_safetensors
from meshtrain.checkpoint.save import write_moments
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.tensor_parallel import ParameterSharding, local_tensor
from meshtrain.distributed.zero import ShardedAdamW

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ZeroState:
    """`ShardedAdamW`'s side of a checkpoint (`checkpoint.checkpointer.OptimizerState`)."""

    optimizer: ShardedAdamW

    @property
    def state_dtype(self) -> torch.dtype:
        return self.optimizer.state_dtype

    def writes_moments(self, dims: ParallelDims) -> bool:
        """Every ZeRO-1 owner writes its range; without ZeRO-1 dp rank 0 the whole."""
        return self.optimizer.zero_1 or dims.dp_cp_rank == 0

    def checkpoint_bytes(
        self,
        parameters: Mapping[str, torch.Tensor],
        sharding: Mapping[str, ParameterSharding],
        dims: ParallelDims,
    ) -> int:
        """Its coordinate's weights (dp rank 0) at the stored precision, and its range of
        the optimizer's moments."""
        itemsize = self.state_dtype.itemsize
        total = 0
        if dims.dp_cp_rank == 0:
            total += sum(local_tensor(p).numel() for p in parameters.values()) * itemsize
        if self.writes_moments(dims):
            total += 2 * self.optimizer.owned_numel * itemsize
        return total

    def save_state(
        self,
        root: Path,
        parameters: Mapping[str, torch.Tensor],
        sharding: Mapping[str, ParameterSharding],
        dims: ParallelDims,
    ) -> None:
        """Its (tp, pp) coordinate's parameter shard and flat index (dp rank 0 only), and
        its range of the optimizer's moments."""
        optimizer = self.optimizer
        weights = files.shard_weights(root, dims.tp_rank, dims.pp_rank)
        if dims.dp_cp_rank == 0:
            weights.parent.mkdir(parents=True, exist_ok=True)
        if optimizer.master is not None:
            self._write_master_weights(weights, parameters, dims)
        elif dims.dp_cp_rank == 0:
            tensors = {n: local_tensor(p).detach() for n, p in parameters.items()}
            # Streamed tensor by tensor from the parameters' own memory: no serialised copy.
            save_safetensors(tensors, weights, metadata={"format": "pt"})
        if dims.dp_cp_rank == 0:
            # Where each parameter sits in this coordinate's flat buffer, so optimizer
            # moments (saved as flat ranges) can be resharded onto another layout.
            index = files.flat_index(root, dims.tp_rank, dims.pp_rank)
            write_json_atomic(index, optimizer.flat.index())
        if self.writes_moments(dims):
            name = files.optimizer_file_name(dims.dp_cp_rank, dims.tp_rank, dims.pp_rank)
            write_moments(
                root / files.OPTIMIZER / name,
                dtype=self.state_dtype,
                elements=(optimizer.start, optimizer.end),
                pieces=optimizer.moment_pieces,
                step=optimizer.step_count(),
            )

    def _write_master_weights(
        self, path: Path, parameters: Mapping[str, torch.Tensor], dims: ParallelDims
    ) -> None:
        """Under bf16 parameters the checkpoint holds the fp32 master weights (so resume is
        exact and consolidation loses nothing). Under ZeRO-1 they are spread over the dp
        ranks: each tensor is gathered to dp rank 0 as it is written, one at a time."""
        optimizer = self.optimizer
        slots = [slot for slot in optimizer.flat.slots if slot.name in parameters]
        if dims.dp_cp_rank != 0:
            for slot in slots:
                optimizer.full_master(slot)  # the sends of this rank's elements
            return
        specs = [TensorSpec(slot.name, self.state_dtype, slot.shape) for slot in slots]
        with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as writer:
            for slot in slots:
                writer.write(slot.name, optimizer.full_master(slot))

    def load_state(
        self,
        reader: CheckpointReader,
        sharding: Mapping[str, ParameterSharding],
        dims: ParallelDims,
        stored_as: Mapping[str, str],
    ) -> None:
        """Fill the flat buffer, and the moments (and masters) of the owned range."""
        optimizer, flat = self.optimizer, self.optimizer.flat
        start, end = optimizer.start, optimizer.end
        moments = {key: torch.zeros(end - start, dtype=self.state_dtype) for key in MOMENTS}
        for slot in flat.slots:
            spec, name = sharding[slot.name], stored_as.get(slot.name, slot.name)
            local = spec.local_piece(reader.parameter(name), dims.tp_rank, dims.tp).reshape(-1)
            flat.params[slot.offset : slot.offset + slot.numel].copy_(local)
            lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
            if lo >= hi:
                continue
            kept = slice(lo - slot.offset, hi - slot.offset)
            if optimizer.master is not None:
                # At the precision stored: fp32 masters (or an fp32 run's weights) stay exact.
                optimizer.master[lo - start : hi - start] = local[kept]
            for key, target in moments.items():
                moment = spec.local_piece(reader.moment(name, key), dims.tp_rank, dims.tp)
                target[lo - start : hi - start] = moment.reshape(-1)[kept]
        optimizer.load_moments(moments["exp_avg"], moments["exp_avg_sq"], reader.step())
