"""Resume from a checkpoint, on the layout it was saved with or on any other.

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
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from meshtrain.checkpoint import files
from meshtrain.checkpoint.manifest import CheckpointError, read_manifest
from meshtrain.checkpoint.sharded_state import restore_sharded
from meshtrain.distributed.fsdp_optimizer import FSDPAdamW
from meshtrain.distributed.kv_heads import drop_kv_copies
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.tensor_parallel import ParameterSharding
from meshtrain.distributed.zero import ShardedAdamW


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
    parameters: dict[str, torch.Tensor],
    sharding: dict[str, ParameterSharding],
    tied_copies: dict[str, str] | None = None,
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


def restore_checkpoint(
    root: Path,
    *,
    parameters: dict[str, torch.Tensor],
    sharding: dict[str, ParameterSharding],
    optimizer: ShardedAdamW | FSDPAdamW,
    dims: ParallelDims,
    tied_copies: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Load parameters and optimizer state into this rank's (possibly new) layout.

    `tied_copies`: parameters stored under another name (a tied LM head's copy on the
    last pipeline stage -> the embedding). Returns the saved trainer state (step,
    layout, sample stream). Collective-free: each rank reads what it needs.
    """
    manifest = read_manifest(root, verify=True)
    stored_as = tied_copies or {}
    check_compatible(manifest, parameters, sharding, stored_as)
    with ExitStack() as stack:
        reader = CheckpointReader(root, manifest, stack)
        if isinstance(optimizer, FSDPAdamW):
            restore_sharded(reader, parameters, sharding, optimizer, dims, stored_as)
        else:
            restore_flat(reader, sharding, optimizer, dims, stored_as)
    state = json.loads((root / files.TRAINER_STATE).read_text())
    rng = files.rng_file(root, torch.distributed.get_rank())
    if manifest["world_size"] == torch.distributed.get_world_size() and rng.is_file():
        torch.set_rng_state(load_file(rng)["cpu"])
    return state


def restore_flat(
    reader: CheckpointReader,
    sharding: dict[str, ParameterSharding],
    optimizer: ShardedAdamW,
    dims: ParallelDims,
    stored_as: dict[str, str],
) -> None:
    """Fill the flat buffer, and the moments (and masters) of the owned range."""
    flat = optimizer.flat
    start, end = optimizer.start, optimizer.end
    exp_avg = torch.zeros(end - start, dtype=optimizer.state_dtype)
    exp_avg_sq = torch.zeros_like(exp_avg)
    for slot in flat.slots:
        spec, name = sharding[slot.name], stored_as.get(slot.name, slot.name)
        full = reader.parameter(name)
        local = spec.local_piece(full, dims.tp_rank, dims.tp).reshape(-1)
        flat.params[slot.offset : slot.offset + slot.numel].copy_(local)
        lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
        if lo >= hi:
            continue
        if optimizer.master is not None:
            # At the precision stored: fp32 masters (or an fp32 run's weights) stay exact.
            kept = local[lo - slot.offset : hi - slot.offset]
            optimizer.master[lo - start : hi - start] = kept
        for key, target in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            moment = spec.local_piece(reader.moment(name, key), dims.tp_rank, dims.tp)
            flat_moment = moment.reshape(-1)
            target[lo - start : hi - start] = flat_moment[lo - slot.offset : hi - slot.offset]
    step = reader.step()
    optimizer.load_moments(exp_avg, exp_avg_sq, step)


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
