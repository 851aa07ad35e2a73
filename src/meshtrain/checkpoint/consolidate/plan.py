"""What to write before writing it: every tensor's pieces, its output shape and file.

The plan is built from the manifest and the shard headers alone (no tensor data is
read), so every shape, dtype and missing piece is reported before any output exists.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from meshtrain.checkpoint import files
from meshtrain.checkpoint.consolidate.convert import FLOATING
from meshtrain.checkpoint.expert_layout import router_stored_name, stored_expert_names
from meshtrain.checkpoint.manifest import CheckpointError
from meshtrain.checkpoint.safetensors_format import (
    SAFETENSORS_DTYPES,
    StoredTensor,
    TensorSpec,
    dtype_name,
    read_safetensors_header,
)
from meshtrain.distributed import kv_heads

T = TypeVar("T")


@dataclass(frozen=True)
class Piece:
    """One rank's piece of a tensor: its shard file and where its bytes start there."""

    path: Path
    start: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorPlan:
    """How to rebuild one full tensor from its shard pieces."""

    spec: TensorSpec
    pieces: tuple[Piece, ...]  # concatenated in this order along tp_dim
    tp_dim: int | None
    kv_copies: int
    kv_head_dim: int | None
    # What is written (another dtype than the shards' when consolidating with --dtype).
    output: TensorSpec | None = None

    @property
    def written(self) -> TensorSpec:
        return self.output or self.spec


class _ShardHeaders:
    """The header of each shard file, read once, on first use."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._headers: dict[tuple[int, int], tuple[Path, dict[str, StoredTensor]]] = {}

    def get(self, tp_rank: int, pp_rank: int) -> tuple[Path, dict[str, StoredTensor]]:
        key = (tp_rank, pp_rank)
        if key not in self._headers:
            path = files.shard_weights(self._root, tp_rank, pp_rank)
            if not path.is_file():
                raise CheckpointError(f"missing shard file {path}")
            self._headers[key] = (path, read_safetensors_header(path))
        return self._headers[key]


def plan_tensors(
    root: Path, manifest: Mapping[str, Any], dtype: str | None = None
) -> list[TensorPlan]:
    """Check every tensor against the shard headers (no data is read), in manifest order;
    `dtype`: write floating-point tensors in that dtype (default: as stored)."""
    tp = manifest["layout"]["tensor_parallel_size"]
    headers = _ShardHeaders(root)
    plans = [_plan_tensor(name, meta, tp, headers) for name, meta in manifest["tensors"].items()]
    plans = _as_stored(plans, root / files.MODEL_CONFIG)
    if dtype is None:
        return plans
    return [
        dataclasses.replace(p, output=TensorSpec(p.spec.name, dtype, p.spec.shape))
        if p.spec.dtype_name in FLOATING
        else p
        for p in plans
    ]


def _plan_tensor(name: str, meta: Mapping[str, Any], tp: int, headers: _ShardHeaders) -> TensorPlan:
    dtype = _dtype_of(name, meta)
    tp_dim = meta["tp_dim"]
    ranks = (0,) if tp_dim is None else tuple(range(tp))
    pieces = []
    for tp_rank in ranks:
        path, stored = headers.get(tp_rank, meta["pp_rank"])
        if name not in stored:
            raise CheckpointError(f"tensor {name} is missing from shard file {path}")
        piece = stored[name]
        if piece.code != SAFETENSORS_DTYPES[dtype]:
            raise CheckpointError(
                f"tensor {name} is stored as {piece.code}, the manifest says {meta['dtype']}"
            )
        pieces.append(Piece(path, piece.start, piece.shape))
    shape = _rebuilt_shape(name, [list(p.shape) for p in pieces], tp_dim)
    copies = meta.get("kv_replication", 1)
    head_dim = meta.get("kv_head_dim")
    if copies > 1:
        if not shape or not head_dim:
            raise CheckpointError(f"cannot undo KV replication of a {shape} tensor")
        try:
            kept = kv_heads.first_copy_rows(shape[0], copies, head_dim)
        except ValueError:
            raise CheckpointError(f"cannot undo KV replication of a {shape} tensor") from None
        shape[0] = sum(end - start for start, end in kept)
    if shape != list(meta["shape"]):
        raise CheckpointError(
            f"tensor {name} rebuilt with shape {shape}, the manifest says {meta['shape']}"
        )
    spec = TensorSpec(name, dtype, tuple(shape))
    return TensorPlan(spec, tuple(pieces), tp_dim, copies, head_dim if copies > 1 else None)


def _as_stored(plans: list[TensorPlan], config_file: Path) -> list[TensorPlan]:
    """The tensors as a Hugging Face folder stores them: a mixture of experts' 3-D expert
    parameters as one tensor per expert and part (each a run of whole rows of the 3-D
    tensor, which no tensor parallelism splits), its router under its stored name."""
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    model_type = config.get("model_type", "")
    experts = config.get("num_local_experts") or config.get("num_experts") or 0
    stored: list[TensorPlan] = []
    for plan in plans:
        per_expert = stored_expert_names(model_type, experts, plan.spec.name)
        if per_expert is None:
            name = router_stored_name(model_type, plan.spec.name)
            if name != plan.spec.name:
                plan = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, name=name))
            stored.append(plan)
            continue
        if plan.tp_dim is not None or len(plan.pieces) != 1:
            raise CheckpointError(f"tensor {plan.spec.name}: experts split over ranks")
        stored += _expert_parts(plan, per_expert)
    return stored


def _expert_parts(plan: TensorPlan, per_expert: list[list[str]]) -> list[TensorPlan]:
    _, rows_per_expert, columns = plan.spec.shape
    piece, parts = plan.pieces[0], len(per_expert[0])
    rows = rows_per_expert // parts
    row_bytes = columns * plan.spec.itemsize
    out = []
    for e, names in enumerate(per_expert):
        for j, name in enumerate(names):
            first_row = e * rows_per_expert + j * rows
            part = Piece(piece.path, piece.start + first_row * row_bytes, (rows, columns))
            spec = TensorSpec(name, plan.spec.dtype_name, (rows, columns))
            out.append(TensorPlan(spec, (part,), None, 1, None))
    return out


def _dtype_of(name: str, meta: Mapping[str, Any]) -> str:
    try:
        return dtype_name(meta.get("dtype"))
    except ValueError:
        raise CheckpointError(
            f"tensor {name} has dtype {meta.get('dtype')!r}, not one to save"
        ) from None


def _rebuilt_shape(name: str, shapes: list[list[int]], tp_dim: int | None) -> list[int]:
    if tp_dim is None:
        return list(shapes[0])
    first = shapes[0]
    if not 0 <= tp_dim < len(first) or any(
        len(s) != len(first) or s[:tp_dim] + s[tp_dim + 1 :] != first[:tp_dim] + first[tp_dim + 1 :]
        for s in shapes
    ):
        raise CheckpointError(
            f"tensor {name}: pieces of shapes {shapes} do not concatenate along dim {tp_dim}"
        )
    return first[:tp_dim] + [sum(s[tp_dim] for s in shapes)] + first[tp_dim + 1 :]


def kept_rows(plan: TensorPlan, rows: int) -> list[tuple[int, int]]:
    """Dim-0 row ranges of the concatenated pieces that the full tensor keeps."""
    return kv_heads.first_copy_rows(rows, plan.kv_copies, plan.kv_head_dim or 0)


def byte_ranges(plan: TensorPlan) -> list[tuple[Piece, int, int]]:
    """The tensor's bytes as (piece, offset in the piece, length), in output order, for a
    tensor whose pieces' rows follow one another (replicated, or split along dim 0)."""
    pieces = plan.pieces
    if not pieces[0].shape:  # 0-d
        return [(pieces[0], 0, plan.spec.nbytes)]
    row_bytes = math.prod(pieces[0].shape[1:]) * plan.spec.itemsize
    starts = [0]
    for piece in pieces:
        starts.append(starts[-1] + piece.shape[0])
    ranges: list[tuple[Piece, int, int]] = []
    for begin, end in kept_rows(plan, starts[-1]):
        for piece, start in zip(pieces, starts, strict=False):
            low, high = max(begin, start), min(end, start + piece.shape[0])
            if low >= high:
                continue
            offset, length = (low - start) * row_bytes, (high - low) * row_bytes
            if not length:
                continue
            if ranges and ranges[-1][0] is piece and ranges[-1][1] + ranges[-1][2] == offset:
                ranges[-1] = (piece, ranges[-1][1], ranges[-1][2] + length)  # adjacent: merge
            else:
                ranges.append((piece, offset, length))
    return ranges


def split_into_files(
    items: Sequence[T], limit: int, size: Callable[[T], int] = lambda plan: plan.written.nbytes
) -> list[list[T]]:
    """Greedy in the given order: a new file when the next tensor would pass `limit`
    (`size`: a tensor's bytes as written)."""
    groups: list[list[T]] = [[]]
    total = 0
    for item in items:
        if groups[-1] and total + size(item) > limit:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += size(item)
    return groups


def file_names(count: int) -> list[str]:
    """Hugging Face's weight file names for `count` files."""
    if count == 1:
        return [files.HF_WEIGHTS]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
