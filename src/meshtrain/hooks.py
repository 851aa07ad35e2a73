"""One MLflow run per `kedro run`, opened before the first node and closed after the last.

The nodes (and rank 0 of the training workers, through the run id) log into
it. Settings come from `conf/<env>/mlflow.yml`; the `MLFLOW_TRACKING_URI`
environment variable, when set, wins as it does everywhere in MLflow.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import mlflow
from kedro.framework.hooks import hook_impl

logger = logging.getLogger(__name__)

DEFAULTS = {"enabled": True, "tracking_uri": "sqlite:///mlflow.db", "experiment_name": "meshtrain"}


def resolve_tracking_uri(uri: str, project_path: Path) -> str:
    """Anchor a relative sqlite or file store at the project root, not the current directory."""
    for scheme in ("sqlite:///", "file:"):
        if uri.startswith(scheme):
            path = uri[len(scheme) :]
            if path and not path.startswith("/"):
                return f"{scheme}{(project_path / path).as_posix()}"
    return uri


def git_commit(project_path: Path) -> str | None:
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


class MlflowRunHook:
    def __init__(self) -> None:
        self.settings: dict[str, Any] = dict(DEFAULTS)
        self.project_path = Path.cwd()
        self.env: str | None = None
        self.started = False

    @hook_impl
    def after_context_created(self, context) -> None:
        try:
            configured = context.config_loader["mlflow"] or {}
        except KeyError:
            configured = {}
        self.settings = {**DEFAULTS, **configured}
        self.project_path = Path(context.project_path)
        self.env = context.env

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any]) -> None:
        if not self.settings["enabled"]:
            return
        uri = os.environ.get("MLFLOW_TRACKING_URI") or self.settings["tracking_uri"]
        mlflow.set_tracking_uri(resolve_tracking_uri(uri, self.project_path))
        mlflow.set_experiment(self.settings["experiment_name"])
        if mlflow.active_run() is not None:
            mlflow.end_run()
        pipeline = run_params.get("pipeline_name") or "__default__"
        tags = {
            "kedro.pipeline": pipeline,
            "kedro.env": run_params.get("env") or self.env or "local",
            "kedro.session_id": run_params.get("session_id", ""),
        }
        commit = git_commit(self.project_path)
        if commit:
            tags["mlflow.source.git.commit"] = commit
        if run_params.get("runtime_params"):
            tags["kedro.runtime_params"] = str(run_params["runtime_params"])
        mlflow.start_run(run_name=pipeline, tags=tags)
        self.started = True
        logger.info(
            "MLflow run %s in %s", mlflow.active_run().info.run_id, mlflow.get_tracking_uri()
        )

    @hook_impl
    def after_pipeline_run(self) -> None:
        if self.started:
            mlflow.end_run("FINISHED")
            self.started = False

    @hook_impl
    def on_pipeline_error(self) -> None:
        if self.started:
            mlflow.end_run("FAILED")
            self.started = False
