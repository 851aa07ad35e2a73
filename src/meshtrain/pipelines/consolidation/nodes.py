"""Node: sharded checkpoint -> plain Hugging Face model folder (or, for a LoRA run, PEFT's
adapter folder, and the merged model when asked)."""

from __future__ import annotations

from functools import partial
from typing import Any

from meshtrain.checkpoint import CheckpointError, consolidate_checkpoint
from meshtrain.checkpoint.consolidate.lora import consolidate_lora, is_lora_checkpoint
from meshtrain.checkpoint.consolidate.remote_io import consolidate_anywhere
from meshtrain.config import ConsolidationConfig, read_group
from meshtrain.training_summary import TrainingSummary


def consolidate(training_summary: dict[str, Any], consolidation: dict[str, Any]) -> dict[str, Any]:
    """Args: the training summary and `params:consolidation`. Returns: what was written where."""
    cfg: ConsolidationConfig = read_group("consolidation", consolidation)
    checkpoint = cfg.checkpoint or _final_checkpoint(TrainingSummary.from_dict(training_summary))
    return consolidate_anywhere(checkpoint, cfg.output_dir, partial(_write, cfg))


def _write(cfg: ConsolidationConfig, checkpoint: str, output_dir: str) -> dict[str, Any]:
    """The model (or the adapters) of a local checkpoint, into a local folder."""
    if is_lora_checkpoint(checkpoint):
        return consolidate_lora(
            checkpoint,
            output_dir,
            merged_dir=cfg.merged_output_dir if cfg.merge_lora else None,
            dtype=cfg.dtype,
            max_shard_size=cfg.max_shard_size,
        )
    if cfg.merge_lora:
        raise CheckpointError(
            f"`consolidation.merge_lora` is true but {checkpoint} holds a full model, not LoRA "
            "adapters: set it to false (the full model is written as it is)."
        )
    return consolidate_checkpoint(
        checkpoint, output_dir, max_shard_size=cfg.max_shard_size, dtype=cfg.dtype
    )


def _final_checkpoint(summary: TrainingSummary) -> str:
    if summary.final_checkpoint is None:
        raise CheckpointError(
            "the training summary names no final checkpoint: set consolidation.checkpoint "
            "to a checkpoint-<step> folder or a run folder."
        )
    return summary.final_checkpoint
