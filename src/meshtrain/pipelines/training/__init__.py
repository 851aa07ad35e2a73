"""The training pipeline."""

from meshtrain.pipelines.training.pipeline import create_pipeline

__all__ = ["create_pipeline"]
