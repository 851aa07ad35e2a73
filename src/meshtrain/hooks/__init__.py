"""The project's Kedro hooks, as `settings.py` registers them; one hook class a module:

- `mlflow_hook`: one MLflow run per `kedro run` (`MlflowRunHook`);
- `run_checks`: parameters and inputs checked before a pipeline starts (`RunChecksHook`;
  the checks are `pipelines.run_checks` and `preflight`);
- `staged_data`: a refused run leaves data/ as it was (`StagedDataHook`).

What the hooks use lives in rooms named for it: the refusal printer in `refusals`, the
config loader in `pipelines/config_loader`, the tracking server in `tracking.project_server`.
"""

from __future__ import annotations

from meshtrain.hooks.mlflow_hook import MlflowRunHook
from meshtrain.hooks.run_checks import RunChecksHook
from meshtrain.hooks.staged_data import StagedDataHook

__all__ = ["MlflowRunHook", "RunChecksHook", "StagedDataHook"]
