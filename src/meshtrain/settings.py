"""Kedro project settings for meshtrain."""

from meshtrain.offline import disable_telemetry

disable_telemetry()  # before kedro's hooks or mlflow are used

from meshtrain.hooks import MlflowRunHook, RunChecksHook, StagedDataHook  # noqa: E402
from meshtrain.pipelines.config_loader import ProjectConfigLoader  # noqa: E402

# RunChecksHook refuses bad parameters and missing inputs before MlflowRunHook opens a run.
HOOKS = (MlflowRunHook(), RunChecksHook(), StagedDataHook())

# Kedro's OmegaConfigLoader, refusing an --env with no conf/ folder in one line.
CONFIG_LOADER_CLASS = ProjectConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    # An environment (conf/gpu, conf/trn1, ...) overrides single parameters, e.g.
    # `launch.backend`, and keeps the rest of each group from conf/base.
    "merge_strategy": {"parameters": "soft"},
    "config_patterns": {
        "mlflow": ["mlflow*", "mlflow*/**"],
    },
}

# meshtrain opens its own MLflow run (meshtrain.hooks.mlflow_hook); if kedro-mlflow is
# installed too, keep it from opening a second one from the same mlflow.yml.
DISABLE_HOOKS_FOR_PLUGINS = ("kedro-mlflow",)
