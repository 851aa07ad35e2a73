"""Node: score the consolidated model with plain transformers and report it."""

from __future__ import annotations

import math
from typing import Any

import datasets

from meshtrain.config import EvaluationConfig, parse
from meshtrain.evaluation import evaluate_model
from meshtrain.tracking import mlflow_run as tracking


def evaluate(
    consolidation_summary: dict[str, Any],
    packed_blocks: datasets.DatasetDict,
    training_summary: dict[str, Any],
    evaluation: dict[str, Any],
) -> dict[str, Any]:
    """Args: where the model is, the blocks, the training summary, `params:evaluation`.

    Returns: `metrics.json`: validation loss and perplexity before and after
    training, the throughput of the run, and a greedy sample.
    """
    cfg = parse(EvaluationConfig, evaluation, "evaluation")
    metrics = evaluate_model(
        consolidation_summary["output_dir"],
        packed_blocks["validation"],
        batch_size=cfg.batch_size,
        max_batches=cfg.max_batches,
        prompt=cfg.prompt,
        max_new_tokens=cfg.max_new_tokens,
    )
    initial = training_summary.get("initial_val_loss")
    metrics.update(
        {
            "layout": training_summary.get("layout_name"),
            "steps": training_summary.get("steps"),
            "initial_val_loss": initial,
            "initial_val_perplexity": math.exp(initial) if initial is not None else None,
            "train_tokens_per_s": training_summary.get("mean_tokens_per_s"),
            "train_time_s": training_summary.get("train_time_s"),
            "model_dir": consolidation_summary["output_dir"],
        }
    )
    tracking.log_metrics(
        {
            f"eval/{key}": value
            for key, value in metrics.items()
            if isinstance(value, int | float) and value is not None
        }
    )
    tracking.set_tag("eval.sample", metrics["sample"])
    return metrics
