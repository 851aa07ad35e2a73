"""Every parameter a run will read, checked before the run does any work.

A typo in `consolidation.dtype` or `evaluation.lm_eval_tasks` used to surface after
training, hours later; a layout that cannot run, after the corpus was tokenized. The
project hook calls `preflight` with the parameter groups the selected pipelines' nodes
read, before the first node (and before the MLflow hook opens a run). Each group is
parsed once into its typed dataclass, with the checks it owns (`config.read_group`:
enumerations, ranges, settings that contradict each other); then each selected group's
checks against this machine and its files run: first those that need only the files and
the network (here), then those that load what the run builds (`preflight_builds`: the
model's config, the tokenizer, the layout planned as far as it can be before the data is
read, lm-eval's task names). What needs the data itself (a block longer than the corpus,
a batch larger than its blocks) is refused by the node that first has it, before
training starts.

The checks that import the rooms above `config` (models, data, the planner) live in these
two modules, not as methods of the groups: `config` sits below those rooms, which import
it. Nothing here writes anything; everything runs in this process, without workers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

from meshtrain.checkpoint.consolidate.options import check_consolidation
from meshtrain.checkpoint.manifest import find_resume_checkpoint
from meshtrain.checkpoint.remote import find_checkpoint, is_url
from meshtrain.config import (
    ConsolidationConfig,
    RunParameters,
    check_launch,
)
from meshtrain.config_dpo import check_objective_data
from meshtrain.launch.network import node_address

# A group's checks against the machine and the files: (the parameters, whether the
# selected pipelines train on this host) -> warnings to print.
GroupCheck = Callable[[RunParameters, bool], list[str]]
GroupChecks = tuple[tuple[frozenset[str], GroupCheck], ...]


def preflight(parameters: RunParameters, groups: Collection[str], *, trains: bool) -> list[str]:
    """Refuse (raise `Refused`) the first parameter of `groups` (parsed: `RunParameters.parse`)
    that this machine or its files make a node refuse; `trains`: the selected pipelines
    start training workers on this host. Returns the warnings to print (e.g. more ranks
    than cores).

    The checks that need only the files and the network (`GROUP_CHECKS`) run first; those
    that load what the run builds (`preflight_builds.GROUP_CHECKS`: transformers, the
    tokenizer, the planner, lm-eval) are imported and run after them, so a wrong folder
    or dtype is refused in a second."""
    warnings = _run_checks(GROUP_CHECKS, parameters, groups, trains)
    from meshtrain import preflight_builds  # noqa: PLC0415

    return warnings + _run_checks(preflight_builds.GROUP_CHECKS, parameters, groups, trains)


def _run_checks(
    checks: GroupChecks, parameters: RunParameters, groups: Collection[str], trains: bool
) -> list[str]:
    warnings: list[str] = []
    for asked_by, check in checks:
        if asked_by & set(groups):
            warnings += check(parameters, trains)
    return warnings


def _check_launch_here(parameters: RunParameters, trains: bool) -> list[str]:
    """Where workers start on this host: a launch that can rendezvous, from an interface
    with a route to the rendezvous."""
    if trains:
        launch = parameters.group("launch")
        check_launch(launch)
        node_address(launch)
    return []


def _check_resume(parameters: RunParameters, trains: bool) -> list[str]:
    """`training.resume_from` naming a folder: a complete checkpoint (`latest` may find
    none: the run then starts at step 0)."""
    training = parameters.group("training")
    if trains and is_url(training.resume_from):
        find_checkpoint(training.resume_from, "training.resume_from")
    elif trains and training.resume_from not in (None, "latest"):
        find_resume_checkpoint(Path(training.output_dir), training.resume_from, training.run_name)
    return []


def _check_consolidation_inputs(parameters: RunParameters, trains: bool) -> list[str]:
    """`consolidation.*` as the consolidation node will meet it, for a run that trains
    LoRA adapters or not (`model.lora`)."""
    consolidation: ConsolidationConfig = parameters.group("consolidation")
    check_consolidation(consolidation, lora=parameters.model.lora is not None)
    return []


def _check_objective_data(parameters: RunParameters, trains: bool) -> list[str]:
    """DPO and preference pairs go together, where the data's format is known before it
    is read (the data node refuses the others once it has read the columns)."""
    check_objective_data(parameters.group("training").objective, parameters.data.known_format)
    return []


# Each group's checks against the files and the network, in the order they run: (the
# groups whose selection asks for it, the check).
GROUP_CHECKS: GroupChecks = (
    (frozenset({"launch"}), _check_launch_here),
    (frozenset({"training"}), _check_resume),
    (frozenset({"consolidation"}), _check_consolidation_inputs),
    (frozenset({"training"}), _check_objective_data),
)
