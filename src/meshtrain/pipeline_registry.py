"""Project pipelines, registered by name; `__default__` runs them all in order."""

from __future__ import annotations

from kedro.pipeline import Pipeline

from meshtrain.pipelines import consolidation, data_processing, evaluation, planning, training


def register_pipelines() -> dict[str, Pipeline]:
    pipelines = {
        "data_processing": data_processing.create_pipeline(),
        "planning": planning.create_pipeline(),
        "training": training.create_pipeline(),
        "consolidation": consolidation.create_pipeline(),
        "evaluation": evaluation.create_pipeline(),
    }
    pipelines["__default__"] = sum(pipelines.values(), Pipeline([]))
    return pipelines
