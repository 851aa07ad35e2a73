"""What `distributed.zero.ShardedAdamW` writes into a checkpoint, and how it reads it back.

Per (tp, pp) coordinate, dp rank 0 writes the parameters (the fp32 master
weights under bf16 parameters, gathered from their ZeRO-1 owners one tensor
at a time) and where each sits in the flat buffer; every ZeRO-1 owner (dp rank
0 alone without ZeRO-1) writes AdamW's moments over its range of that buffer.
Reading rebuilds each tensor at its full size from any layout's files
(`checkpoint.load.CheckpointReader`) and keeps this rank's piece and range.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from meshtrain.checkpoint import files
from meshtrain.checkpoint.load import CheckpointReader
from meshtrain.checkpoint.manifest import write_json_atomic
from meshtrain.checkpoint.safetensors_format import SafetensorsWriter, TensorSpec
from meshtrain.checkpoint.save import write_moments
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.tensor_parallel import ParameterSharding, local_tensor
from meshtrain.distributed.zero import ShardedAdamW

MOMENTS = ("exp_avg", "exp_avg_sq")


# A tensor of a weights file: its header entry, and what makes its values (collective
# where they are spread over ranks; None on the ranks that do not write).
WeightEntry = tuple[TensorSpec, Callable[[], "torch.Tensor | None"]]


def write_weights(path: Path, entries: list[WeightEntry], *, writer: bool) -> None:
    """One weights file, tensor by tensor: every rank makes each entry's values in the
    same order (their collectives match), the `writer` writes them."""
    if not writer:
        for _, values in entries:
            values()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    specs = [spec for spec, _ in entries]
    with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as out:
        for spec, values in entries:
            out.write(spec.name, values())


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
        writer = dims.dp_cp_rank == 0
        weights = files.shard_weights(root, dims.tp_rank, dims.pp_rank)
        write_weights(weights, self.weight_entries(parameters, dims), writer=writer)
        if writer:
            # Where each parameter sits in this coordinate's flat buffer, so optimizer
            # moments (saved as flat ranges) can be resharded onto another layout.
            index = files.flat_index(root, dims.tp_rank, dims.pp_rank)
            write_json_atomic(index, self.optimizer.flat.index())
        self.write_own_moments(root, dims)

    def weight_entries(
        self, parameters: Mapping[str, torch.Tensor], dims: ParallelDims
    ) -> list[WeightEntry]:
        """What the coordinate's weights file holds of this optimizer's parameters: under
        bf16 parameters the fp32 master weights (so resume is exact and consolidation
        loses nothing; under ZeRO-1 each gathered from its owners as it is written), else
        the parameters, streamed from their own memory (no serialised copy)."""
        optimizer = self.optimizer
        if optimizer.master is not None:
            slots = [slot for slot in optimizer.flat.slots if slot.name in parameters]
            return [
                (TensorSpec(s.name, self.state_dtype, s.shape), partial(optimizer.full_master, s))
                for s in slots
            ]
        return [
            (
                TensorSpec(name, p.dtype, tuple(local_tensor(p).shape)),
                partial(lambda p: local_tensor(p).detach(), p),
            )
            for name, p in parameters.items()
        ]

    def write_own_moments(self, root: Path, dims: ParallelDims) -> None:
        """Its range of AdamW's moments (every ZeRO-1 owner; dp rank 0 without ZeRO-1)."""
        if not self.writes_moments(dims):
            return
        optimizer = self.optimizer
        name = files.optimizer_file_name(dims.dp_cp_rank, dims.tp_rank, dims.pp_rank)
        write_moments(
            root / files.OPTIMIZER / name,
            dtype=self.state_dtype,
            elements=(optimizer.start, optimizer.end),
            pieces=optimizer.moment_pieces,
            step=optimizer.step_count(),
        )

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
