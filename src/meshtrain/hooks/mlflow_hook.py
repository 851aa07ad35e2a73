"""One MLflow run per `kedro run`, opened before the first node and closed after the last.

The nodes (and rank 0 of the training workers, through the run id) log into it;
MLflow itself (and what logs the data and the model) is imported when the run opens,
after the run's checks (`tracking.pipeline_run`): a refused run never waits for it;
where it goes is `tracking.project_server`'s choice, from the config that
`pipelines/config_loader` reads. MLflow's system metrics
(CPU, memory, and GPU where one is visible) are sampled from this process while
the run is open (`log_system_metrics`). The hook knows the nodes by their tags
(`pipelines.run_config.TRAINS`, `EVALUATES`) and the data by dataset name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import Any

from kedro.config import OmegaConfigLoader
from kedro.framework.hooks import hook_impl

from meshtrain.config import ConfigError, RunParameters, read_group
from meshtrain.pipelines.config_loader import mlflow_settings, project_tracking_server
from meshtrain.pipelines.run_config import EVALUATES, TRAINS
from meshtrain.refusals import refusal_in, show_refusals_plainly
from meshtrain.tracking.project_server import DEFAULTS
from meshtrain.training_summary import TrainingSummary

logger = logging.getLogger(__name__)


class MlflowRunHook:
    def __init__(self) -> None:
        self.settings: dict[str, Any] = dict(DEFAULTS)
        self.project_path = Path.cwd()
        self.env: str | None = None
        self.config_loader: OmegaConfigLoader | None = None
        self.node_rank = 0
        self.started = False
        self.training_started = False
        self.logged_data = False

    @staticmethod
    def _runs() -> ModuleType:
        """`tracking.pipeline_run`, imported when a run opens (it loads mlflow, datasets and
        torch): the run's checks, which come first, refuse a typo without waiting for them."""
        from meshtrain.tracking import pipeline_run  # noqa: PLC0415

        return pipeline_run

    @hook_impl
    def after_context_created(self, context) -> None:
        show_refusals_plainly()
        self.settings = mlflow_settings(context.config_loader, context.env)
        self.project_path = Path(context.project_path)
        self.env = context.env
        self.config_loader = context.config_loader
        # On several nodes only node 0 records the run (its rank 0 logs the metrics); the
        # other nodes' `kedro run --pipeline training` would open empty runs.
        try:
            self.node_rank = RunParameters(context.params or {}).group("launch").node_rank
        except ConfigError:
            self.node_rank = 0  # the config check names the bad value before any worker

    def _tags(self, run_params: dict[str, Any], pipeline_name: str) -> dict[str, str]:
        """The Kedro run's own tags: pipeline, env, session, commit, --params."""
        tags = {
            "kedro.pipeline": pipeline_name,
            "kedro.env": run_params.get("env") or self.env or "local",
            "kedro.session_id": run_params.get("session_id", ""),
        }
        commit = self._runs().git_commit(self.project_path)
        if commit:
            tags["mlflow.source.git.commit"] = commit
        if run_params.get("runtime_params"):
            tags["kedro.runtime_params"] = str(run_params["runtime_params"])
        return tags

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any) -> None:
        if not self.settings["enabled"]:
            return
        if self.node_rank > 0:
            logger.info("launch.node_rank=%d: node 0 records this run in MLflow", self.node_rank)
            return
        # Credentials are read here, not when the context is created: this runs after the
        # catalog and parameters are built, so reading conf/local's credentials (a second
        # config loader) cannot disturb them, and other kedro commands never need them.
        server = project_tracking_server(
            self.config_loader, self.env, self.project_path, self.settings
        )
        pipeline_name = run_params.get("pipeline_name") or ",".join(
            run_params.get("pipeline_names") or ["__default__"]
        )
        run_name, tags = self._describe(pipeline_name, pipeline)
        tags |= self._tags(run_params, pipeline_name)
        run_id = self._runs().open_run(server, self.settings, run_name=run_name, tags=tags)
        self.started = True
        self.training_started = False
        self.logged_data = False
        logger.info("MLflow run %s in %s", run_id, self._runs().tracking_uri())

    @staticmethod
    def _describe(pipeline_name: str, pipeline: Any) -> tuple[str, dict[str, str]]:
        """The run's name and its `meshtrain.pipelines` / `meshtrain.trains` tags: it
        trains when one of its nodes has the TRAINS tag."""
        # (imported here: importing kedro.framework.project configures logging)
        from kedro.framework.project import pipelines as registered  # noqa: PLC0415

        nodes = {
            name: {node.name for node in registered[name].nodes}
            for name in registered
            if name != "__default__"
        }
        trains = any(TRAINS in node.tags for node in pipeline.nodes)
        selected = {node.name for node in pipeline.nodes}
        name, tags = MlflowRunHook._runs().describe_run(selected, nodes, trains=trains)
        return (pipeline_name if trains else name), tags

    @hook_impl
    def after_pipeline_run(self) -> None:
        if self.started:
            self._runs().close_run("FINISHED")
            self.started = False

    @hook_impl
    def before_node_run(self, node: Any, inputs: dict[str, Any]) -> None:
        """Before training: its data as the run's dataset inputs. Before evaluation: the
        consolidated model as the run's MLflow model, so the evaluation's metrics link to
        it (and, without training in this run, the validation split it is scored on)."""
        if not self.started:
            return
        if TRAINS in node.tags:
            self.training_started = True
            # data.* as given
            self._runs().log_packed_blocks(inputs["packed_blocks"], inputs["params:data"])
            self.logged_data = True
        elif EVALUATES in node.tags:
            if not self.logged_data:
                self._runs().log_packed_blocks(inputs["packed_blocks"], {}, splits=("validation",))
            self._log_model(inputs)

    def _log_model(self, inputs: dict[str, Any]) -> None:
        if not read_group("evaluation", inputs["params:evaluation"]).log_model:
            return
        layout = TrainingSummary.from_dict(inputs["training_summary"]).layout_name
        self._runs().log_consolidated_model(
            inputs["consolidation_summary"]["output_dir"],
            registered_model_name=self.settings["registered_model_name"],
            tags={"meshtrain.layout": layout} if layout else {},
        )

    @hook_impl
    def on_pipeline_error(self, error: Exception) -> None:
        if not self.started:
            return
        self.started = False
        refusal = refusal_in(error)
        if refusal is not None and not self.training_started:
            # A mistake refused before training (an impossible layout, a stale plan):
            # no run left in the runs list (docs/tracking.md).
            self._runs().discard_refused_run(refusal)
        else:
            self._runs().close_run("FAILED")
