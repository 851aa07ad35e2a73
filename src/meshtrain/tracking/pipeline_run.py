"""The MLflow run of one pipeline run: opened on the project's tracking server before the
first node, closed after the last, discarded when the run is refused before training.

The project's MLflow hook (`hooks.MlflowRunHook`) calls these once the run's checks
have passed, and imports this module only then: mlflow, and the dataset and model
logging below (datasets, torch), are never loaded for a run its checks refuse.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from meshtrain.offline import disable_telemetry
from meshtrain.tracking.mlflow_run import (
    describe_run,
    discard_refused_run,
    git_commit,
    mark_model_training,
)
from meshtrain.tracking.servers import (
    PASSWORD_VARIABLE,
    URI_VARIABLE,
    USERNAME_VARIABLE,
    TrackingConfigError,
    TrackingServer,
    redact,
)

disable_telemetry()

import mlflow  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402

from meshtrain.tracking.datasets import log_packed_blocks  # noqa: E402
from meshtrain.tracking.model_logging import log_consolidated_model  # noqa: E402

SAMPLING_VARIABLE = "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"

# What the hook logs through here, beside opening and closing the run.
__all__ = [
    "close_run",
    "describe_run",
    "discard_refused_run",
    "git_commit",
    "log_consolidated_model",
    "log_packed_blocks",
    "open_run",
    "server_refusals",
    "tracking_uri",
    "use_tracking_server",
]


def open_run(
    server: TrackingServer,
    settings: Mapping[str, Any],
    *,
    run_name: str,
    tags: dict[str, str],
) -> str:
    """Start this process's MLflow run on `server`, in the settings' experiment (with
    system metrics as they ask); a stale active run is ended first. Returns the run id."""
    # (before mlflow.set_tracking_uri, which sets the variable for the workers)
    entry = None if os.environ.get(URI_VARIABLE) else settings["credentials"]
    use_tracking_server(server)
    with server_refusals(server.uri, settings, entry):
        experiment = mlflow.set_experiment(settings["experiment_name"])
        mark_model_training(experiment.experiment_id)
    if mlflow.active_run() is not None:
        mlflow.end_run()
    log_system_metrics = bool(settings["log_system_metrics"])
    interval = settings["system_metrics_sampling_interval"]
    if log_system_metrics and interval and not os.environ.get(SAMPLING_VARIABLE):
        mlflow.set_system_metrics_sampling_interval(float(interval))
    with server_refusals(server.uri, settings, entry):
        run = mlflow.start_run(run_name=run_name, tags=tags, log_system_metrics=log_system_metrics)
    return run.info.run_id


def close_run(status: str) -> None:
    """End the active run as `status` (FINISHED, FAILED)."""
    mlflow.end_run(status)


def tracking_uri() -> str:
    """Where this process logs, its password redacted."""
    return redact(mlflow.get_tracking_uri())


def use_tracking_server(server: TrackingServer) -> None:
    """Point this process's MLflow at `server`; basic-auth credentials go where MLflow's
    REST client reads them (also in the spawned workers), unless already set there."""
    if server.username is not None:
        os.environ.setdefault(USERNAME_VARIABLE, server.username)
        os.environ.setdefault(PASSWORD_VARIABLE, server.password or "")
    mlflow.set_tracking_uri(server.uri)


@contextlib.contextmanager
def server_refusals(uri: str, settings: Mapping[str, Any], entry: str | None) -> Iterator[None]:
    """A tracking server's 401/403 becomes a refusal that says who was refused and what to
    set (in `entry`, the credentials entry the server came from, if it did); it names the
    user MLflow sent, never the password. Other errors pass unchanged."""
    try:
        yield
    except MlflowException as error:
        if error.error_code not in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            raise
        user = os.environ.get(USERNAME_VARIABLE)
        who = f"user '{user}'" if user else "a client without credentials"
        if error.error_code == "PERMISSION_DENIED":
            raise TrackingConfigError(
                f"MLflow tracking: the server {redact(uri)} let {who} in but denied it "
                f"experiment '{settings['experiment_name']}' (HTTP 403, permission denied); "
                "nothing was logged. Ask an admin of the server for EDIT on it. "
                "See docs/tracking.md."
            ) from None
        fix = f"export the right {USERNAME_VARIABLE} and {PASSWORD_VARIABLE}"
        if entry:
            fix = (
                f"give the right `username` and `password` in the credentials entry "
                f"'{entry}' (conf/local/credentials.yml), or {fix}"
            )
        raise TrackingConfigError(
            f"MLflow tracking: the server {redact(uri)} refused {who} (HTTP 401, not "
            f"authenticated); nothing was logged. It asks for basic auth: {fix}. "
            "See docs/tracking.md."
        ) from None
