"""One MLflow run per `kedro run`, opened before the first node and closed after the last.

The nodes (and rank 0 of the training workers, through the run id) log into
it. Settings come from `conf/<env>/mlflow.yml`. Where the run goes is decided
in this order (see docs/tracking.md):

1. the `MLFLOW_TRACKING_URI` environment variable, when set, wins, as it does
   everywhere in MLflow;
2. else, when mlflow.yml names a `credentials:` entry (the `team` environment
   does), that entry of Kedro's credentials config: a whole `tracking_uri`,
   or `host` (+ `port`, `scheme`), with optional `username`/`password` for a
   server started with `--app-name basic-auth`;
3. else mlflow.yml's `tracking_uri` (a sqlite file at the project root by default).

MLflow's system metrics (CPU, memory, and GPU where one is visible) are
sampled from this process while the run is open (`log_system_metrics`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import mlflow
from kedro.config import MissingConfigException, OmegaConfigLoader
from kedro.framework.hooks import hook_impl
from mlflow.exceptions import MlflowException

from meshtrain.config import Refused
from meshtrain.tracking import mlflow_run as tracking
from meshtrain.tracking.datasets import log_packed_blocks
from meshtrain.tracking.model_logging import log_consolidated_model
from meshtrain.tracking.servers import (  # noqa: F401 - re-exported for cli.py and tests
    PASSWORD_VARIABLE,
    URI_VARIABLE,
    USERNAME_VARIABLE,
    TrackingConfigError,
    TrackingServer,
    choose_tracking_server,
    redact,
    resolve_tracking_uri,
)

logger = logging.getLogger(__name__)

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

SAMPLING_VARIABLE = "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"


# Set to 1 for the full traceback of a refusal.
TRACEBACK_VARIABLE = "MESHTRAIN_TRACEBACK"


def refusal_in(error: BaseException | None) -> Refused | None:
    """The deliberate refusal behind `error` (itself, or what it was raised from)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Refused):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def show_refusals_plainly() -> None:
    """End a `kedro run` that meshtrain refused with the refusal's message alone, instead
    of a traceback through Kedro's and meshtrain's frames; unexpected errors, and every
    error with MESHTRAIN_TRACEBACK=1, keep the traceback. Wraps the exception hook in
    place when the project starts (after Kedro installed rich's), once."""
    previous = sys.excepthook
    if getattr(previous, "meshtrain_refusals", False):
        return

    def hook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        refusal = refusal_in(error)
        if refusal is None or os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
            previous(kind, error, traceback)
            return
        sys.stderr.write(
            f"{type(refusal).__name__}: {refusal}\n\n"
            f"(meshtrain refused the run; {TRACEBACK_VARIABLE}=1 shows the traceback)\n"
        )

    hook.meshtrain_refusals = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class MissingInputError(Refused):
    """A pipeline was run before the one that writes its input (e.g. `--pipeline planning`
    on a fresh clone): the message names the dataset, its file and the pipeline to run."""


# The parameter groups of `RunConfig`, and the node that starts workers (it alone needs a
# launch that can rendezvous: planning for another cluster does not).
RUN_GROUPS = ("parallel", "training", "launch", "model", "data", "planner")
LAUNCHING_NODE = "train_model"
# The node before which the consolidated model is logged (its metrics then link to it).
EVALUATING_NODE = "evaluate"


def check_parameters(params: Mapping[str, Any], pipeline: Any) -> None:
    """Parse and check the parameter groups `pipeline`'s nodes read, as the nodes will,
    before any node runs: a bad value is refused before anything under data/ is written
    (the planning node would refuse it, but only after data processing ran)."""
    from meshtrain.config import (  # noqa: PLC0415
        ConsolidationConfig,
        DataConfig,
        EvaluationConfig,
        RunConfig,
        check_data,
        check_evaluation,
        check_launch,
        parse,
    )

    used = {
        name.removeprefix("params:").split(".")[0]
        for name in pipeline.inputs()
        if name.startswith("params:")
    }
    if used & (set(RUN_GROUPS) - {"data"}):
        run = RunConfig.from_params(**{group: params.get(group) for group in RUN_GROUPS})
        if not run.model.init_from:  # with init_from the folder's config.json is the model's
            from meshtrain.models.builder import check_model_fields  # noqa: PLC0415

            check_model_fields(run.model.architecture, run.model.config)
        if any(node.name == LAUNCHING_NODE for node in pipeline.nodes):
            check_launch(run.launch)
    elif "data" in used:
        check_data(parse(DataConfig, params.get("data"), "data"))
    if "consolidation" in used:
        parse(ConsolidationConfig, params.get("consolidation"), "consolidation")
    if "evaluation" in used:
        check_evaluation(parse(EvaluationConfig, params.get("evaluation"), "evaluation"))


def _where(catalog: Any, name: str, project_path: str | None) -> str:
    try:
        described = catalog.get(name)._describe()
    except Exception:  # noqa: BLE001 - only for the message
        return ""
    path = described.get("path") or described.get("filepath")
    if not path:
        return ""
    if project_path and Path(str(path)).is_relative_to(project_path):
        path = Path(str(path)).relative_to(project_path)
    return f" at {path}"


def check_inputs_exist(
    pipeline: Any, catalog: Any, registered: Mapping[str, Any], run_params: Mapping[str, Any]
) -> None:
    """Refuse to start a pipeline whose input datasets were never written, naming each one,
    its file, and the registered pipeline that writes it (instead of the error the first
    node would meet reading it, e.g. transformers' "Repo id must be in the form ...")."""
    missing = []
    for name in sorted(pipeline.inputs()):
        if name == "parameters" or name.startswith("params:") or name not in catalog:
            continue
        try:
            if catalog.exists(name):
                continue
        except Exception:  # noqa: BLE001 - a store we cannot ask: let the node try
            continue
        makers = [
            key
            for key, other in registered.items()
            if key != "__default__" and name in other.all_outputs()
        ]
        missing.append((name, _where(catalog, name, run_params.get("project_path")), makers))
    if not missing:
        return
    env = run_params.get("env")
    options = f" --env {env}" if env and env != "local" else ""
    if run_params.get("runtime_params"):
        options += " --params ... (the same data.* values)"
    lines = []
    for name, where, makers in missing:
        made_by = (
            f"written by the {' or '.join(makers)} pipeline" if makers else "no pipeline writes it"
        )
        lines.append(f"  - the {name}{where} does not exist yet ({made_by})")
    first = next((makers[0] for _, _, makers in missing if makers), None)
    fix = (
        f"Run `kedro run --pipeline {first}{options}` first (or plain `kedro run{options}`, "
        "which runs every pipeline in order)."
        if first
        else "Create it, or point conf/<env>/catalog.yml at it."
    )
    raise MissingInputError(
        "meshtrain cannot start: this pipeline reads what an earlier one writes, and it is "
        "not there:\n" + "\n".join(lines) + "\n" + fix
    )


class RunChecksHook:
    """Before a pipeline starts (and before the MLflow hook opens a run): its parameters
    parse and check, and the datasets it reads exist."""

    @hook_impl(tryfirst=True)
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        from kedro.framework.project import pipelines as registered  # noqa: PLC0415

        params = catalog.get("parameters").load() if "parameters" in catalog else {}
        check_parameters(params or {}, pipeline)
        check_inputs_exist(pipeline, catalog, registered, run_params)


def _credentials_of(loader: OmegaConfigLoader) -> dict[str, Any]:
    try:
        return dict(loader["credentials"] or {})
    except MissingConfigException:
        return {}


def load_credentials(config_loader: OmegaConfigLoader, env: str) -> tuple[dict[str, Any], list]:
    """The credentials config of the run env (base + `--env`), completed by conf/local's.

    Kedro reads conf/local only when it is the run env, yet conf/local is the
    git-ignored home of secrets; so for `--env team` the entries of
    conf/local/credentials.yml fill in those the run env lacks.
    """
    base_env = getattr(config_loader, "base_env", None) or "base"
    credentials = _credentials_of(config_loader)
    looked_in = [f"conf/{base_env}/credentials*.yml", f"conf/{env}/credentials*.yml"]
    if env != "local":
        local = OmegaConfigLoader(
            conf_source=str(config_loader.conf_source),
            env="local",
            base_env=base_env,
            default_run_env="local",
        )
        credentials = {**_credentials_of(local), **credentials}
        looked_in.append("conf/local/credentials*.yml")
    return credentials, looked_in


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


def mlflow_settings(config_loader: OmegaConfigLoader, env: str | None) -> dict[str, Any]:
    """mlflow.yml of the run env over `DEFAULTS`; an unknown key (a typo) is refused."""
    try:
        configured = config_loader["mlflow"] or {}
    except (KeyError, MissingConfigException):
        configured = {}
    unknown = set(configured) - set(DEFAULTS)
    if unknown:
        raise TrackingConfigError(
            f"mlflow.yml (env {env or 'local'}) has unknown keys {sorted(unknown)}; "
            f"known: {', '.join(DEFAULTS)}."
        )
    return {**DEFAULTS, **configured}


def project_tracking_server(
    config_loader: OmegaConfigLoader,
    env: str | None,
    project_path: Path,
    settings: Mapping[str, Any] | None = None,
) -> TrackingServer:
    """Where this project's runs go in `env`, by the precedence of the module docstring,
    with a relative sqlite path anchored at the project; for the hook and for any other
    caller that must find the same runs (e.g. a command that reads them back)."""
    settings = settings if settings is not None else mlflow_settings(config_loader, env)
    credentials: dict[str, Any] = {}
    looked_in: list[str] = []
    if settings.get("credentials") and not os.environ.get(URI_VARIABLE):
        credentials, looked_in = load_credentials(config_loader, env or "local")
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

    @hook_impl
    def after_context_created(self, context) -> None:
        show_refusals_plainly()
        self.settings = mlflow_settings(context.config_loader, context.env)
        self.project_path = Path(context.project_path)
        self.env = context.env
        self.config_loader = context.config_loader
        # On several nodes only node 0 records the run (its rank 0 logs the metrics); the
        # other nodes' `kedro run --pipeline training` would open empty runs.
        launch = (context.params or {}).get("launch") or {}
        try:
            self.node_rank = int(launch.get("node_rank", 0) or 0)
        except (TypeError, ValueError):
            self.node_rank = 0  # the config check names the bad value before any worker

    @staticmethod
    def _describe(pipeline: str, run_nodes: set[str]) -> tuple[str, dict[str, str]]:
        """The run's name and its `meshtrain.pipelines` / `meshtrain.trains` tags."""
        from kedro.framework.project import pipelines as registered  # noqa: PLC0415

        nodes = {
            name: {node.name for node in registered[name].nodes}
            for name in registered
            if name != "__default__"
        }
        name, tags = tracking.describe_run(run_nodes, nodes, LAUNCHING_NODE)
        return (pipeline if tags[tracking.TRAINS_TAG] == "true" else name), tags

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any) -> None:
        run_nodes = {node.name for node in pipeline.nodes}
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
        # (before mlflow.set_tracking_uri, which sets the variable for the workers)
        entry = None if os.environ.get(URI_VARIABLE) else self.settings.get("credentials")
        use_tracking_server(server)
        with server_refusals(server.uri, self.settings, entry):
            experiment = mlflow.set_experiment(self.settings["experiment_name"])
            tracking.mark_model_training(experiment.experiment_id)
        if mlflow.active_run() is not None:
            mlflow.end_run()
        pipeline = run_params.get("pipeline_name") or ",".join(
            run_params.get("pipeline_names") or ["__default__"]
        )
        run_name, tags = self._describe(pipeline, run_nodes)
        tags |= {
            "kedro.pipeline": pipeline,
            "kedro.env": run_params.get("env") or self.env or "local",
            "kedro.session_id": run_params.get("session_id", ""),
        }
        commit = git_commit(self.project_path)
        if commit:
            tags["mlflow.source.git.commit"] = commit
        if run_params.get("runtime_params"):
            tags["kedro.runtime_params"] = str(run_params["runtime_params"])
        log_system_metrics = bool(self.settings["log_system_metrics"])
        interval = self.settings["system_metrics_sampling_interval"]
        if log_system_metrics and interval and not os.environ.get(SAMPLING_VARIABLE):
            mlflow.set_system_metrics_sampling_interval(float(interval))
        with server_refusals(server.uri, self.settings, entry):
            mlflow.start_run(run_name=run_name, tags=tags, log_system_metrics=log_system_metrics)
        self.started = True
        self.training_started = False
        self.logged_data = False
        logger.info(
            "MLflow run %s in %s",
            mlflow.active_run().info.run_id,
            redact(mlflow.get_tracking_uri()),
        )

    @hook_impl
    def after_pipeline_run(self) -> None:
        if self.started:
            mlflow.end_run("FINISHED")
            self.started = False

    @hook_impl
    def before_node_run(self, node: Any, inputs: dict[str, Any]) -> None:
        """Before training: its data as the run's dataset inputs. Before evaluation: the
        consolidated model as the run's MLflow model, so the evaluation's metrics link to
        it (and, without training in this run, the validation split it is scored on)."""
        if not self.started:
            return
        if node.name == LAUNCHING_NODE:
            self.training_started = True
            log_packed_blocks(inputs["packed_blocks"], inputs.get("params:data") or {})
            self.logged_data = True
        elif node.name == EVALUATING_NODE:
            if not self.logged_data:
                log_packed_blocks(inputs["packed_blocks"], {}, splits=("validation",))
            self._log_model(inputs)

    def _log_model(self, inputs: dict[str, Any]) -> None:
        evaluation = inputs.get("params:evaluation") or {}
        if str(evaluation.get("log_model", True)).lower() == "false":
            return
        layout = (inputs.get("training_summary") or {}).get("layout_name")
        log_consolidated_model(
            inputs["consolidation_summary"]["output_dir"],
            registered_model_name=self.settings.get("registered_model_name"),
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
            tracking.discard_refused_run(refusal)
        else:
            mlflow.end_run("FAILED")


class MissingEnvironmentError(Refused):
    """`--env` (or KEDRO_ENV) names an environment with no folder under conf/."""


class ProjectConfigLoader(OmegaConfigLoader):
    """Kedro's loader, refusing at once an environment that has no folder: Kedro itself
    meets a missing `conf/<env>` only when it first reads the catalog, and ends
    `kedro run --env gpux` with a page of traceback and the folder's path."""

    def __init__(self, conf_source: str, env: str | None = None, **kwargs: Any) -> None:
        super().__init__(conf_source, env=env, **kwargs)
        conf = Path(conf_source)
        if env and env != self.base_env and conf.is_dir() and not (conf / env).is_dir():
            show_refusals_plainly()  # the context, whose hook installs it, comes later
            existing = sorted(p.name for p in conf.iterdir() if p.is_dir() and p.name != "local")
            raise MissingEnvironmentError(
                f"--env {env}: there is no environment {env!r} (no folder {conf / env}). "
                f"The environments are: {', '.join(existing)} (and local, read on top of "
                "the one chosen). Pass one of them, or create the folder."
            )
