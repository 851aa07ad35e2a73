"""Every parameter a run will read, checked before the run does any work.

A typo in `consolidation.dtype` or `evaluation.lm_eval_tasks` used to surface after
training, hours later; a layout that cannot run, after the corpus was tokenized. The
project hook calls `preflight` with the parameter groups the selected pipelines' nodes
read, before the first node (and before the MLflow hook opens a run). Each group is
parsed once into its typed dataclass, with the checks it owns (`config.read_group`:
enumerations, ranges, settings that contradict each other); then each selected group's
checks against this machine and its files run, in `GROUP_CHECKS`' order (files that must
exist, task names, the layout planned as far as it can be before the data is read). What
needs the data itself (a block longer than the corpus, a batch larger than its blocks)
is refused by the node that first has it, before training starts.

The checks that import the rooms above `config` (models, data, the planner) live here,
not as methods of the groups: `config` sits below those rooms, which import it.
Nothing here writes anything; everything runs in this process, without workers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from meshtrain.checkpoint.consolidate.options import check_consolidation
from meshtrain.checkpoint.manifest import find_resume_checkpoint
from meshtrain.config import (
    GROUPS,
    ConfigError,
    ConsolidationConfig,
    EvaluationConfig,
    RunParameters,
    check_launch,
)
from meshtrain.config_parsing import names_a_path
from meshtrain.data.corpus import expand_patterns
from meshtrain.data.pretrained_tokenizer import (
    check_tokenizer_fits,
    check_tokenizer_name,
)
from meshtrain.data.tokenizer import tokenizer_size
from meshtrain.evaluation import check_evaluation_inputs
from meshtrain.launch.network import node_address
from meshtrain.models.builder import check_model_fields, resolve_init_from
from meshtrain.models.lora import check_lora_targets
from meshtrain.planner.host import check_host
from meshtrain.planner.resolve import plan_before_data

# A group's checks against the machine and the files: (the parameters, whether the
# selected pipelines train on this host) -> warnings to print.
GroupCheck = Callable[[RunParameters, bool], list[str]]


def preflight(params: Mapping[str, Any], groups: Collection[str], *, trains: bool) -> list[str]:
    """Refuse (raise `Refused`) the first parameter of `groups` a node would refuse;
    `trains`: the selected pipelines start training workers on this host. Returns the
    warnings to print (e.g. more ranks than cores)."""
    parameters = RunParameters(params)
    for name in GROUPS:  # in their order
        if name in groups:
            parameters.group(name)
    warnings: list[str] = []
    for asked_by, check in GROUP_CHECKS:
        if asked_by & set(groups):
            warnings += check(parameters, trains)
    return warnings


def _check_model(parameters: RunParameters, trains: bool) -> list[str]:
    """The model a run builds: its fields (from scratch) or its folder (`init_from`), and
    the LoRA targets it has."""
    model = parameters.model
    if not model.init_from:
        check_model_fields(model.architecture, model.config)
    elif names_a_path(model.init_from):
        resolve_init_from(model.init_from)  # a folder with config.json and weights
    if model.lora is not None:
        check_lora_targets(model)
    return []


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
    if trains and training.resume_from not in (None, "latest"):
        find_resume_checkpoint(Path(training.output_dir), training.resume_from, training.run_name)
    return []


def _check_plan(parameters: RunParameters, trains: bool) -> list[str]:
    """Plan the layout with what is known before the data (`plan_before_data`); where the
    run trains here, hold the plan against this host's memory and cores."""
    run = parameters.run
    size = tokenizer_size(run.data, run.model.init_from)
    if size is None:  # a hub tokenizer or model: planned once downloaded
        return []
    plan = plan_before_data(run, size)
    return check_host(plan, run.launch.nproc_per_node) if trains else []


def _check_data_inputs(parameters: RunParameters, trains: bool) -> list[str]:
    """The files and names `data.*` points at: they exist and are what they must be."""
    data = parameters.data
    if data.source == "text_files":
        expand_patterns(data.text_files or [], "data.text_files")
    if data.source == "files":
        expand_patterns(data.data_files or [], "data.data_files")
    if data.chat_template and not Path(data.chat_template).is_file():
        raise ConfigError(
            f"`data.chat_template` {data.chat_template!r} is not a file: name a Jinja template "
            "file, or leave it null to use the tokenizer's own template."
        )
    check_tokenizer_name(data.tokenizer)
    check_tokenizer_fits(data.tokenizer, parameters.model.init_from)
    return []


def _check_consolidation_inputs(parameters: RunParameters, trains: bool) -> list[str]:
    """`consolidation.*` as the consolidation node will meet it, for a run that trains
    LoRA adapters or not (`model.lora`)."""
    consolidation: ConsolidationConfig = parameters.group("consolidation")
    check_consolidation(consolidation, lora=parameters.model.lora is not None)
    return []


def _check_evaluation(parameters: RunParameters, trains: bool) -> list[str]:
    """`evaluation.*`: the device it names and lm-eval's task names."""
    evaluation: EvaluationConfig = parameters.group("evaluation")
    check_evaluation_inputs(evaluation)
    return []


# Each group's checks against the machine and the files, in the order they run: (the
# groups whose selection asks for it, the check). The layout is planned before the data
# where a node planning or training the run is selected.
GROUP_CHECKS: tuple[tuple[frozenset[str], GroupCheck], ...] = (
    (frozenset({"model"}), _check_model),
    (frozenset({"launch"}), _check_launch_here),
    (frozenset({"training"}), _check_resume),
    (frozenset({"parallel", "training", "planner"}), _check_plan),
    (frozenset({"data"}), _check_data_inputs),
    (frozenset({"consolidation"}), _check_consolidation_inputs),
    (frozenset({"evaluation"}), _check_evaluation),
)
