"""What `distributed.fsdp_optimizer.FSDPAdamW` writes into a checkpoint, and how it
reads it back: the format every other layout writes.

A sharded run's checkpoint is indistinguishable from a plain data-parallel
one: per (tp, pp) coordinate, one weights file of its tensor-parallel pieces,
the flat index of those pieces and one optimizer file of their AdamW moments
over the whole range, all written by dp rank 0. Each tensor is gathered from
its FSDP shards onto that rank as it is written (`dist.gather` over the shard
group: one tensor of memory, never the model), so the loader, resharding and
consolidation read it unchanged, and a sharded run resumes from any layout's
checkpoint the same way: each tensor rebuilt at full size, cut to this rank's
tp piece, then to its FSDP shard.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.checkpoint import files
from meshtrain.checkpoint.load import CheckpointReader
from meshtrain.checkpoint.manifest import write_json_atomic
from meshtrain.checkpoint.safetensors_format import SafetensorsWriter, TensorSpec
from meshtrain.checkpoint.save import write_moments
from meshtrain.distributed.expert_parallel import gather_experts
from meshtrain.distributed.fsdp import shard_piece
from meshtrain.distributed.fsdp_optimizer import FSDPAdamW
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.tensor_parallel import ParameterSharding, local_tensor


def full_shape(parameter: torch.Tensor, spec: ParameterSharding, tp: int) -> tuple[int, ...]:
    """The shape a checkpoint stores: the tp piece, with every expert (expert parallelism)."""
    shape = tp_local_shape(parameter, spec, tp)
    return (shape[0] * spec.ep, *shape[1:])


def tp_local_shape(parameter: torch.Tensor, spec: ParameterSharding, tp: int) -> tuple[int, ...]:
    """The shape of this rank's tensor-parallel piece (before FSDP's dp sharding)."""
    shape = list(parameter.shape)
    if spec.tp_dim is not None:
        shape[spec.tp_dim] //= tp
    return tuple(shape)


def gather_piece(
    shard: torch.Tensor, shape: tuple[int, ...], dims: ParallelDims, experts: bool = False
):
    """The tp piece of `shape` from its FSDP shards, on shard rank 0 (None elsewhere).
    Collective over the shard group; shards are padded to FSDP's chunk size to gather.
    `experts`: a parameter of the experts under expert parallelism, sharded over their
    replicas: gathered there, then over the ep group, onto dp rank 0, at its full shape."""
    rank, n, group = dims.fsdp_shards(experts)
    rows = shape[0]
    chunk = -(-rows // n)
    padded = shard.new_zeros((chunk, *shape[1:]))
    padded[: shard.shape[0]] = shard
    root = rank == 0
    whole = shard.new_empty((chunk * n, *shape[1:])) if root else None
    dist.gather(padded, list(whole.chunk(n)) if root else None, group_dst=0, group=group)
    piece = whole[:rows] if root else None
    if experts and dims.ep > 1 and root:
        return gather_experts(piece, dims.ep_group)
    return piece


def flat_index(shapes: dict[str, tuple[int, ...]]) -> dict:
    """Where each tensor's moments sit in the optimizer file: one after another, in
    parameter order (the flat buffer's index format, without its padding)."""
    slots, offset = [], 0
    for name, shape in shapes.items():
        numel = torch.Size(shape).numel()
        slots.append([name, offset, numel, list(shape)])
        offset += numel
    return {"numel": offset, "padded_numel": offset, "slots": slots}


@dataclass(frozen=True)
class FSDPState:
    """`FSDPAdamW`'s side of a checkpoint (`checkpoint.checkpointer.OptimizerState`)."""

    optimizer: FSDPAdamW

    @property
    def state_dtype(self) -> torch.dtype:
        return self.optimizer.state_dtype

    def checkpoint_bytes(
        self,
        parameters: Mapping[str, torch.Tensor],
        sharding: Mapping[str, ParameterSharding],
        dims: ParallelDims,
    ) -> int:
        """On dp rank 0, its coordinate's weights and two moments; nothing elsewhere."""
        if dims.dp_cp_rank != 0:
            return 0
        shapes = (full_shape(p, sharding[n], dims.tp) for n, p in parameters.items())
        return 3 * sum(torch.Size(s).numel() for s in shapes) * self.state_dtype.itemsize

    def save_state(
        self,
        root: Path,
        parameters: Mapping[str, torch.Tensor],
        sharding: Mapping[str, ParameterSharding],
        dims: ParallelDims,
    ) -> None:
        """The first replica's shard group gathers each tensor to its dp rank 0, which
        writes it (other replicas hold the same shards)."""
        if dims.dp_cp_rank >= dims.shard_degree:
            return  # not in the first replica: its shards are copies of the first's
        local = {n: tp_local_shape(p, sharding[n], dims.tp) for n, p in parameters.items()}
        shapes = {n: full_shape(p, sharding[n], dims.tp) for n, p in parameters.items()}
        experts = self.optimizer.experts

        def gathered(key: str | None) -> Iterator[torch.Tensor | None]:
            for name, p in parameters.items():
                shard = (
                    local_tensor(p).detach()
                    if key is None
                    else self.optimizer.local_moment(name, key)
                )
                yield gather_piece(shard, local[name], dims, experts=name in experts)

        if dims.dp_cp_rank != 0:
            for key in (None, "exp_avg", "exp_avg_sq"):
                for _ in gathered(key):
                    pass  # this rank's sends
            return
        weights = files.shard_weights(root, dims.tp_rank, dims.pp_rank)
        weights.parent.mkdir(parents=True, exist_ok=True)
        specs = [TensorSpec(name, self.state_dtype, shape) for name, shape in shapes.items()]
        with SafetensorsWriter(weights, specs, metadata={"format": "pt"}) as writer:
            for name, piece in zip(shapes, gathered(None), strict=True):
                writer.write(name, piece)
        write_json_atomic(files.flat_index(root, dims.tp_rank, dims.pp_rank), flat_index(shapes))
        numel = sum(torch.Size(shape).numel() for shape in shapes.values())
        write_moments(
            root / files.OPTIMIZER / files.optimizer_file_name(0, dims.tp_rank, dims.pp_rank),
            dtype=self.state_dtype,
            elements=(0, numel),
            pieces=gathered,
            step=self.optimizer.step_count(),
        )

    def load_state(
        self,
        reader: CheckpointReader,
        sharding: Mapping[str, ParameterSharding],
        dims: ParallelDims,
        stored_as: Mapping[str, str],
    ) -> None:
        """Fill this rank's FSDP shards of the parameters and moments from `reader` (a
        checkpoint of any layout), one tensor at a time."""

        def mine(full: torch.Tensor, spec: ParameterSharding) -> torch.Tensor:
            piece = spec.local_piece(full, dims.tp_rank, dims.tp)
            rank, shards, _ = dims.fsdp_shards(experts=spec.ep > 1)
            return shard_piece(piece, rank, shards)

        moments: dict[str, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for name, p in self.optimizer.parameters.items():
                spec, stored = sharding[name], stored_as.get(name, name)
                local_tensor(p).copy_(mine(reader.parameter(stored), spec))
                moments[name] = {
                    key: mine(reader.moment(stored, key), spec).clone()
                    for key in ("exp_avg", "exp_avg_sq")
                }
        self.optimizer.load_moments(moments, reader.step())
