"""Node: sharded checkpoint -> plain Hugging Face model folder."""

from __future__ import annotations

from typing import Any

from meshtrain.checkpoint import consolidate_checkpoint


def consolidate(training_summary: dict[str, Any], consolidation: dict[str, Any]) -> dict[str, Any]:
    """Args: the training summary and `params:consolidation`. Returns: what was written where."""
    checkpoint = consolidation.get("checkpoint") or training_summary["final_checkpoint"]
    return consolidate_checkpoint(
        checkpoint,
        consolidation["output_dir"],
        max_shard_size=consolidation.get("max_shard_size", "5GB"),
    )
