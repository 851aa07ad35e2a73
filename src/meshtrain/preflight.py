"""Every parameter a run will read, checked before the run does any work.

A typo in `consolidation.dtype` or `evaluation.lm_eval_tasks` used to surface after
training, hours later; a layout that cannot run, after the corpus was tokenized. The
project hook calls `preflight` with the parameter groups the selected pipelines' nodes
read, before the first node (and before the MLflow hook opens a run): each group is
parsed and checked with its values (enumerations, dtypes, task names, files that must
exist), and the layout is planned as far as it can be before the data is read. What
needs the data itself (a block longer than the corpus, a batch larger than its blocks)
is refused by the node that first has it, before training starts.

Nothing here writes anything; everything runs in this process, without workers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from meshtrain.config import (
    RUN_GROUPS,
    ConfigError,
    ConsolidationConfig,
    DataConfig,
    EvaluationConfig,
    ModelConfig,
    RunConfig,
    check_data,
    check_evaluation,
    check_launch,
    parse,
)
from meshtrain.config_parsing import names_a_path
from meshtrain.launch.network import node_address

# Groups the planner reads: with any of them selected, the layout is planned before data.
_PLANNED = {"parallel", "training", "planner"}


def preflight(params: Mapping[str, Any], groups: Collection[str], *, trains: bool) -> list[str]:
    """Refuse (raise `Refused`) the first parameter of `groups` a node would refuse;
    `trains`: the selected pipelines start training workers on this host. Returns the
    warnings to print (e.g. more ranks than cores)."""
    groups = set(groups)
    warnings: list[str] = []
    if groups & (set(RUN_GROUPS) - {"data", "model"}):  # nodes reading the whole run
        run = RunConfig.from_params(**{group: params.get(group) for group in RUN_GROUPS})
        _check_model(run.model)
        if trains:
            check_launch(run.launch)
            node_address(run.launch)  # the interface and the route to the rendezvous
            _check_resume(run)
        if groups & _PLANNED:
            warnings += _plan_before_data(run, trains=trains)
    elif "model" in groups:  # the data pipeline: the model's tokenizer and config
        _check_model(parse(ModelConfig, params.get("model"), "model"))
    if "data" in groups:
        data = parse(DataConfig, params.get("data"), "data")
        check_data(data)
        _check_data_inputs(data, (params.get("model") or {}).get("init_from"))
    if "consolidation" in groups:
        from meshtrain.checkpoint.consolidate.options import check_consolidation  # noqa: PLC0415

        consolidation = parse(ConsolidationConfig, params.get("consolidation"), "consolidation")
        check_consolidation(consolidation, lora=bool((params.get("model") or {}).get("lora")))
    if "evaluation" in groups:
        _check_evaluation(parse(EvaluationConfig, params.get("evaluation"), "evaluation"))
    return warnings


def _check_model(model: ModelConfig) -> None:
    """The model a run builds: its fields (from scratch) or its folder (`init_from`), and
    the LoRA targets it has."""
    from meshtrain.models.builder import check_model_fields, resolve_init_from  # noqa: PLC0415

    if not model.init_from:
        check_model_fields(model.architecture, model.config)
    elif names_a_path(model.init_from):
        resolve_init_from(model.init_from)  # a folder with config.json and weights
    if model.lora_settings is not None:
        from meshtrain.models.lora import check_lora_targets  # noqa: PLC0415

        check_lora_targets(model)


def _check_resume(run: RunConfig) -> None:
    """`training.resume_from` naming a folder: a complete checkpoint (`latest` may find
    none: the run then starts at step 0)."""
    resume_from = run.training.resume_from
    if resume_from in (None, "latest"):
        return
    from meshtrain.checkpoint.manifest import find_resume_checkpoint  # noqa: PLC0415

    find_resume_checkpoint(Path(run.training.output_dir), resume_from, run.training.run_name)


def _plan_before_data(run: RunConfig, *, trains: bool) -> list[str]:
    """Plan the layout with what is known before the data (`plan_before_data`); where the
    run trains here, hold the plan against this host's memory and cores."""
    size = _tokenizer_size(run.data, run.model.init_from)
    if size is None:  # a hub tokenizer or model: planned once downloaded
        return []
    from meshtrain.planner.host import check_host  # noqa: PLC0415
    from meshtrain.planner.resolve import plan_before_data  # noqa: PLC0415

    plan = plan_before_data(run, size)
    return check_host(plan, run.launch.nproc_per_node) if trains else []


def _tokenizer_size(data: DataConfig, init_from: str | None) -> int | None:
    """The tokenizer's length as the data pipeline will have it: `data.tokenizer`'s, else
    the `model.init_from` folder's, else at most `data.vocab_size` (trained here); None
    where that tokenizer is on the hub."""
    from meshtrain.data.pretrained_tokenizer import (  # noqa: PLC0415
        load_data_tokenizer,
        tokenizer_to_load,
    )

    if init_from and not names_a_path(init_from) and not data.tokenizer:
        return None
    name = tokenizer_to_load(data.tokenizer, init_from)
    if name is None:
        return data.vocab_size
    return len(load_data_tokenizer(name)) if names_a_path(name) else None


def _check_data_inputs(data: DataConfig, init_from: str | None) -> None:
    """The files and names `data.*` points at: they exist and are what they must be."""
    from meshtrain.data.corpus import expand_patterns  # noqa: PLC0415
    from meshtrain.data.pretrained_tokenizer import (  # noqa: PLC0415
        check_tokenizer_fits,
        check_tokenizer_name,
    )

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
    check_tokenizer_fits(data.tokenizer, init_from)


def _check_evaluation(evaluation: EvaluationConfig) -> None:
    """`evaluation.*`: its values, the device it names, and lm-eval's task names."""
    check_evaluation(evaluation)
    device = evaluation.device
    if device.startswith("cuda"):
        import torch  # noqa: PLC0415

        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"`evaluation.device` is {device!r} but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s): use auto (where the model "
                "trained) or cpu."
            )
    include = evaluation.lm_eval_include_path
    if include and not Path(include).is_dir():
        raise ConfigError(
            f"`evaluation.lm_eval_include_path` is {include!r}, which is not a folder; give "
            "a folder of lm-evaluation-harness task YAMLs, or null."
        )
    if evaluation.lm_eval_tasks:
        from meshtrain.benchmarks import (  # noqa: PLC0415
            check_tasks,
            check_tasks_reachable,
            own_tasks,
            task_manager,
        )

        tasks = evaluation.lm_eval_tasks
        manager = task_manager(
            evaluation.lm_eval_include_path, defaults=not set(tasks) <= own_tasks()
        )
        check_tasks(tasks, manager)
        check_tasks_reachable(tasks, manager)
