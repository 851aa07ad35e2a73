"""The preflight checks that load what the run builds: the model's config and LoRA
targets (transformers, torch), the data's files and tokenizer, the layout planned
before the data (the planner), lm-eval's task names.

`meshtrain.preflight` imports this module after its own checks (files, network,
values) pass: a refused typo does not wait for these libraries to load.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from meshtrain.config import ConfigError, EvaluationConfig, RunParameters
from meshtrain.config_parsing import names_a_path
from meshtrain.data.corpus import expand_patterns
from meshtrain.data.pretrained_tokenizer import (
    check_tokenizer_fits,
    check_tokenizer_name,
)
from meshtrain.data.tokenizer import tokenizer_size
from meshtrain.evaluation_checks import check_evaluation_inputs
from meshtrain.launch.backends import missing_packages
from meshtrain.models.config_fields import check_model_fields
from meshtrain.models.llama.pretrained import resolve_init_from
from meshtrain.planner.host import check_host
from meshtrain.planner.resolve import plan_before_data


def _check_model(parameters: RunParameters, trains: bool) -> list[str]:
    """The model a run builds: its fields (from scratch) or its folder (`init_from`), and
    the LoRA targets it has."""
    model = parameters.model
    if not model.init_from:
        check_model_fields(model.architecture, model.config)
    elif names_a_path(model.init_from):
        resolve_init_from(model.init_from)  # a folder with config.json and weights
    if model.lora is not None:
        from meshtrain.models.lora import check_lora_targets  # noqa: PLC0415  (torch: LoRA only)

        check_lora_targets(model)
    return []


def _check_plan(parameters: RunParameters, trains: bool) -> list[str]:
    """Plan the layout with what is known before the data (`plan_before_data`); where the
    run trains here, hold the plan against this host's memory and cores."""
    run = parameters.run
    size = tokenizer_size(run.data, run.model.init_from)
    if size is None:  # a hub tokenizer or model: planned once downloaded
        return []
    plan = plan_before_data(run, size)
    if not trains or missing_packages(run.launch.backend):
        return []  # (no ranks start here: the launch refuses, naming what to install)
    return check_host(plan, run.launch.nproc_per_node, snapshot=run.training.checkpoint_async)


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


def _check_evaluation(parameters: RunParameters, trains: bool) -> list[str]:
    """`evaluation.*`: the device it names and lm-eval's task names."""
    evaluation: EvaluationConfig = parameters.group("evaluation")
    check_evaluation_inputs(evaluation)
    return []


# In the order they run (the layout is planned before the data where a node planning or
# training the run is selected).
GROUP_CHECKS: tuple[tuple[frozenset[str], Callable[[RunParameters, bool], list[str]]], ...] = (
    (frozenset({"model"}), _check_model),
    (frozenset({"parallel", "training", "planner"}), _check_plan),
    (frozenset({"data"}), _check_data_inputs),
    (frozenset({"evaluation"}), _check_evaluation),
)
