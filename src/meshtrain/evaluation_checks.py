"""The checks of `evaluation.*` made before any node runs: the device it names, the task
folder, lm-eval's task names. Apart from `meshtrain.evaluation` so that a run's checks
import neither torch nor the evaluation's libraries when nothing needs them (a run that
does not evaluate never calls this; a CUDA device is counted only when one is named).
"""

from __future__ import annotations

from pathlib import Path

from meshtrain.benchmarks import check_tasks, check_tasks_reachable, own_tasks, task_manager
from meshtrain.config import ConfigError, EvaluationConfig


def check_evaluation_inputs(evaluation: EvaluationConfig) -> None:
    """Before any node runs: the device `evaluation.device` names is on this machine, the
    task folder exists, and lm-eval knows (and, offline, has) each task."""
    device = evaluation.device
    if device not in ("auto", "cpu"):
        from meshtrain.device import accelerator, accelerator_count  # noqa: PLC0415 (torch)

        kind, _, index = device.partition(":")
        count = accelerator_count() if kind == accelerator() else 0
        if int(index or 0) >= count:
            raise ConfigError(
                f"`evaluation.device` is {device!r} but this machine has {count} {kind} "
                "device(s): use auto (where the model trained) or cpu."
            )
    include = evaluation.lm_eval_include_path
    if include and not Path(include).is_dir():
        raise ConfigError(
            f"`evaluation.lm_eval_include_path` is {include!r}, which is not a folder; give "
            "a folder of lm-evaluation-harness task YAMLs, or null."
        )
    tasks = evaluation.lm_eval_tasks
    if tasks:
        manager = task_manager(include, defaults=not set(tasks) <= own_tasks())
        check_tasks(tasks, manager)
        check_tasks_reachable(tasks, manager)
