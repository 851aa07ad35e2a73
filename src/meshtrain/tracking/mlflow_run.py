"""MLflow tracking: the run's layout as params, metrics from rank 0, artifacts.

The process that owns the MLflow run (the Kedro session) passes a
`TrackingTarget` to the workers; rank 0 writes its per-step metrics straight
into that run (`rank_metrics`), so one `kedro run` is one MLflow run.
Nothing here imports Kedro.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from meshtrain.offline import disable_telemetry
from meshtrain.tracking.rank_metrics import TrackingTarget
from meshtrain.tracking.sweep import SWEEP_TAG

disable_telemetry()  # before mlflow is imported

import mlflow  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

# MLflow's limit on a param value's length.
_MAX_PARAM_LENGTH = 6000

# MLflow 3's UI opens an experiment in its GenAI view (traces, evaluation runs) unless this
# experiment tag says it is for model training; then it opens on the runs.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
# Set by the Kedro hook on every run it opens: "true" when the run trains a model.
TRAINS_TAG = "meshtrain.trains"


def active_target() -> TrackingTarget | None:
    """The MLflow run this process is inside of, if any."""
    run = mlflow.active_run()
    if run is None:
        return None
    return TrackingTarget(tracking_uri=mlflow.get_tracking_uri(), run_id=run.info.run_id)


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"parallel": {"zero_1": True}}` -> `{"parallel.zero_1": "True"}`."""
    flat: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            text = json.dumps(value) if isinstance(value, list | dict) else str(value)
            flat[name] = text[:_MAX_PARAM_LENGTH]
    return flat


def log_plan(plan: dict[str, Any], run_config: dict[str, Any]) -> None:
    """Log the resolved layout and the run's parameters, name the run after the layout.

    The `parallel.*` params hold the planner's resolved values (never `auto`), and so
    do the per-device batch, accumulation steps and loss chunk (with `training.global_batch_size`
    the planner splits the batch per layout), so runs with different layouts compare
    column by column in the MLflow UI. Safe to call twice with the same plan (MLflow
    accepts identical re-logs).
    """
    if mlflow.active_run() is None:
        return
    params = flatten({k: v for k, v in run_config.items() if k != "parallel"})
    layout = dict(plan["layout"])
    # A training.* value the planner resolves with the layout (`auto`: the vocabulary's).
    chunk = layout.pop("loss_chunk_tokens", None)
    params.update(flatten({"parallel": layout}))
    if chunk is not None:
        params["training.loss_chunk_tokens"] = str(chunk)
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if plan.get(key):  # plans written before the planner split the batch lack them
            params[f"training.{key}"] = str(plan[key])
    params.update(
        {
            "world_size": str(plan["world_size"]),
            "global_batch_size": str(plan["global_batch_size"]),
            "tokens_per_step": str(plan["tokens_per_step"]),
            "num_parameters": str(plan["num_parameters"]),
            "num_trainable_parameters": str(
                plan.get("num_trainable_parameters") or plan["num_parameters"]
            ),
            "launch.backend_resolved": plan["backend"],
        }
    )
    params.update(flatten({"estimate.memory_per_rank_bytes": plan["memory_estimate_per_rank"]}))
    params.update(flatten({"estimate.time": plan.get("time_estimate") or {}}))
    if plan.get("device"):
        params["estimate.device"] = plan["device"]
    if plan.get("peak_tflops_per_rank"):  # the basis of the run's `mfu` metric
        params["mfu.model_flops_per_token"] = str(plan["model_flops_per_token"])
        params["mfu.peak_tflops_per_rank"] = str(plan["peak_tflops_per_rank"])
    client = MlflowClient()
    run_id = mlflow.active_run().info.run_id
    existing = client.get_run(run_id).data.params
    fresh = {k: v for k, v in params.items() if k not in existing}
    for start in range(0, len(fresh), 100):
        mlflow.log_params(dict(list(fresh.items())[start : start + 100]))
    # Only a run that trains is named after its layout: a planning-only run keeps the
    # name of the pipelines it ran, so the runs list does not show it as a training run.
    if client.get_run(run_id).data.tags.get(TRAINS_TAG, "true") == "true":
        mlflow.set_tag("mlflow.runName", plan["layout_name"])
    mlflow.set_tag("meshtrain.layout", plan["layout_name"])
    log_dry_run(plan.get("dry_run") or [])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        path.write_text(json.dumps(plan, indent=2, sort_keys=True))
        mlflow.log_artifact(str(path))


def log_dry_run(ranks: list[dict[str, Any]]) -> None:
    """`planner.dry_run`'s result as metrics, per rank and term: the dry run's bytes and the
    planner's over them (the whole comparison is in the plan.json artifact)."""
    metrics = {}
    for rank in ranks:
        for term, values in rank["terms"].items():
            key = f"dry_run/{term}_rank{rank['rank']}"
            metrics[f"{key}_bytes"] = values["dry_run"]
            metrics[f"{key}_planner_over_dry_run"] = values["planner_over_dry_run"]
    if metrics:
        mlflow.log_metrics(metrics)


def mark_model_training(experiment_id: str) -> None:
    """Tag the experiment as a model-training one, so MLflow's UI opens it on its runs."""
    client = MlflowClient()
    if client.get_experiment(experiment_id).tags.get(EXPERIMENT_KIND_TAG) != MODEL_TRAINING_KIND:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)


def describe_run(
    run_nodes: set[str], registered: dict[str, set[str]], *, trains: bool
) -> tuple[str, dict[str, str]]:
    """The name and tags of a run of `run_nodes` (one that `trains`, or not), given each
    registered pipeline's nodes.

    A run that trains starts named after its pipelines and is renamed after its layout by
    `log_plan`; any other run is named after the pipelines it ran (`planning`,
    `consolidation+evaluation`), and tagged with them either way."""
    ran = [name for name, nodes in registered.items() if nodes & run_nodes]
    name = "+".join(ran) if ran else "no pipeline"
    return name, {"meshtrain.pipelines": ",".join(ran), TRAINS_TAG: str(trains).lower()}


def git_commit(project_path: Path) -> str | None:
    """The commit the project is at (the run's `mlflow.source.git.commit`); None outside
    a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=project_path,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


REFUSED_TAG = "meshtrain.refused"


def discard_refused_run(refusal: BaseException) -> None:
    """End the active run, refused before training, as FAILED and soft-delete it: the UI's
    default (Active) view shows no run for a mistake; `State: Deleted` still finds it, with
    the refusal's kind in the `meshtrain.refused` tag. A layout of `kedro sweep` stays:
    the sweep reports its refused layouts beside the others."""
    run = mlflow.active_run()
    if run is None:
        return
    mlflow.set_tag(REFUSED_TAG, type(refusal).__name__)
    mlflow.set_tag("meshtrain.refusal", str(refusal)[:_MAX_PARAM_LENGTH])
    in_sweep = SWEEP_TAG in MlflowClient().get_run(run.info.run_id).data.tags
    mlflow.end_run("FAILED")
    if not in_sweep:
        MlflowClient().delete_run(run.info.run_id)


def log_metrics(metrics: dict[str, float], step: int | None = None) -> None:
    """Log metrics to the active run (no-op outside one)."""
    if mlflow.active_run() is not None:
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)


# The samples' table in the run (MLflow's UI shows it under Artifacts and in the
# Evaluation view, side by side: prompt and continuation of text, or prompt, reference
# and response of chat turns).
SAMPLES_TABLE = "samples.json"


def log_samples(samples: list[dict[str, str]]) -> None:
    """Log the samples as an MLflow table, a column per key of the first sample (no-op
    outside a run)."""
    if mlflow.active_run() is None or not samples:
        return
    table = {column: [s[column] for s in samples] for column in samples[0]}
    mlflow.log_table(data=table, artifact_file=SAMPLES_TABLE)


def set_tag(key: str, value: str) -> None:
    if mlflow.active_run() is not None:
        mlflow.set_tag(key, value[:_MAX_PARAM_LENGTH])


def log_artifact(path: str | Path, artifact_path: str | None = None) -> None:
    if mlflow.active_run() is not None:
        mlflow.log_artifact(str(path), artifact_path=artifact_path)


# Metric -> its label in the loss-curve picture.
LOSS_CURVE_METRICS = {"loss": "training loss", "val_loss": "validation loss"}


def log_loss_curve(target: TrackingTarget | None = None) -> str | None:
    """Draw training and validation loss against step from the run's own metric history
    and log it as `loss_curve.png`.

    Reads the history back from MLflow (rank 0 wrote it), so the picture is exactly what
    the run recorded, resumed runs included. Call it once training has returned.
    `target` defaults to the active run. Returns the artifact's path in the run, or None
    outside a run or when the run logged no loss.
    """
    target = target or active_target()
    if target is None:
        return None
    from meshtrain.tracking.plots import loss_curve

    client = MlflowClient(tracking_uri=target.tracking_uri)
    history = {}
    for metric, label in LOSS_CURVE_METRICS.items():
        # A resumed run logs again the steps between its last checkpoint and the failure:
        # the later value of a step wins.
        latest = {}
        for m in sorted(
            client.get_metric_history(target.run_id, metric), key=lambda m: m.timestamp
        ):
            latest[m.step] = m.value
        history[label] = sorted(latest.items())
    if not history["training loss"]:
        return None
    run = client.get_run(target.run_id)
    title = run.data.tags.get("meshtrain.layout") or run.info.run_name or target.run_id
    with tempfile.TemporaryDirectory() as tmp:
        path = loss_curve(history, Path(tmp) / "loss_curve.png", f"{title}: loss per step")
        client.log_artifact(target.run_id, str(path))
    return path.name


def log_memory_report(plan: dict[str, Any], summary: dict[str, Any]) -> str | None:
    """Draw the planner's memory prediction beside each rank's measured peak and log it
    as `memory_breakdown.png`, with their ratio as a metric. No-op outside a run or when
    the run measured nothing (a single step)."""
    measured = summary.get("measured_peak_memory") or {}
    if mlflow.active_run() is None or not measured.get("peak_bytes_per_rank"):
        return None
    from meshtrain.tracking.plots import memory_breakdown

    layout = plan["layout"]
    predicted = plan["memory_estimate_per_rank"]
    # (memory/predicted_peak_mb and memory/peak_tensor_mb come from rank 0 at that step.)
    mlflow.log_metric("memory/predicted_over_measured", predicted["total"] / measured["peak_bytes"])
    ranks_per_stage = (
        layout["data_parallel_size"]
        * layout["tensor_parallel_size"]
        * layout.get("context_parallel_size", 1)
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = memory_breakdown(
            predicted,
            measured["peak_bytes_per_rank"],
            ranks_per_stage,
            Path(tmp) / "memory_breakdown.png",
            f"{plan['layout_name']}: peak memory of tensors per rank, predicted and measured",
        )
        mlflow.log_artifact(str(path))
    return path.name
