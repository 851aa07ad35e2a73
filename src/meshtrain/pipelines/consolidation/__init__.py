"""The consolidation pipeline."""

from meshtrain.pipelines.consolidation.pipeline import create_pipeline

__all__ = ["create_pipeline"]
