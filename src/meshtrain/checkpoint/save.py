"""The pieces of a checkpoint beside the Checkpointer: the room check before it, the
optimizer files' format, the manifest entries and manifest, and the pruning after it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.checkpoint import remote
from meshtrain.checkpoint.manifest import FORMAT, FORMAT_VERSION, list_checkpoints
from meshtrain.checkpoint.safetensors_format import SafetensorsWriter, TensorSpec
from meshtrain.checkpoint.space import CheckpointSpaceError, room_problem
from meshtrain.distributed.tensor_parallel import ParameterSharding


def check_room(run_dir: Path, root: Path, mine: int, shared: int) -> None:
    """Collective: refuse on every rank, before any byte is written, a checkpoint that
    the filesystem has no room for (rank 0 sums what every rank will write, `mine`,
    and what rank 0 copies besides, `shared`)."""
    sizes: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(sizes, mine)
    verdict: list[str | None] = [None]
    if dist.get_rank() == 0:
        verdict[0] = room_problem(Path(run_dir), root, sum(sizes) + shared)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise CheckpointSpaceError(verdict[0])


def write_moments(
    path: Path,
    *,
    dtype: torch.dtype,
    elements: tuple[int, int],
    pieces: Callable[[str], torch.Tensor | Iterable[torch.Tensor]],
    step: float,
) -> None:
    """One optimizer file: AdamW's moments over `elements` [start, end) of a (tp, pp)
    coordinate's flat parameter order, each streamed from `pieces("exp_avg")` and
    `pieces("exp_avg_sq")` (no copy of the optimizer is made to save it), and the step
    count."""
    start, end = elements
    specs = [
        TensorSpec("exp_avg", dtype, (end - start,)),
        TensorSpec("exp_avg_sq", dtype, (end - start,)),
        TensorSpec("step", torch.float32, (1,)),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    with SafetensorsWriter(path, specs, metadata={"range": json.dumps([start, end])}) as writer:
        for key in ("exp_avg", "exp_avg_sq"):
            writer.write(key, pieces(key))
        writer.write("step", torch.tensor([step], dtype=torch.float32))


def manifest_of(
    step: int,
    trainer_state: dict[str, Any],
    entries: dict[str, dict],
    described: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Every stage's tensors in Hugging Face order, and every file's size and sha256
    (`described`, by path in the checkpoint)."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "layout": trainer_state["layout"],
        "world_size": dist.get_world_size(),
        "tensors": dict(sorted(entries.items(), key=lambda item: _hf_order(item[0]))),
        "files": dict(sorted(described.items())),
    }


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


def prune_checkpoints(run_dir: Path | str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all) of a run
    folder, local or a URL."""
    if keep_last <= 0:
        return
    if isinstance(run_dir, str):
        for _, old in remote.checkpoints(run_dir)[0][:-keep_last]:
            remote.remove(old)
        return
    for _, old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
