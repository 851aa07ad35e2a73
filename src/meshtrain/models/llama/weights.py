"""Where a rank's parameters come from, one tensor at a time: a seeded random init, or the
slices of a Hugging Face checkpoint.

The model is built on the meta device and parallelised there; then each rank
allocates only its own shards and fills them from a `WeightSource` by Hugging
Face name (`materialize`). So no rank ever holds the whole model: at most one
full tensor at a time while initialising randomly, and from a checkpoint only
the byte ranges of its own slices (safetensors slicing).

The random init is Hugging Face's recipe for the Llama family (normal(0,
`initializer_range`) matrices and embeddings with the padding row zeroed, zero
biases, unit norms), drawn per parameter from a generator seeded by the run's
seed and the parameter's name: the same weights whatever the layout, the
order of building or the stages a rank holds.
"""

from __future__ import annotations

import dataclasses
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from meshtrain.checkpoint.expert_layout import router_stored_name, stored_expert_names
from meshtrain.distributed.fsdp import shard_piece
from meshtrain.distributed.tensor_parallel import ParameterSharding, local_tensor
from meshtrain.models.llama.parameter_names import EMBEDDING, llama_family_shapes, stored_name
from meshtrain.models.llama.pretrained import weight_files
from meshtrain.models.moe_config import num_experts


class WeightSource(Protocol):
    def local(self, name: str, spec: ParameterSharding, tp_rank: int, tp: int) -> torch.Tensor:
        """This tp rank's piece of parameter `name` (a Hugging Face name)."""
        ...


class RandomInit:
    """Hugging Face's Llama-family init, drawn per parameter from (seed, name)."""

    def __init__(self, config: PretrainedConfig, seed: int) -> None:
        self.config, self.shapes = config, llama_family_shapes(config)
        self.std = getattr(config, "initializer_range", None) or 0.02
        self.padding_idx = getattr(config, "pad_token_id", None)
        self.seed = seed

    def full(self, name: str) -> torch.Tensor:
        """The whole Hugging Face tensor `name`, as every layout draws it."""
        name = stored_name(name, self.config)
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        stream = (self.seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63
        generator = torch.Generator().manual_seed(stream)
        tensor = torch.empty(shape).normal_(0.0, self.std, generator=generator)
        if name == EMBEDDING and self.padding_idx is not None:
            tensor[self.padding_idx] = 0.0
        return tensor

    def local(self, name: str, spec: ParameterSharding, tp_rank: int, tp: int) -> torch.Tensor:
        return spec.local_piece(self.full(name), tp_rank, tp)


class PretrainedWeights:
    """Slices of a Hugging Face checkpoint folder (one safetensors file or several)."""

    def __init__(self, folder: str | Path, config: PretrainedConfig, stack: ExitStack) -> None:
        self.files = weight_files(folder)
        self.config = config
        self._stack = stack
        self._handles: dict[Path, Any] = {}

    def _slice(self, name: str) -> Any:
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(str(path), "pt"))
        return self._handles[path].get_slice(name)

    def local(self, name: str, spec: ParameterSharding, tp_rank: int, tp: int) -> torch.Tensor:
        experts = stored_expert_names(self.config.model_type, num_experts(self.config), name)
        if experts is not None:  # one tensor per expert on disk: this rank's, stacked
            per_rank = len(experts) // spec.ep
            mine = experts[spec.ep_rank * per_rank : (spec.ep_rank + 1) * per_rank]
            return dataclasses.replace(spec, ep=1).local_piece(self._stacked(mine), tp_rank, tp)
        stored = self._slice(
            router_stored_name(self.config.model_type, stored_name(name, self.config))
        )
        if spec.tp_dim is None or spec.kv_replication > 1:
            # Whole, or KV heads repeated before the split (small: a few KV heads).
            return spec.local_piece(stored[:], tp_rank, tp)
        shape = stored.get_shape()
        size = shape[spec.tp_dim] // tp
        index = [slice(None)] * len(shape)
        index[spec.tp_dim] = slice(tp_rank * size, (tp_rank + 1) * size)
        return stored[tuple(index)]

    def _stacked(self, experts: list[list[str]]) -> torch.Tensor:
        """A 3-D experts parameter from its stored parts (per expert, in stacking order)."""
        return torch.stack([torch.cat([self._slice(p)[:] for p in names]) for names in experts])


def materialize(
    modules: list[nn.Module],
    sharding: dict[str, ParameterSharding],
    source: WeightSource,
    device: torch.device,
    *,
    tp_rank: int,
    tp: int,
    dp_shard: tuple[int, int] = (0, 1),
    expert_shard: tuple[int, int] = (0, 1),
) -> None:
    """Allocate this rank's (meta-device) stages on `device` and fill every parameter with
    its piece from `source`; the rotary tables, computed at construction, are rebuilt.
    `dp_shard`: (rank, size) of sharded data parallelism, whose FSDP2 shard of each piece
    is what this rank keeps; `expert_shard`: the same of the experts under expert
    parallelism (sharded over the ranks that hold them)."""
    for module in modules:
        module.to_empty(device=device)
        if getattr(module.config, "tie_word_embeddings", False) and _holds_both(module):
            # Leaving the meta device makes new parameters: tie the two again.
            module.lm_head.weight = module.model.embed_tokens.weight
        rotary = module.model.rotary_emb
        module.model.rotary_emb = type(rotary)(module.config).to(device)
        with torch.no_grad():
            for name, parameter in module.named_parameters():
                piece = source.local(name, sharding[name], tp_rank, tp)
                shard_rank, shards = expert_shard if sharding[name].ep > 1 else dp_shard
                if shards > 1:
                    piece = shard_piece(piece, shard_rank, shards)
                local_tensor(parameter).copy_(piece)


def _holds_both(module: nn.Module) -> bool:
    return hasattr(module, "lm_head") and hasattr(module.model, "embed_tokens")
