"""Write a sharded checkpoint from every rank, then mark it complete from rank 0."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from meshtrain.checkpoint import files
from meshtrain.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    describe_files,
    list_checkpoints,
    mark_complete,
    write_json_atomic,
)
from meshtrain.checkpoint.safetensors_format import (
    SafetensorsWriter,
    TensorSpec,
    save_safetensors,
)
from meshtrain.checkpoint.sharded_state import sharded_checkpoint_bytes, write_sharded_tensors
from meshtrain.checkpoint.space import (
    CheckpointSpaceError,
    folder_bytes,
    named_write_errors,
    rank_checkpoint_bytes,
    room_problem,
)
from meshtrain.distributed.fsdp_optimizer import FSDPAdamW
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.tensor_parallel import ParameterSharding, local_tensor
from meshtrain.distributed.zero import ShardedAdamW


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    parameters: dict[str, torch.Tensor],
    sharding: dict[str, ParameterSharding],
    optimizer: ShardedAdamW | FSDPAdamW,
    dims: ParallelDims,
    trainer_state: dict[str, Any],
    model_config: PretrainedConfig,
    tokenizer_dir: Path | None,
    keep_last: int,
    tied_copies: dict[str, str] | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint folder.

    `tied_copies`: parameters that are a copy of another one (the last pipeline stage's
    LM head with tied embeddings -> the embedding); stored once, under the other name.
    """
    root = Path(run_dir) / files.checkpoint_name(step)
    parameters = {n: p for n, p in parameters.items() if n not in (tied_copies or {})}
    rank = dist.get_rank()
    sharded = isinstance(optimizer, FSDPAdamW)
    mine_bytes = (
        sharded_checkpoint_bytes(parameters, sharding, optimizer, dims)
        if sharded
        else rank_checkpoint_bytes(parameters, optimizer, dims)
    )
    check_room(run_dir, root, mine_bytes, tokenizer_dir)
    if rank == 0 and root.exists():
        shutil.rmtree(root)  # a leftover from a run that died mid-save
    dist.barrier()

    with named_write_errors(Path(run_dir), root):
        if sharded:
            write_sharded_tensors(root, parameters, sharding, optimizer, dims)
        else:
            write_rank_tensors(root, parameters, optimizer, dims)
        rng = files.rng_file(root, rank)
        rng.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors({"cpu": torch.get_rng_state()}, rng)
        if rank == 0:
            model_config.save_pretrained(root)
            write_json_atomic(root / files.TRAINER_STATE, trainer_state)
            if tokenizer_dir is not None:
                shutil.copytree(tokenizer_dir, root / files.TOKENIZER, dirs_exist_ok=True)
    # Every stage's tensors go in the one manifest: gather their entries (JSON-able dicts).
    stored_dtype = optimizer.state_dtype  # the master weights' under bf16_master
    mine = (
        {n: tensor_entry(p, sharding[n], dims.pp_rank, stored_dtype) for n, p in parameters.items()}
        if dims.dp_rank == 0 and dims.tp_rank == 0
        else {}
    )
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)

    if rank == 0:
        entries = {name: entry for part in gathered for name, entry in part.items()}
        mark_complete(root, _manifest(root, step, trainer_state, entries))
        prune_checkpoints(Path(run_dir), keep_last)
    dist.barrier()
    return root


def check_room(run_dir: Path, root: Path, mine: int, tokenizer_dir: Path | None) -> None:
    """Collective: refuse on every rank, before any byte is written, a checkpoint that
    the filesystem has no room for (rank 0 sums what every rank will write)."""
    sizes: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(sizes, mine)
    verdict: list[str | None] = [None]
    if dist.get_rank() == 0:
        verdict[0] = room_problem(Path(run_dir), root, sum(sizes) + folder_bytes(tokenizer_dir))
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise CheckpointSpaceError(verdict[0])


def write_rank_tensors(
    root: Path, parameters: dict[str, torch.Tensor], optimizer: ShardedAdamW, dims: ParallelDims
) -> None:
    """This rank's share of the checkpoint: its (tp, pp) coordinate's parameter shard and
    flat index (dp rank 0 only), and its range of the optimizer's moments (every ZeRO-1
    owner; dp rank 0 without ZeRO-1)."""
    weights = files.shard_weights(root, dims.tp_rank, dims.pp_rank)
    if dims.dp_rank == 0:
        weights.parent.mkdir(parents=True, exist_ok=True)
    if optimizer.master is not None:
        write_master_weights(weights, parameters, optimizer, dims)
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
    if optimizer.zero_1 or dims.dp_rank == 0:
        opt_dir = root / files.OPTIMIZER
        opt_dir.mkdir(parents=True, exist_ok=True)
        write_moments(
            optimizer, opt_dir / files.optimizer_file_name(dims.dp_rank, dims.tp_rank, dims.pp_rank)
        )


def write_master_weights(
    path: Path, parameters: dict[str, torch.Tensor], optimizer: ShardedAdamW, dims: ParallelDims
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


def _manifest(
    root: Path, step: int, trainer_state: dict[str, Any], entries: dict[str, dict]
) -> dict[str, Any]:
    """Every stage's tensors in Hugging Face order, and every file's size and sha256."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "layout": trainer_state["layout"],
        "world_size": dist.get_world_size(),
        "tensors": dict(sorted(entries.items(), key=lambda item: _hf_order(item[0]))),
        "files": describe_files(root),
    }


def write_moments(optimizer: ShardedAdamW, path: Path) -> None:
    """This rank's AdamW moments over its owned range, and the step count, streamed from
    the optimizer's state pieces (no copy of the optimizer is made to save it)."""
    numel = optimizer.owned_numel
    dtype = optimizer.state_dtype
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


def _hf_order(name: str) -> tuple:
    """Embedding, layers by number, final norm, LM head: the order people read them in."""
    parts = name.split(".")
    if "layers" in parts:
        return (1, int(parts[parts.index("layers") + 1]), name)
    return (0 if "embed" in name else 2 if "norm" in name else 3, 0, name)


def tensor_entry(
    parameter: torch.Tensor, spec: ParameterSharding, pp_rank: int, dtype: torch.dtype
) -> dict:
    """How consolidation rebuilds one tensor: its full shape, stored dtype, split and KV
    copies."""
    entry = {
        "shape": spec.hf_shape(parameter.shape),
        "dtype": str(dtype).removeprefix("torch."),
        "tp_dim": spec.tp_dim,
        "pp_rank": pp_rank,
    }
    if spec.kv_replication > 1:
        entry.update(kv_replication=spec.kv_replication, kv_head_dim=spec.head_dim)
    return entry


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all)."""
    if keep_last <= 0:
        return
    for _, old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
