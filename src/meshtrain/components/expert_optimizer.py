"""AdamW for a model whose experts are split over expert-parallel ranks, and its side of a
checkpoint.

Under expert parallelism the ranks of a data-parallel group no longer hold the same
parameters: the experts differ from one ep rank to the next. So there are two flat
buffers, each with its own `ShardedAdamW`: the dense parameters (attention, routers,
norms, embeddings), averaged and ZeRO-1-sharded over the dp x cp ranks as in any run,
and this rank's experts, whose gradients are summed over the ranks that hold the same
experts (`ParallelDims.expert_replica_group`) and divided by dp x cp (each expert's
gradient already holds what every ep rank's tokens gave it), and ZeRO-1-sharded over
those replicas. The global gradient norm adds the two: the experts' squares summed over
the ep group too, whose ranks hold different experts.

A checkpoint of it is indistinguishable from one of the same model without expert
parallelism (as a sharded run's is): the coordinate's weights file holds every expert,
gathered over the ep group one tensor at a time onto dp rank 0; the flat index lists the
experts after the dense buffer, at their full shapes, and one moments file covers that
range. So the loader, resharding onto any ep (or none) and consolidation read it as
they read any checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from meshtrain.checkpoint import files
from meshtrain.checkpoint.load import CheckpointReader
from meshtrain.checkpoint.manifest import write_json_atomic
from meshtrain.checkpoint.safetensors_format import TensorSpec
from meshtrain.checkpoint.save import write_moments
from meshtrain.components.zero_state import MOMENTS, WeightEntry, ZeroState, write_weights
from meshtrain.distributed.expert_parallel import gather_experts
from meshtrain.distributed.flat_buffer import Slot
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.tensor_parallel import ParameterSharding, local_tensor
from meshtrain.distributed.zero import ShardedAdamW


@dataclass(frozen=True)
class ExpertSplitAdamW:
    """The dense parameters' AdamW and the experts' (`components.optimizer.ModelOptimizer`)."""

    dense: ShardedAdamW
    experts: ShardedAdamW

    def reduce_gradients(self) -> torch.Tensor:
        dense, experts = self.dense.reduce_gradients(), self.experts.reduce_gradients()
        return torch.sqrt(dense.square() + experts.square())

    def apply(self, grad_norm: torch.Tensor) -> None:
        self.dense.apply(grad_norm)
        self.experts.apply(grad_norm)

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.experts.zero_grad()

    def set_learning_rate(self, lr: float) -> None:
        self.dense.set_learning_rate(lr)
        self.experts.set_learning_rate(lr)

    def wait_for_parameters(self) -> None:
        self.dense.wait_for_parameters()
        self.experts.wait_for_parameters()

    @property
    def model_states_bytes(self) -> int:
        return self.dense.model_states_bytes + self.experts.model_states_bytes

    def held_tensors(self) -> list[torch.Tensor]:
        return self.dense.held_tensors() + self.experts.held_tensors()

    def bucket_summary(self) -> dict[str, int]:
        dense, experts = self.dense.bucket_summary(), self.experts.bucket_summary()
        return {key: dense.get(key, 0) + experts.get(key, 0) for key in dense | experts}

    def check_views(self) -> None:
        self.dense.check_views()
        self.experts.check_views()


@dataclass(frozen=True)
class ExpertSplitState:
    """`ExpertSplitAdamW`'s side of a checkpoint (`checkpoint.checkpointer.OptimizerState`)."""

    optimizer: ExpertSplitAdamW

    @property
    def state_dtype(self) -> torch.dtype:
        return self.optimizer.dense.state_dtype

    def _parts(self) -> tuple[ZeroState, ZeroState]:
        return ZeroState(self.optimizer.dense), ZeroState(self.optimizer.experts)

    def checkpoint_bytes(
        self,
        parameters: Mapping[str, torch.Tensor],
        sharding: Mapping[str, ParameterSharding],
        dims: ParallelDims,
    ) -> int:
        """The dense part's, and on dp rank 0 every expert's weights and two moments."""
        dense, _ = self._parts()
        total = dense.checkpoint_bytes(self._dense(parameters), sharding, dims)
        if dims.dp_cp_rank == 0:
            total += 3 * self._expert_numel(dims) * self.state_dtype.itemsize
        return total

    def save_state(
        self,
        root: Path,
        parameters: Mapping[str, torch.Tensor],
        sharding: Mapping[str, ParameterSharding],
        dims: ParallelDims,
    ) -> None:
        """The coordinate's weights file (dense tensors and every expert) and flat index,
        written by dp rank 0; the dense moments by their owners; the experts' moments,
        gathered, by dp rank 0."""
        dense, _ = self._parts()
        writer = dims.dp_cp_rank == 0
        entries = dense.weight_entries(self._dense(parameters), dims)
        entries += self._expert_weights(parameters, dims)
        write_weights(files.shard_weights(root, dims.tp_rank, dims.pp_rank), entries, writer=writer)
        if writer:
            index = files.flat_index(root, dims.tp_rank, dims.pp_rank)
            write_json_atomic(index, self._index(dims))
        dense.write_own_moments(root, dims)
        self._write_expert_moments(root, dims)

    def load_state(
        self,
        reader: CheckpointReader,
        sharding: Mapping[str, ParameterSharding],
        dims: ParallelDims,
        stored_as: Mapping[str, str],
    ) -> None:
        """Each part reads its tensors at full size from any layout's checkpoint and keeps
        its piece (the experts: this ep rank's)."""
        for part in self._parts():
            part.load_state(reader, sharding, dims, stored_as)

    # -- the experts, gathered onto dp rank 0 ------------------------------------------------

    def _dense(self, parameters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        experts = {slot.name for slot in self.optimizer.experts.flat.slots}
        return {name: p for name, p in parameters.items() if name not in experts}

    def _expert_numel(self, dims: ParallelDims) -> int:
        return sum(slot.numel for slot in self.optimizer.experts.flat.slots) * dims.ep

    def _whole(self, local: torch.Tensor | None, dims: ParallelDims) -> torch.Tensor | None:
        """Every expert of one parameter on dp rank 0, from each ep rank's `local` experts
        (held by the first replica, dp x cp ranks 0..ep-1)."""
        if dims.dp_cp_rank >= dims.ep:
            return None
        return gather_experts(local, dims.ep_group)

    def _expert_weights(
        self, parameters: Mapping[str, torch.Tensor], dims: ParallelDims
    ) -> list[WeightEntry]:
        experts = self.optimizer.experts

        def whole(slot: Slot) -> torch.Tensor | None:
            if experts.master is not None:
                local = experts.full_master(slot)
            else:
                local = local_tensor(parameters[slot.name]).detach()
            return self._whole(local, dims)

        return [
            (TensorSpec(s.name, self.state_dtype, self._full_shape(s, dims)), partial(whole, s))
            for s in experts.flat.slots
        ]

    @staticmethod
    def _full_shape(slot: Slot, dims: ParallelDims) -> tuple[int, ...]:
        return (slot.shape[0] * dims.ep, *slot.shape[1:])

    def _index(self, dims: ParallelDims) -> dict:
        """The dense buffer's index, the experts after it at their full shapes (where the
        experts' moments file puts them)."""
        index = self.optimizer.dense.flat.index()
        offset = self._experts_start()
        for slot in self.optimizer.experts.flat.slots:
            shape = self._full_shape(slot, dims)
            numel = slot.numel * dims.ep
            index["slots"].append([slot.name, offset, numel, list(shape)])
            offset += numel
        return index

    def _experts_start(self) -> int:
        return self.optimizer.dense.flat.padded_numel

    def _write_expert_moments(self, root: Path, dims: ParallelDims) -> None:
        """Every expert's moments, whole, in the index's order, on dp rank 0; the other
        ranks send theirs (the gathers run in the same order everywhere)."""
        experts = self.optimizer.experts
        if dims.dp_cp_rank != 0:
            for key in MOMENTS:
                for _ in self._expert_moments(key, dims):
                    pass
            return
        start = self._experts_start()
        write_moments(
            root / files.OPTIMIZER / files.expert_optimizer_file_name(dims.tp_rank, dims.pp_rank),
            dtype=self.state_dtype,
            elements=(start, start + self._expert_numel(dims)),
            pieces=partial(self._expert_moments, dims=dims),
            step=experts.step_count(),
        )

    def _expert_moments(self, key: str, dims: ParallelDims) -> Iterator[torch.Tensor]:
        experts = self.optimizer.experts
        owned = torch.cat(experts.moment_pieces(key))
        for slot in experts.flat.slots:
            whole = self._whole(experts.gather_slot(owned, slot), dims)
            if whole is not None:
                yield whole.reshape(-1)
