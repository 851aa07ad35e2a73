"""A sweep's comparison table: one row per layout, from the MLflow runs that
`kedro sweep` tagged (`tracking.sweep`'s tags), measured memory beside predicted."""

from __future__ import annotations

import math
from typing import Any

import mlflow
import pandas as pd
from mlflow.tracking import MlflowClient

from meshtrain.tracking.sweep import SWEEP_LAYOUT_TAG, SWEEP_STATUS_TAG, SWEEP_TAG

# The comparison table: column -> MLflow search_runs column.
_COLUMNS = {
    "run name": "tags.mlflow.runName",
    "final loss": "metrics.loss",
    "val loss": "metrics.eval/val_loss",
    "val perplexity": "metrics.eval/val_perplexity",
    "tokens/s": "metrics.eval/train_tokens_per_s",
    "MFU": "metrics.eval/train_mfu",
    "peak RSS rank 0 (MiB)": "metrics.memory/peak_rss_mb",
    "peak tensors (MiB)": "metrics.memory/peak_tensor_mb",
    "predicted peak (MiB)": "metrics.memory/predicted_peak_mb",
    "model states (MiB)": "metrics.memory/model_states_mb",
}
_ESTIMATE = "params.estimate.memory_per_rank_bytes."
_MODEL_STATES = ("parameters", "gradients", "optimizer_states")


def comparison_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per layout from `mlflow.search_runs` output of one sweep's layout runs.

    Measured and predicted memory sit side by side: rank 0's peak resident set (what
    the OS saw), the worst rank's peak tensor memory and the planner's prediction of
    it, and the model states (parameters, gradients, optimizer moments) one rank holds
    with the planner's count of them. Columns the runs do not hold (an older run, a
    metric not logged) are left out rather than shown empty.
    """
    table = pd.DataFrame(index=runs.index)
    table["layout"] = runs.get(f"tags.{SWEEP_LAYOUT_TAG}", runs.get("tags.meshtrain.layout"))
    table["status"] = runs.get(f"tags.{SWEEP_STATUS_TAG}", runs["status"].str.lower())
    for column, source in _COLUMNS.items():
        if source in runs:
            table[column] = runs[source]
    if "predicted peak (MiB)" not in table and f"{_ESTIMATE}total" in runs:
        # Runs planned before the worker logged the prediction beside its measurement.
        table["predicted peak (MiB)"] = pd.to_numeric(runs[f"{_ESTIMATE}total"]) / 2**20
    if all(f"{_ESTIMATE}{part}" in runs for part in _MODEL_STATES):
        states = sum(pd.to_numeric(runs[f"{_ESTIMATE}{part}"]) for part in _MODEL_STATES)
        table["predicted model states (MiB)"] = states / 2**20
    table = table.dropna(axis=1, how="all")
    return table.reset_index(drop=True)


def format_table(table: pd.DataFrame) -> str:
    """The comparison table as aligned text for a terminal."""

    def number(value: Any) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return "-"
            return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4f}"
        return str(value)

    return table.to_string(index=False, formatters={c: number for c in table.columns})


def sweep_runs(tracking_uri: str, experiment_name: str, sweep_id: str) -> pd.DataFrame:
    """The layout runs of one sweep (not its data-processing run), oldest first, as
    `mlflow.search_runs` returns them."""
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return pd.DataFrame()
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracking_uri)
    try:
        runs = mlflow.search_runs(
            [experiment.experiment_id],
            filter_string=f"tags.`{SWEEP_TAG}` = '{sweep_id}'",
            order_by=["attributes.start_time ASC"],
        )
    finally:
        mlflow.set_tracking_uri(previous)
    layout_column = f"tags.{SWEEP_LAYOUT_TAG}"
    if runs.empty or layout_column not in runs:
        return pd.DataFrame()
    return runs[runs[layout_column].notna()].reset_index(drop=True)
