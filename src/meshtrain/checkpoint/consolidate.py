"""Merge a sharded checkpoint into a plain Hugging Face model folder.

The output loads with `AutoModelForCausalLM.from_pretrained` and no meshtrain
import: `config.json`, `model.safetensors`, and the tokenizer files. Shards are
opened memory-mapped and read tensor by tensor; a tensor split over
tensor-parallel ranks is concatenated along the dimension the manifest names.
"""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshtrain.checkpoint.manifest import (
    CheckpointError,
    read_manifest,
    resolve_checkpoint,
    shard_dir_name,
)


def drop_kv_copies(full: torch.Tensor, copies: int, head_dim: int, shape: list[int]):
    """Keep one of each run of `copies` identical KV heads along dim 0."""
    heads = full.shape[0] // (copies * head_dim)
    if heads * copies * head_dim != full.shape[0]:
        raise CheckpointError(f"cannot undo KV replication of a {list(full.shape)} tensor")
    return full.reshape(heads, copies, head_dim, *full.shape[1:])[:, 0].reshape(shape)


def consolidate_checkpoint(
    checkpoint: str | Path, output_dir: str | Path, *, verify: bool = True
) -> dict[str, Any]:
    """Write the full model of `checkpoint` to `output_dir`; returns a summary."""
    root = resolve_checkpoint(Path(checkpoint))
    manifest = read_manifest(root, verify=verify)
    tp = manifest["layout"]["tensor_parallel_size"]
    output_dir = Path(output_dir)
    partial = output_dir.with_name(output_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)

    tensors: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles: dict[tuple[int, int], Any] = {}

        def shard(tp_rank: int, pp_rank: int):
            key = (tp_rank, pp_rank)
            if key not in handles:
                path = root / "shards" / shard_dir_name(tp_rank, pp_rank) / "model.safetensors"
                if not path.is_file():
                    raise CheckpointError(f"missing shard file {path}")
                handles[key] = stack.enter_context(safe_open(str(path), framework="pt"))
            return handles[key]

        for name, meta in manifest["tensors"].items():
            pp_rank = meta["pp_rank"]
            if meta["tp_dim"] is None:
                full = shard(0, pp_rank).get_tensor(name)
            else:
                parts = [shard(r, pp_rank).get_tensor(name) for r in range(tp)]
                full = torch.cat(parts, dim=meta["tp_dim"])
            copies = meta.get("kv_replication", 1)
            if copies > 1:
                full = drop_kv_copies(full, copies, meta["kv_head_dim"], meta["shape"])
            if list(full.shape) != meta["shape"]:
                raise CheckpointError(
                    f"tensor {name} rebuilt with shape {list(full.shape)}, "
                    f"the manifest says {meta['shape']}"
                )
            tensors[name] = full.contiguous()
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})

    shutil.copy2(root / "config.json", partial / "config.json")
    if (root / "generation_config.json").is_file():
        shutil.copy2(root / "generation_config.json", partial / "generation_config.json")
    tokenizer = root / "tokenizer"
    if tokenizer.is_dir():
        for item in tokenizer.iterdir():
            shutil.copy2(item, partial / item.name)

    shutil.rmtree(output_dir, ignore_errors=True)
    partial.rename(output_dir)
    return {
        "checkpoint": str(root),
        "step": manifest["step"],
        "output_dir": str(output_dir),
        "num_tensors": len(tensors),
        "num_parameters": sum(t.numel() for t in tensors.values()),
        "layout": manifest["layout"],
    }
