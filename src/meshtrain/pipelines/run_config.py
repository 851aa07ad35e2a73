"""The run's parameter groups, named once for the nodes that need the whole `RunConfig`.

The planning and training nodes take the same six groups; they are declared here as
the nodes' `params:` inputs (so `--params "parallel.tensor_parallel_size=2"` and
kedro-viz see each group) and become one `RunConfig` in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshtrain.config import RUN_GROUPS, RunConfig, RunParameters

# Node argument -> dataset: every group of `RunConfig` as `params:<group>`.
RUN_PARAMETERS: dict[str, str] = {group: f"params:{group}" for group in RUN_GROUPS}

# Node tags the project's hooks key on (instead of node names): the node that starts the
# training workers, and the node that scores the consolidated model.
TRAINS = "trains"
EVALUATES = "evaluates"


def with_run_parameters(**datasets: str) -> dict[str, str]:
    """A node's inputs: its datasets, by argument name, then the run's parameter groups."""
    return {**datasets, **RUN_PARAMETERS}


def run_config(groups: Mapping[str, Any]) -> RunConfig:
    """The one `RunConfig` of the parameter groups a node received (parsed and checked)."""
    return RunParameters(groups).run
