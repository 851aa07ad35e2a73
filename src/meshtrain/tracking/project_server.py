"""Where this project's MLflow runs go, from the Kedro environment's config.

Settings come from `conf/<env>/mlflow.yml`. Where the run goes is decided in
this order (see docs/tracking.md):

1. the `MLFLOW_TRACKING_URI` environment variable, when set, wins, as it does
   everywhere in MLflow;
2. else, when mlflow.yml names a `credentials:` entry (the `team` environment
   does), that entry of Kedro's credentials config: a whole `tracking_uri`,
   or `host` (+ `port`, `scheme`), with optional `username`/`password` for a
   server started with `--app-name basic-auth`;
3. else mlflow.yml's `tracking_uri` (a sqlite file at the project root by default).

The choice itself is `tracking.servers` (pure functions); this module holds the
settings' defaults and completes the choice for a project, without importing MLflow
(`tracking.pipeline_run` points MLflow at the result). Reading the settings and
credentials from Kedro's config is the project's config loader's part
(`meshtrain.pipelines.config_loader`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshtrain.tracking.servers import (
    URI_VARIABLE,
    TrackingConfigError,
    TrackingServer,
    choose_tracking_server,
    resolve_tracking_uri,
)

DEFAULTS: dict[str, Any] = {
    "enabled": True,
    "tracking_uri": "sqlite:///mlflow.db",
    "experiment_name": "meshtrain",
    # Name of an entry in Kedro's credentials config that holds the tracking server.
    "credentials": None,
    "log_system_metrics": True,
    "system_metrics_sampling_interval": 10,
    # The model registry's name for the evaluated model (a new version per run); null: the
    # model is logged to the run, not registered.
    "registered_model_name": None,
}


def checked_settings(configured: Mapping[str, Any], env: str | None) -> dict[str, Any]:
    """mlflow.yml of the run env over `DEFAULTS`; an unknown key (a typo) is refused."""
    unknown = set(configured) - set(DEFAULTS)
    if unknown:
        raise TrackingConfigError(
            f"mlflow.yml (env {env or 'local'}) has unknown keys {sorted(unknown)}; "
            f"known: {', '.join(DEFAULTS)}."
        )
    return {**DEFAULTS, **configured}


def needs_credentials(settings: Mapping[str, Any]) -> bool:
    """The settings name a credentials entry, and the environment does not override it."""
    return bool(settings["credentials"]) and not os.environ.get(URI_VARIABLE)


def project_server(
    settings: Mapping[str, Any],
    credentials: Mapping[str, Any],
    looked_in: list[str],
    project_path: Path,
) -> TrackingServer:
    """Where this project's runs go, by the precedence of the module docstring, with a
    relative sqlite path anchored at the project (`credentials`: Kedro's credentials
    config, read where `needs_credentials`; `looked_in`: the files it came from)."""
    server = choose_tracking_server(settings, credentials, os.environ, looked_in)
    return TrackingServer(
        resolve_tracking_uri(server.uri, project_path), server.username, server.password
    )
