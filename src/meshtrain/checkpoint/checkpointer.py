"""The one owner of a run's checkpoints: where they go, room, save, restore, pruning.

Built once by the trainer with what a checkpoint holds; from then on the loop
says `save(step)` and `restore(folder)`. What the optimizer holds is its own
business (`OptimizerState`): the Checkpointer hands it the folder and the
parameters to store, and never asks which optimizer it is. Everything else in a
checkpoint (the manifest, config, tokenizer, trainer state, RNG states, the
completion marker) is written here, in the format `manifest` defines.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import PretrainedConfig

from meshtrain.checkpoint import files
from meshtrain.checkpoint.load import CheckpointReader, check_compatible
from meshtrain.checkpoint.manifest import mark_complete, read_manifest, write_json_atomic
from meshtrain.checkpoint.safetensors_format import save_safetensors
from meshtrain.checkpoint.save import check_room, manifest_of, prune_checkpoints, tensor_entry
from meshtrain.checkpoint.space import folder_bytes, named_write_errors

if TYPE_CHECKING:
    from meshtrain.distributed.parallel_dims import ParallelDims
    from meshtrain.distributed.tensor_parallel import ParameterSharding


class OptimizerState(Protocol):
    """What a checkpoint needs of the optimizer: it writes and reads its own pieces."""

    state_dtype: torch.dtype  # what it stores weights and moments in

    def checkpoint_bytes(
        self, parameters: Mapping[str, torch.Tensor], sharding: Mapping, dims: ParallelDims
    ) -> int: ...

    def save_state(
        self,
        root: Path,
        parameters: Mapping[str, torch.Tensor],
        sharding: Mapping,
        dims: ParallelDims,
    ) -> None: ...

    def load_state(
        self,
        reader: CheckpointReader,
        sharding: Mapping,
        dims: ParallelDims,
        stored_as: Mapping[str, str],
    ) -> None: ...


class Checkpointer:
    def __init__(
        self,
        run_dir: Path,
        *,
        parameters: Mapping[str, torch.Tensor],
        sharding: Mapping[str, ParameterSharding],
        tied_copies: Mapping[str, str],
        optimizer: OptimizerState,
        dims: ParallelDims,
        model_config: PretrainedConfig,
        run_state: dict[str, Any],
        tokenizer_dir: Path | None = None,
        keep_last: int = 0,
    ) -> None:
        """`parameters`: this rank's, by Hugging Face name; `tied_copies`: those stored
        under another name (a tied LM head's copy on the last pipeline stage -> the
        embedding), stored once; `run_state`: what the trainer state records besides the
        step (layout, sample stream)."""
        self.run_dir = Path(run_dir)
        self.parameters, self.sharding, self.tied_copies = parameters, sharding, tied_copies
        self.stored = {n: p for n, p in parameters.items() if n not in tied_copies}
        self.optimizer, self.dims, self.model_config = optimizer, dims, model_config
        self.run_state, self.tokenizer_dir, self.keep_last = run_state, tokenizer_dir, keep_last

    def save(self, step: int) -> Path:
        """Write a complete checkpoint of step `step`; its folder. Collective."""
        root = self.run_dir / files.checkpoint_name(step)
        mine = self.optimizer.checkpoint_bytes(self.stored, self.sharding, self.dims)
        check_room(self.run_dir, root, mine, folder_bytes(self.tokenizer_dir))
        rank = dist.get_rank()
        if rank == 0 and root.exists():
            shutil.rmtree(root)  # a leftover from a run that died mid-save
        dist.barrier()
        trainer_state = {"step": step, **self.run_state}
        with named_write_errors(self.run_dir, root):
            self.optimizer.save_state(root, self.stored, self.sharding, self.dims)
            rng = files.rng_file(root, rank)
            rng.parent.mkdir(parents=True, exist_ok=True)
            save_safetensors({"cpu": torch.get_rng_state()}, rng)
            if rank == 0:
                self._write_rank0_files(root, trainer_state)
        entries = self._gather_manifest_entries()
        if rank == 0:
            mark_complete(root, manifest_of(root, step, trainer_state, entries))
            prune_checkpoints(self.run_dir, self.keep_last)
        dist.barrier()
        return root

    def _write_rank0_files(self, root: Path, trainer_state: dict[str, Any]) -> None:
        self.model_config.save_pretrained(root)
        write_json_atomic(root / files.TRAINER_STATE, trainer_state)
        if self.tokenizer_dir is not None:
            shutil.copytree(self.tokenizer_dir, root / files.TOKENIZER, dirs_exist_ok=True)

    def _gather_manifest_entries(self) -> dict[str, dict]:
        """Every stage's tensors go in the one manifest: each (tp 0, dp 0) rank describes
        its stage's, and every rank receives them all (JSON-able dicts). Collective."""
        dims, dtype = self.dims, self.optimizer.state_dtype
        mine = (
            {
                n: tensor_entry(p, self.sharding[n], dims.pp_rank, dtype)
                for n, p in self.stored.items()
            }
            if dims.dp_cp_rank == 0 and dims.tp_rank == 0
            else {}
        )
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, mine)
        return {name: entry for part in gathered for name, entry in part.items()}

    def restore(self, root: Path) -> dict[str, Any]:
        """Load checkpoint `root` (of this layout or any other) into this rank's parameters
        and optimizer; the saved trainer state (step, layout, sample stream). Each rank
        reads what it needs."""
        manifest = read_manifest(root, verify=True)
        check_compatible(manifest, self.parameters, self.sharding, self.tied_copies)
        with ExitStack() as stack:
            reader = CheckpointReader(root, manifest, stack)
            self.optimizer.load_state(reader, self.sharding, self.dims, self.tied_copies)
        state = json.loads((root / files.TRAINER_STATE).read_text())
        rng = files.rng_file(root, dist.get_rank())
        if manifest["world_size"] == dist.get_world_size() and rng.is_file():
            torch.set_rng_state(load_file(rng)["cpu"])
        return state
