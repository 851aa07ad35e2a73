"""Before a pipeline starts: its parameters parse and check, and its inputs exist
(`pipelines.run_checks`), before any node writes under data/ and before the MLflow hook
opens a run."""

from __future__ import annotations

import logging
from typing import Any

from kedro.framework.hooks import hook_impl

from meshtrain.pipelines.run_checks import check_inputs_exist, check_parameters, warm_up

logger = logging.getLogger(__name__)


class RunChecksHook:
    """Before a pipeline starts (and before the MLflow hook opens a run): its parameters
    parse and check, and the datasets it reads exist."""

    @hook_impl(tryfirst=True)
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        # (imported here: importing kedro.framework.project configures logging)
        from kedro.framework.project import pipelines as registered  # noqa: PLC0415

        params = catalog["parameters"].load() if "parameters" in catalog else {}
        params = params or {}
        warnings = check_parameters(params, pipeline, on_parsed=lambda: warm_up(params, pipeline))
        for warning in warnings:
            logger.warning(warning)
        check_inputs_exist(pipeline, catalog, registered, run_params)
        logger.info(
            "meshtrain checked the parameters before the first node; what needs the data "
            "(block size against the corpus, batch against the blocks) is checked by the "
            "node that reads it, before training, and data/ is kept as it is until then."
        )
