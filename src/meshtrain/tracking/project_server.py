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
settings' defaults, completes the choice for a project, and points MLflow at the
result. Reading the settings and credentials from Kedro's config is the project's
config loader's part (`meshtrain.pipelines.config_loader`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from meshtrain.tracking.servers import (
    PASSWORD_VARIABLE,
    URI_VARIABLE,
    USERNAME_VARIABLE,
    TrackingConfigError,
    TrackingServer,
    choose_tracking_server,
    redact,
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
