"""DPO's precomputed reference log-probabilities on disk, beside the run's checkpoints.

`components/reference_pass.py` scores every block once; the table then lives in one
safetensors file in the run's folder, written by a rank that holds all of it and
memory-mapped by every rank: a node keeps one copy in its page cache rather than one per
rank, and a resumed run reads it instead of scoring every block again. The file records
what it was made from (the starting weights' sha256, as a LoRA checkpoint names its base,
and the blocks' files), so a table made from other weights or other blocks is made again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from meshtrain.checkpoint.lora_base import base_identity
from meshtrain.checkpoint.manifest import CheckpointError
from meshtrain.checkpoint.safetensors_format import (
    StoredTensor,
    read_safetensors_header,
    save_safetensors,
)
from meshtrain.data.blocks import BlockStore

REFERENCE_FILE = "reference_logps.safetensors"
_IDENTITY_KEY = "meshtrain.reference_table"


class StoredRows:
    """Rows of a (blocks, block size) float32 table in a safetensors file, memory-mapped:
    only the rows asked for are read (`TokenBatch.with_reference`)."""

    def __init__(self, path: Path, entry: StoredTensor) -> None:
        self._rows = np.memmap(path, np.float32, "r", offset=entry.start, shape=entry.shape)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, indices: list[int]) -> torch.Tensor:
        # Indexing by a list copies the rows out of the mapping.
        return torch.from_numpy(self._rows[np.asarray(indices, dtype=np.int64)])


def table_identity(
    init_from: str, model_config: dict[str, Any], blocks: Mapping[str, BlockStore | None]
) -> dict[str, Any]:
    """What a table depends on: the starting weights, and each split's block files (their
    names, sizes and modification times: a re-prepared split is written anew)."""
    return {
        "reference": base_identity(init_from, model_config, seed=0),
        "blocks": {
            split: None if store is None else [_file_stamp(path) for path in store.files]
            for split, store in blocks.items()
        },
    }


def _file_stamp(path: str) -> list[Any]:
    stat = os.stat(path)
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


def load_tables(path: Path, identity: dict[str, Any]) -> dict[str, StoredRows] | None:
    """The tables `path` holds, by split, if it was made for `identity`; else None."""
    if not path.is_file():
        return None
    try:
        entries = read_safetensors_header(path)
        with safe_open(str(path), "pt") as handle:
            recorded = (handle.metadata() or {}).get(_IDENTITY_KEY)
    except (CheckpointError, OSError, ValueError, SafetensorError):
        return None
    if recorded is None or json.loads(recorded) != identity:
        return None
    if any(entry.code != "F32" or len(entry.shape) != 2 for entry in entries.values()):
        return None
    return {split: StoredRows(path, entry) for split, entry in entries.items()}


def stored_tables(
    path: Path,
    identity: dict[str, Any],
    score: Callable[[], dict[str, torch.Tensor]],
    *,
    writes: bool,
) -> tuple[dict[str, StoredRows], bool]:
    """The tables `path` holds for `identity`, or else those `score` makes (collective),
    written by the one rank that `writes` and read back by every rank; and whether they
    were scored now. Collective."""
    tables = load_tables(path, identity)
    if tables is not None:
        return tables, False
    scored = score()
    if writes:
        save_tables(path, scored, identity)
    dist.barrier()
    tables = load_tables(path, identity)
    if tables is None:
        raise CheckpointError(
            f"the reference table written to {path} cannot be read on this node: the run's "
            "folder (training.output_dir) must be on a filesystem every node shares"
        )
    return tables, True


def save_tables(path: Path, tables: Mapping[str, torch.Tensor], identity: dict[str, Any]) -> None:
    """Write the tables atomically (a reader sees the whole file or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    metadata = {_IDENTITY_KEY: json.dumps(identity, sort_keys=True)}
    save_safetensors(dict(tables), partial, metadata=metadata)
    os.replace(partial, path)
