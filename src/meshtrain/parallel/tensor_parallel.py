"""Tensor (and sequence) parallelism on DTensor, for any model with an adapter plan.

`apply_tensor_parallel` shards the model with the adapter's plan and returns,
for every trainable parameter, what the optimizer and the checkpoint need to
know: along which dimension it is split, how many tp ranks hold a copy of
each element (for the gradient norm), and which gradients need an extra sum
over tp ranks before data-parallel reduction (replicated KV heads, per-head
norms). The communication of tensor parallelism itself happens inside the
DTensor parallel styles and `loss_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from meshtrain.models import llama_family


@dataclass(frozen=True)
class ParameterLayout:
    """Where one trainable parameter lives across the tensor-parallel ranks."""

    name: str
    tp_dim: int | None  # the split dimension, None when every tp rank holds all of it
    copies: int  # tp ranks holding each element: 1 if split, tp if replicated
    kv_replication: int = 1  # KV heads repeated this many times before the split
    head_local: str | None = None  # "q"/"k": per-head norm whose grads are partial sums
    head_dim: int | None = None  # rows per KV head, to undo the replication


def local_tensor(parameter: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's elements (a DTensor's local shard, else itself)."""
    return parameter._local_tensor if isinstance(parameter, DTensor) else parameter


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, kv_replication: int
) -> dict[str, ParameterLayout]:
    """Shard `model` in place over `tp_mesh`; returns each parameter's layout by name."""
    replicated_kv = set(llama_family.replicate_kv_heads(model, kv_replication))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    parallelize_module(
        model,
        tp_mesh,
        llama_family.tensor_parallel_plan(model, sequence_parallel=sequence_parallel),
    )
    if tied and hasattr(model, "lm_head") and hasattr(model.model, "embed_tokens"):
        # parallelize_module gave each module its own DTensor; both are vocab-sharded
        # on dim 0, so re-tying keeps one parameter whose gradient sums both uses.
        model.lm_head.weight = model.model.embed_tokens.weight
    head_local = llama_family.head_local_parameters(model)
    head_dim = llama_family.decoder_layers(model)[0][1].self_attn.head_dim
    tp = tp_mesh.size()
    layouts = {}
    for name, parameter in model.named_parameters():
        tp_dim = None
        if isinstance(parameter, DTensor):
            shards = [p.dim for p in parameter.placements if isinstance(p, Shard)]
            tp_dim = shards[0] if shards else None
        kv = kv_replication if name in replicated_kv else 1
        copies = tp if tp_dim is None else kv
        layouts[name] = ParameterLayout(
            name, tp_dim, copies, kv, head_local.get(name), head_dim if kv > 1 else None
        )
    return layouts


def plain_layouts(model: nn.Module) -> dict[str, ParameterLayout]:
    """Layouts of an unsharded model (tp = 1)."""
    return {name: ParameterLayout(name, None, 1) for name, _ in model.named_parameters()}


class TensorParallelGradSync:
    """Sums the gradients that tensor parallelism leaves partial, before dp reduction.

    * a per-head norm weight (Qwen3's q_norm/k_norm) sees only its rank's
      heads: sum over the tp ranks (a replicated KV head's norm is then
      counted `kv_replication` times, so divide by it);
    * a replicated KV head's copies each saw some of its query heads: sum
      over the ranks holding copies of the same head.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        layouts: dict[str, ParameterLayout],
        mesh: DeviceMesh,
        kv_replication: int,
    ) -> None:
        self.tp_group = mesh.get_group("tp") if mesh["tp"].size() > 1 else None
        self.head_local = [
            (params[n], 1.0 if layout.head_local == "q" else 1.0 / kv_replication)
            for n, layout in layouts.items()
            if layout.head_local
        ]
        self.kv_copies = [params[n] for n, layout in layouts.items() if layout.kv_replication > 1]
        # Their gradients are final only after this sum (data parallelism waits for it).
        self.parameter_names = frozenset(
            n for n, layout in layouts.items() if layout.head_local or layout.kv_replication > 1
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
        for parameter, scale in self.head_local:
            grad = local_tensor(parameter.grad)
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.tp_group)
            if scale != 1.0:
                grad.mul_(scale)
        for parameter in self.kv_copies:
            dist.all_reduce(local_tensor(parameter.grad), op=dist.ReduceOp.SUM, group=self.kv_group)
