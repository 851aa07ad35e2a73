"""The evaluation pipeline."""

from meshtrain.pipelines.evaluation.pipeline import create_pipeline

__all__ = ["create_pipeline"]
