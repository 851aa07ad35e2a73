"""Tensor (and sequence) parallelism on DTensor: what is generic to every model.

A model's own module (e.g. `meshtrain.models.llama.tensor_parallel`) applies its
plan with `parallelize_module`; this module then records, for every
trainable parameter, what the optimizer and the checkpoint need to know
(`ParameterSharding`): along which dimension it is split, how many tp ranks
hold a copy of each element (for the gradient norm), and which gradients need
an extra sum over tp ranks before data-parallel reduction (replicated KV
heads, per-head norms, a mixture of experts' routers and experts, which run on
the rank's sequence shard). The communication of tensor parallelism itself
happens inside the DTensor parallel styles and `loss_parallel`.
"""

from __future__ import annotations

import types
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshtrain.distributed.kv_heads import repeat_kv_heads


@dataclass(frozen=True)
class ParameterSharding:
    """How one trainable parameter is split over the tensor-parallel ranks (and, for a
    mixture of experts' experts, over the expert-parallel ranks: along the expert
    dimension, the first, before any tp split)."""

    name: str
    tp_dim: int | None  # the split dimension, None when every tp rank holds all of it
    copies: int  # tp ranks holding each element: 1 if split, tp if replicated
    kv_replication: int = 1  # KV heads repeated this many times before the split
    head_local: str | None = None  # "q"/"k": per-head norm whose grads are partial sums
    head_dim: int | None = None  # rows per KV head, to undo the replication
    ep: int = 1  # expert-parallel ranks the experts (dimension 0) are split over
    ep_rank: int = 0  # which of those pieces this rank holds
    # Whole on every tp rank but run on its sequence shard only (a sparse layer's router
    # and experts under sequence parallelism): its gradients are partial sums over tp.
    sequence_local: bool = False

    def hf_shape(self, global_shape: Sequence[int]) -> list[int]:
        """The Hugging Face tensor's shape, from the (DTensor's) global one: each KV head
        once, every expert."""
        return [global_shape[0] // self.kv_replication * self.ep, *global_shape[1:]]

    def local_piece(self, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
        """This tp rank's part of the full Hugging Face tensor (KV heads repeated first);
        of experts, this ep rank's experts."""
        if self.ep > 1:
            full = torch.chunk(full, self.ep, dim=0)[self.ep_rank]
        if self.tp_dim is None:
            return full
        full = repeat_kv_heads(full, self.kv_replication, self.head_dim or 0)
        return torch.chunk(full, tp, dim=self.tp_dim)[tp_rank]


def as_local(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as a plain tensor (plain tensors pass through)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def local_tensor(parameter: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's elements (a DTensor's local shard, else itself)."""
    return parameter._local_tensor if isinstance(parameter, DTensor) else parameter


def accumulated_grad(parameter: torch.Tensor) -> torch.Tensor:
    """The gradient the backward accumulated for `parameter`, as a local tensor: its view of
    the flat gradient buffer (`main_grad`, fp32 under bf16 parameters), else its `.grad`."""
    main = getattr(parameter, "main_grad", None)
    return main if main is not None else local_tensor(parameter.grad)


def read_sharding(
    model: nn.Module,
    tp: int,
    *,
    kv_replicated: Collection[str] = (),
    kv_replication: int = 1,
    head_dim: int | None = None,
    head_local: dict[str, str] | None = None,
    sequence_local: Collection[str] = (),
) -> dict[str, ParameterSharding]:
    """Every parameter's sharding, read off a model its plan has already sharded.

    `kv_replicated`: names of the parameters whose KV heads were repeated
    `kv_replication` times (of `head_dim` rows each); `head_local`: name -> "q"/"k"
    for per-head norm weights; `sequence_local`: names of the parameters that run on
    the rank's sequence shard only.
    """
    head_local = head_local or {}
    sharding = {}
    for name, parameter in model.named_parameters():
        tp_dim = None
        if isinstance(parameter, DTensor):
            shards = [p.dim for p in parameter.placements if isinstance(p, Shard)]
            tp_dim = shards[0] if shards else None
        kv = kv_replication if name in kv_replicated else 1
        copies = tp if tp_dim is None else kv
        sharding[name] = ParameterSharding(
            name,
            tp_dim,
            copies,
            kv,
            head_local.get(name),
            head_dim if kv > 1 else None,
            sequence_local=name in sequence_local,
        )
    return sharding


def unsharded(model: nn.Module) -> dict[str, ParameterSharding]:
    """The sharding of a model without tensor parallelism (tp = 1): nothing split."""
    return {name: ParameterSharding(name, None, 1) for name, _ in model.named_parameters()}


class TensorParallelGradSync:
    """Sums the gradients that tensor parallelism leaves partial, before dp reduction.

    * a per-head norm weight (Qwen3's q_norm/k_norm) sees only its rank's
      heads: sum over the tp ranks (a replicated KV head's norm is then
      counted `kv_replication` times, so divide by it);
    * a replicated KV head's copies each saw some of its query heads: sum
      over the ranks holding copies of the same head;
    * a sequence-local parameter (a sparse layer's router and experts) saw only
      the rank's tokens: sum over the tp ranks.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        sharding: dict[str, ParameterSharding],
        mesh: DeviceMesh,
        kv_replication: int,
    ) -> None:
        self.tp_group = mesh.get_group("tp") if mesh["tp"].size() > 1 else None
        # (parameter, scale) of the gradients that are partial sums over the tp ranks.
        self.partial = [
            (params[n], 1.0 if spec.head_local != "k" else 1.0 / kv_replication)
            for n, spec in sharding.items()
            if spec.head_local or spec.sequence_local
        ]
        self.kv_copies = [params[n] for n, spec in sharding.items() if spec.kv_replication > 1]
        # Their gradients are final only after this sum (data parallelism waits for it).
        self.parameter_names = frozenset(
            n
            for n, spec in sharding.items()
            if spec.head_local or spec.kv_replication > 1 or spec.sequence_local
        )
        self.kv_group = None
        if kv_replication > 1:
            # Ranks holding copies of one KV head are neighbours on the tp axis.
            pp, dp, tp = (mesh[d].size() for d in ("pp", "dp", "tp"))
            grid = mesh.mesh.reshape(pp, dp, tp // kv_replication, kv_replication)
            kv_mesh = DeviceMesh(
                mesh.device_type, grid, mesh_dim_names=("pp", "dp", "kv_head", "kv_copy")
            )
            self.kv_group = kv_mesh.get_group("kv_copy")

    def __call__(self) -> None:
        for parameter, scale in self.partial:
            grad = accumulated_grad(parameter)
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.tp_group)
            if scale != 1.0:
                grad.mul_(scale)
        for parameter in self.kv_copies:
            dist.all_reduce(accumulated_grad(parameter), op=dist.ReduceOp.SUM, group=self.kv_group)


class VocabParallelLossHead(ColwiseParallel):
    """An LM head that scores its own tokens (`models.head_loss.ScoringHead`), split on the
    vocabulary: its weight sharded on its rows as ColwiseParallel shards it, its input
    gathered whole (a replicated DTensor) on the way in, and its output, a loss the
    ranks have already combined, left as it is."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205 (torch's signature)
        return outputs


def vocabulary_start(weight: DTensor) -> int:
    """The first vocabulary row of this rank's shard of a vocabulary-sharded weight
    (DTensor's Shard(0): chunks of ceil(vocabulary / tp) rows, the last ones shorter)."""
    mesh = weight.device_mesh
    rows = -(-weight.shape[0] // mesh.size())
    return min(mesh.get_local_rank() * rows, weight.shape[0])


class VocabParallelEmbedding(RowwiseParallel):
    """An embedding split on the vocabulary (its weight sharded on its rows, as
    RowwiseParallel shards it) whose lookup runs on this rank's rows itself: ids outside
    them look up row 0 and are zeroed, and the ranks' outputs add up (a Partial DTensor,
    reduced into `output_layouts`). The backward then makes the gradient of this rank's
    rows only. DTensor's own lookup has no row-wise rule for the embedding's backward and
    makes the whole vocabulary x hidden gradient first: 3.9 GiB a rank for Llama-3.1-70B,
    7.8 for 405B, found by the dry run (docs/dry_run.md)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.forward = types.MethodType(_lookup_own_rows, module)
        return module


def _lookup_own_rows(embedding: nn.Embedding, ids: torch.Tensor) -> DTensor:
    weight = embedding.weight  # DTensor, Shard(0) on the tp mesh
    rows = OwnRows(weight, ids, embedding.padding_idx)
    looked_up = rows.lookup(weight.to_local())
    return DTensor.from_local(looked_up, weight.device_mesh, [Partial()], run_check=False)


class OwnRows:
    """The ids of a lookup in a vocabulary-sharded table, as this rank's rows: ids outside
    them look up row 0 and come out zero, and the padding id keeps its meaning (no
    gradient) where this rank holds it."""

    def __init__(self, weight: DTensor, ids: torch.Tensor, padding_idx: int | None) -> None:
        local_ids = ids.to_local() if isinstance(ids, DTensor) else ids
        start, count = vocabulary_start(weight), weight.to_local().shape[0]
        self.outside = (local_ids < start) | (local_ids >= start + count)
        self.ids = (local_ids - start).masked_fill(self.outside, 0)
        pad = padding_idx
        self.padding_idx = pad - start if pad is not None and start <= pad < start + count else None

    def lookup(self, table: torch.Tensor) -> torch.Tensor:
        """The rows of `table` (this rank's rows x width) the ids pick, zero for the others'."""
        looked_up = F.embedding(self.ids, table, self.padding_idx)
        return looked_up.masked_fill(self.outside.unsqueeze(-1), 0)
