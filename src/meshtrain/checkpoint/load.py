"""Read a checkpoint back, on the layout it was saved with or on any other.

Every tensor (a parameter, or one of AdamW's moments for it) is rebuilt at
its full Hugging Face shape from the saved pieces, one tensor at a time,
then cut the way the new layout needs: split over the new tp ranks (KV heads
copied again if the new tp needs it), placed at this rank's offset of its
flat buffer, and, for the moments, kept only where this rank's ZeRO-1 range
is. Same layout or not, the arithmetic is a copy, so a same-layout resume is
bitwise exact.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from meshtrain.checkpoint import files
from meshtrain.checkpoint.manifest import CheckpointError, read_manifest
from meshtrain.distributed.kv_heads import drop_kv_copies
from meshtrain.distributed.tensor_parallel import ParameterSharding


def assemble_full(meta: dict[str, Any], tp: int, piece) -> torch.Tensor:
    """The full tensor from its tp pieces (`piece(tp_rank)`), KV copies removed (the inverse
    of `ParameterSharding.local_piece`)."""
    if meta["tp_dim"] is None:
        full = piece(0)
    else:
        full = torch.cat([piece(r) for r in range(tp)], dim=meta["tp_dim"])
    return drop_kv_copies(full, meta.get("kv_replication", 1), meta.get("kv_head_dim", 0))


class CheckpointReader:
    """Reads full tensors and their optimizer moments out of a (verified) checkpoint."""

    def __init__(self, root: Path, manifest: dict[str, Any], stack: ExitStack) -> None:
        self.root, self.manifest, self._stack = root, manifest, stack
        self.tp = manifest["layout"]["tensor_parallel_size"]
        self._handles: dict[Path, Any] = {}
        self._flat: dict[tuple[int, int], dict[str, tuple[int, int, list[int]]]] = {}
        self._ranges: dict[tuple[int, int], list[tuple[int, int, Path]]] = {}

    def _open(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise CheckpointError(f"missing checkpoint file {path}")
            self._handles[path] = self._stack.enter_context(safe_open(str(path), "pt"))
        return self._handles[path]

    def parameter(self, name: str) -> torch.Tensor:
        meta = self.manifest["tensors"][name]

        def piece(tp_rank: int) -> torch.Tensor:
            path = files.shard_weights(self.root, tp_rank, meta["pp_rank"])
            return self._open(path).get_tensor(name)

        return assemble_full(meta, self.tp, piece)

    def moment(self, name: str, key: str) -> torch.Tensor:
        meta = self.manifest["tensors"][name]
        pp_rank = meta["pp_rank"]

        def piece(tp_rank: int) -> torch.Tensor:
            offset, numel, shape = self._flat_index(tp_rank, pp_rank)[name]
            return self._flat_range(tp_rank, pp_rank, key, offset, offset + numel).view(shape)

        return assemble_full(meta, self.tp, piece)

    def step(self) -> float:
        path = next(p for p in sorted((self.root / files.OPTIMIZER).glob("*.safetensors")))
        return float(self._open(path).get_tensor("step")[0])

    def _flat_index(self, tp_rank: int, pp_rank: int):
        key = (tp_rank, pp_rank)
        if key not in self._flat:
            path = files.flat_index(self.root, tp_rank, pp_rank)
            slots = json.loads(path.read_text())["slots"]
            self._flat[key] = {name: (offset, numel, shape) for name, offset, numel, shape in slots}
        return self._flat[key]

    def _flat_range(self, tp_rank: int, pp_rank: int, key: str, lo: int, hi: int):
        """Elements [lo, hi) of one coordinate's flat moment buffer, from the dp owners' files."""
        coordinate = (tp_rank, pp_rank)
        if coordinate not in self._ranges:
            owners = []
            for path in files.optimizer_files(self.root, tp_rank, pp_rank):
                start, end = json.loads(self._open(path).metadata()["range"])
                owners.append((start, end, path))
            self._ranges[coordinate] = owners
        parts = []
        for start, end, path in self._ranges[coordinate]:
            a, b = max(lo, start), min(hi, end)
            if a < b:
                parts.append(self._open(path).get_slice(key)[a - start : b - start])
        values = torch.cat(parts) if parts else torch.empty(0)
        if values.numel() != hi - lo:
            raise CheckpointError(
                f"optimizer state of tp rank {tp_rank}, pp rank {pp_rank} in {self.root} does "
                f"not cover elements {lo}..{hi}: a data-parallel rank's file is missing"
            )
        return values


def check_same_model(root: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """Before any worker starts: refuse a checkpoint of another model, naming the first
    tensor that is missing, extra or of another shape (`shapes`: the model's Hugging Face
    names and full shapes, each stored tensor once)."""
    saved = read_manifest(root, verify=False)["tensors"]
    for name, shape in shapes.items():
        if name not in saved:
            raise CheckpointError(
                f"training.resume_from: {root} has no tensor {name}: it is a checkpoint of "
                "another model (its architecture or model.config differs from this run's)"
            )
        if tuple(saved[name]["shape"]) != tuple(shape):
            raise CheckpointError(
                f"training.resume_from: tensor {name} is {list(saved[name]['shape'])} in {root} "
                f"but {list(shape)} in this run's model: the checkpoint is of another model "
                "shape (resume with the model.config it was trained with)"
            )
    extra = sorted(set(saved) - set(shapes))
    if extra:
        raise CheckpointError(
            f"training.resume_from: {root} holds {extra[0]}, which this run's model has not: "
            "it is a checkpoint of another model"
        )


def check_compatible(
    manifest: dict[str, Any],
    parameters: Mapping[str, torch.Tensor],
    sharding: Mapping[str, ParameterSharding],
    tied_copies: Mapping[str, str] | None = None,
) -> None:
    """Refuse a checkpoint of another model, naming the first tensor that differs."""
    saved = manifest["tensors"]
    for copy, parameter in parameters.items():
        name = (tied_copies or {}).get(copy, copy)
        if name not in saved:
            raise CheckpointError(f"the checkpoint has no tensor {name}: it is of another model")
        shape = sharding[copy].hf_shape(parameter.shape)
        if saved[name]["shape"] != shape:
            raise CheckpointError(
                f"tensor {name} is {saved[name]['shape']} in the checkpoint but {shape} in the "
                "model being trained: the checkpoint is of another model shape"
            )


def check_resumable(
    checkpoint: Path, *, seed: int, global_batch_size: int, num_train_blocks: int, max_steps: int
) -> int:
    """Before any worker starts: the run must continue the checkpoint's sample stream.

    Returns the checkpoint's step.
    """
    state = json.loads((Path(checkpoint) / files.TRAINER_STATE).read_text())
    for key, now in (
        ("seed", seed),
        ("global_batch_size", global_batch_size),
        ("num_train_blocks", num_train_blocks),
    ):
        if key in state and state[key] != now:
            raise CheckpointError(
                f"training.resume_from: {checkpoint} was trained with {key}={state[key]} and "
                f"this run has {now}; resuming would change the order of samples. Use the "
                "checkpoint's seed, global batch (per-device batch x accumulation x dp) and data."
            )
    if state["step"] >= max_steps:
        raise CheckpointError(
            f"training.resume_from: {checkpoint} is at step {state['step']} and "
            f"training.max_steps is {max_steps}; raise max_steps to train further."
        )
    return state["step"]
