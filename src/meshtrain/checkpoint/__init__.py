"""Sharded checkpoints: the on-disk contract, saving, and consolidation to Hugging Face."""

from meshtrain.checkpoint.consolidate import consolidate_checkpoint
from meshtrain.checkpoint.manifest import CheckpointError, list_checkpoints, resolve_checkpoint

__all__ = ["CheckpointError", "consolidate_checkpoint", "list_checkpoints", "resolve_checkpoint"]
