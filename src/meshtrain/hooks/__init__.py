"""The project's Kedro hooks, as `settings.py` registers them, and the names the tests
import from here. Each concern has its own module here:

- `mlflow_hook`: one MLflow run per `kedro run` (`MlflowRunHook`);
- `run_checks`: parameters and inputs checked before a pipeline starts (`RunChecksHook`);
- `tracking_server`: where the run goes, from mlflow.yml, credentials and the environment;
- `refusals`: a refused run ends with its message, not a traceback;
- `staged_data`: a refused run leaves data/ as it was (`StagedDataHook`);
- `config_loader`: Kedro's loader, refusing an unknown `--env` (`ProjectConfigLoader`).
"""

from __future__ import annotations

from meshtrain.config import RUN_GROUPS
from meshtrain.hooks.config_loader import ProjectConfigLoader
from meshtrain.hooks.mlflow_hook import MlflowRunHook
from meshtrain.hooks.refusals import TRACEBACK_VARIABLE, refusal_in, show_refusals_plainly
from meshtrain.hooks.run_checks import RunChecksHook, check_parameters
from meshtrain.hooks.staged_data import StagedDataHook
from meshtrain.tracking.servers import TrackingConfigError, TrackingServer, choose_tracking_server

__all__ = [
    "RUN_GROUPS",
    "TRACEBACK_VARIABLE",
    "MlflowRunHook",
    "ProjectConfigLoader",
    "RunChecksHook",
    "StagedDataHook",
    "TrackingConfigError",
    "TrackingServer",
    "check_parameters",
    "choose_tracking_server",
    "refusal_in",
    "show_refusals_plainly",
]
