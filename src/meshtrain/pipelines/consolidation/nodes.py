"""Node: sharded checkpoint -> plain Hugging Face model folder."""

from __future__ import annotations

from typing import Any

from meshtrain.checkpoint import consolidate_checkpoint
from meshtrain.config import ConsolidationConfig, parse


def consolidate(training_summary: dict[str, Any], consolidation: dict[str, Any]) -> dict[str, Any]:
    """Args: the training summary and `params:consolidation`. Returns: what was written where."""
    cfg = parse(ConsolidationConfig, consolidation, "consolidation")
    return consolidate_checkpoint(
        cfg.checkpoint or training_summary["final_checkpoint"],
        cfg.output_dir,
        max_shard_size=cfg.max_shard_size,
        dtype=cfg.dtype,
    )
