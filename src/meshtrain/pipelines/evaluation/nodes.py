"""Node: score the consolidated model with plain transformers and report it (the engine
imported when the node runs: Kedro imports every pipeline before the run's checks)."""

from __future__ import annotations

import math
from typing import Any

from meshtrain.config import EvaluationConfig, read_group
from meshtrain.pipelines.catalog_io import Splits
from meshtrain.training_summary import TrainingSummary


def evaluate(
    consolidation_summary: dict[str, Any],
    packed_blocks: Splits,
    training_summary: dict[str, Any],
    evaluation: dict[str, Any],
) -> dict[str, Any]:
    """Args: where the model is, the blocks, the training summary (also where and in what
    precision it trained), `params:evaluation`.

    Returns: `metrics.json`: validation loss and perplexity before and after training,
    the throughput of the run, the samples (prompt and continuation of text; prompt,
    reference and response of fine-tuning examples) and the lm-evaluation-harness
    scores.
    """
    # (imported when the node runs: a run refused by its checks, which come first, never
    # loads torch, transformers or mlflow)
    from meshtrain.benchmarks import run_lm_eval  # noqa: PLC0415
    from meshtrain.data.blocks import is_packed  # noqa: PLC0415
    from meshtrain.evaluation import evaluate_model  # noqa: PLC0415
    from meshtrain.tracking import mlflow_run as tracking  # noqa: PLC0415

    cfg: EvaluationConfig = read_group("evaluation", evaluation)
    trained = TrainingSummary.from_dict(training_summary)
    validation = packed_blocks["validation"]
    metrics, model, tokenizer = evaluate_model(
        consolidation_summary["output_dir"],
        validation,
        cfg,
        backend=trained.backend,
        mixed_precision=trained.mixed_precision,
    )
    if "dpo" in training_summary:
        metrics |= _preference(model, validation, cfg, training_summary["dpo"], trained)
    scores = run_lm_eval(
        model,
        tokenizer,
        cfg.lm_eval_tasks,
        limit=cfg.lm_eval_limit,
        batch_size=cfg.lm_eval_batch_size,
        include_path=cfg.lm_eval_include_path,
        # Fine-tuned on conversations or prompt/completion pairs (blocks with a loss
        # mask): asked in its chat template, where the tokenizer has one.
        chat_template=is_packed(validation),
    )
    initial = trained.initial_val_loss
    metrics.update(
        {
            "layout": trained.layout_name,
            "steps": trained.steps,
            "initial_val_loss": initial,
            "initial_val_perplexity": math.exp(initial) if initial is not None else None,
            "train_tokens_per_s": trained.mean_tokens_per_s,
            "train_mfu": trained.mean_mfu,
            "train_time_s": trained.train_time_s,
            "model_dir": consolidation_summary["output_dir"],
            "lm_eval": scores,
        }
    )
    numbers = {
        key: value
        for key, value in metrics.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    tracking.log_metrics({f"eval/{key}": value for key, value in {**numbers, **scores}.items()})
    tracking.log_samples(metrics["samples"])
    tracking.set_tag("eval.sample", metrics["sample"])
    return metrics


def _preference(
    model: Any,
    validation: Any,
    cfg: EvaluationConfig,
    dpo: dict[str, Any],
    trained: TrainingSummary,
) -> dict[str, Any]:
    """A DPO run's preference accuracy and margin against its starting model."""
    from meshtrain.config_dpo import DpoSettings  # noqa: PLC0415
    from meshtrain.evaluation import load_model, resolve_device, resolve_dtype  # noqa: PLC0415
    from meshtrain.evaluation_preference import (  # noqa: PLC0415
        preference_metrics,
        validation_batches,
    )
    from meshtrain.models.builder import resolve_init_from  # noqa: PLC0415

    device = resolve_device(cfg.device, trained.backend)
    dtype = resolve_dtype(cfg.dtype, trained.mixed_precision, device)
    reference = load_model(resolve_init_from(dpo["reference_model"]), device, dtype)
    settings = DpoSettings(**{k: dpo[k] for k in ("beta", "loss_type", "label_smoothing")})
    batches = validation_batches(validation, cfg.batch_size, cfg.max_batches)
    return preference_metrics(model, reference, batches, settings)
