"""The planning pipeline."""

from meshtrain.pipelines.planning.pipeline import create_pipeline

__all__ = ["create_pipeline"]
