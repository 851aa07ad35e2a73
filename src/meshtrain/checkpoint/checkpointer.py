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
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import PretrainedConfig

from meshtrain.checkpoint import files, remote
from meshtrain.checkpoint.background import (
    STAGING_ROOT,
    BackgroundWriter,
    remove_stale_staging,
    staging_available,
    staging_folder,
)
from meshtrain.checkpoint.load import CheckpointReader, check_compatible
from meshtrain.checkpoint.manifest import (
    describe_files,
    mark_complete,
    read_manifest,
    write_json_atomic,
)
from meshtrain.checkpoint.safetensors_format import save_safetensors
from meshtrain.checkpoint.save import check_room, manifest_of, prune_checkpoints, tensor_entry
from meshtrain.checkpoint.space import folder_bytes, named_write_errors

if TYPE_CHECKING:
    from meshtrain.distributed.parallel_dims import ParallelDims
    from meshtrain.distributed.tensor_parallel import ParameterSharding


# Room left in host memory besides a snapshot's 10% margin: the small JSON files.
_STAGING_SLACK = 1 << 20


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
        in_background: bool = False,
        remote_dir: str | None = None,
    ) -> None:
        """`parameters`: this rank's, by Hugging Face name; `tied_copies`: those stored
        under another name (a tied LM head's copy on the last pipeline stage -> the
        embedding), stored once; `run_state`: what the trainer state records besides the
        step (layout, sample stream); `in_background`: saves snapshot to host memory and
        write while training goes on (`checkpoint.background`); `remote_dir`: the URL
        the checkpoints go to (`checkpoint.remote`; `run_dir` then holds only the
        staging a snapshot has no room for in host memory). Collective."""
        self.run_dir = Path(run_dir)
        self.parameters, self.sharding, self.tied_copies = parameters, sharding, tied_copies
        self.stored = {n: p for n, p in parameters.items() if n not in tied_copies}
        self.optimizer, self.dims, self.model_config = optimizer, dims, model_config
        self.run_state, self.tokenizer_dir, self.keep_last = run_state, tokenizer_dir, keep_last
        self.remote_dir, self.in_background = remote_dir, in_background
        self.writer = None
        if in_background or remote_dir is not None:
            remove_stale_staging()
            self.writer = BackgroundWriter()

    def save(self, step: int, *, wait: bool = False) -> Path | str:
        """Write a checkpoint of step `step`; its folder (a URL on object storage).
        Collective. With a background writer (and room in host memory on every rank),
        the files are snapshotted and written while training goes on, the folder
        complete once every rank's are durable; `wait`: complete before returning (a
        stop, the last step). To object storage the files are always staged first."""
        self.wait()  # one save in flight at a time
        name = files.checkpoint_name(step)
        root = self.run_dir / name
        destination = root if self.remote_dir is None else remote.join(self.remote_dir, name)
        mine = self.optimizer.checkpoint_bytes(self.stored, self.sharding, self.dims)
        shared = folder_bytes(self.tokenizer_dir)  # rank 0's copy besides
        rank = dist.get_rank()
        staged = None
        if self.writer is not None and (self.remote_dir is not None or not wait):
            staged = self._staging(step, mine + (shared if rank == 0 else 0))
        if staged is None and self.remote_dir is not None:
            staged = self.run_dir / "staging" / f"rank{rank}" / name  # no room in memory
        if self.remote_dir is None:
            check_room(self.run_dir, root, mine, shared)  # the disk the files end on
        elif not staged.is_relative_to(STAGING_ROOT):
            check_room(self.run_dir, staged, mine, shared)  # staged on the local disk
        if rank == 0:
            self._remove(destination)  # a leftover from a run that died mid-save
        dist.barrier()
        trainer_state = {"step": step, **self.run_state}
        target = root if staged is None else staged
        with named_write_errors(self.run_dir, root):
            self.optimizer.save_state(target, self.stored, self.sharding, self.dims)
            rng = files.rng_file(target, rank)
            rng.parent.mkdir(parents=True, exist_ok=True)
            save_safetensors({"cpu": torch.get_rng_state()}, rng)
            if rank == 0:
                self._write_rank0_files(target, trainer_state)
        entries = self._gather_manifest_entries()
        complete = None
        if rank == 0:
            complete = partial(self._complete, destination, step, trainer_state, entries)
        if staged is not None:
            self.writer.start(staged, destination, complete)
            if wait or not self.in_background:
                self.writer.wait()
            return destination
        if complete is not None:  # every rank's files are in place (the gather above)
            complete(describe_files(root))
        dist.barrier()
        return root

    @staticmethod
    def _remove(destination: Path | str) -> None:
        if isinstance(destination, str):
            remote.remove(destination)
        elif destination.exists():
            shutil.rmtree(destination)

    def _complete(
        self,
        destination: Path | str,
        step: int,
        trainer_state: dict[str, Any],
        entries: dict[str, dict],
        described: dict[str, dict],
    ) -> None:
        """Rank 0, once every rank's files are in place: the manifest and the marker,
        then the checkpoints past `keep_last` pruned."""
        manifest = manifest_of(step, trainer_state, entries, described)
        if isinstance(destination, str):
            remote.mark_complete(destination, manifest)
            prune_checkpoints(self.remote_dir, self.keep_last)
        else:
            mark_complete(destination, manifest)
            prune_checkpoints(self.run_dir, self.keep_last)

    def _staging(self, step: int, mine: int) -> Path | None:
        """Where this rank snapshots checkpoint `step` in host memory; None (a synchronous
        save) unless every rank has room for its share there. Collective."""
        room = torch.tensor([int(staging_available() >= mine * 1.1 + _STAGING_SLACK)])
        dist.all_reduce(room, op=dist.ReduceOp.MIN)
        if not room.item():
            return None
        staged = staging_folder(dist.get_rank()) / files.checkpoint_name(step)
        shutil.rmtree(staged, ignore_errors=True)
        return staged

    def check(self) -> None:
        """Raise the error of a background save that failed (no waiting)."""
        if self.writer is not None:
            self.writer.check()

    def wait(self) -> None:
        """Wait for the background save in flight, if any (its error raised)."""
        if self.writer is not None:
            self.writer.wait()

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
