"""Standard benchmark scores from lm-evaluation-harness (`lm-eval`) for the consolidated model.

The harness scores the model already loaded for evaluation (its Python API, no second
load). `evaluation.lm_eval_tasks` names the tasks: the harness's own (hellaswag,
arc_easy, lambada_openai, ... which download their data from the hub, so for a GPU
cluster) or meshtrain's small offline ones in `lm_eval_tasks/` (their YAML and items
ship with the package). Scores come back as `<task>/<metric>`.
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
from pathlib import Path
from typing import Any

from meshtrain.config import ConfigError

logger = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"


def own_tasks() -> set[str]:
    """meshtrain's offline tasks (each YAML is named after its task)."""
    return {path.stem for path in TASKS_DIR.glob("*.yaml")}


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None = None, defaults: bool = True):
    """The harness's task index, with meshtrain's own tasks (and `include_path`'s) in it;
    `defaults=False` leaves out the harness's thousands of task files (seconds to index:
    built once per process, so the evaluation node reuses the index `preflight` made)."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)]
    if include_path:
        if not Path(include_path).is_dir():
            raise ConfigError(
                f"`evaluation.lm_eval_include_path` is {include_path!r}, which is not a "
                "folder; give a folder of lm-evaluation-harness task YAMLs, or null."
            )
        paths.append(str(include_path))
    return TaskManager(include_path=paths, include_defaults=defaults)


def check_tasks(tasks: list[str], manager) -> None:
    """Refuse a task name the harness does not know, with the closest one."""
    known = set(manager.all_tasks)
    for name in tasks:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise ConfigError(
                f"`evaluation.lm_eval_tasks` names {name!r}, which lm-evaluation-harness "
                f"does not know{hint} meshtrain's offline task: meshtrain_python_basics."
            )


def check_tasks_reachable(tasks: list[str], manager) -> None:
    """Offline (meshtrain's default), refuse a task whose dataset is not in this machine's
    `datasets` cache: the harness would fail to download it after training."""
    import datasets  # noqa: PLC0415

    if not datasets.config.HF_DATASETS_OFFLINE:
        return
    own = own_tasks()
    for name in tasks:
        entry = manager.task_index.get(name)
        config = getattr(entry, "cfg", None) or {}
        path = config.get("dataset_path")
        if not path or name in own:
            continue
        try:
            datasets.load_dataset_builder(path, config.get("dataset_name"))
        except Exception:  # noqa: BLE001 - not cached, in whatever way `datasets` says it
            raise ConfigError(
                f"`evaluation.lm_eval_tasks` names {name!r}, whose data ({path} on the "
                "Hugging Face hub) is not in this machine's cache, and the run is offline "
                "(HF_DATASETS_OFFLINE, meshtrain's default): run with HF_HUB_OFFLINE=0 "
                "HF_DATASETS_OFFLINE=0 where the hub is reachable, or use "
                "meshtrain_python_basics."
            ) from None


def scores(results: dict[str, Any]) -> dict[str, float]:
    """`{"arc_easy": {"acc,none": 0.5, "acc_stderr,none": ...}}` -> `{"arc_easy/acc": 0.5,
    "arc_easy/acc_stderr": ...}`: numbers only, the harness's filter suffix dropped."""
    flat = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                continue
            metric, _, filter_name = key.partition(",")
            suffix = "" if filter_name in ("", "none") else f"_{filter_name}"
            flat[f"{task}/{metric}{suffix}"] = float(value)
    return flat


def run_lm_eval(
    model,
    tokenizer,
    tasks: list[str],
    *,
    limit: int | None,
    batch_size: int,
    include_path: str | None = None,
    chat_template: bool = False,
) -> dict[str, float]:
    """Run `tasks` on the loaded `model`; returns `<task>/<metric>` scores.

    `chat_template`: a model fine-tuned on conversations answers best inside its chat
    template, so each question is rendered with the tokenizer's own (the harness's
    `apply_chat_template`); a tokenizer without one is scored on plain text."""
    if not tasks:
        return {}
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(include_path, defaults=not set(tasks) <= own_tasks())
    check_tasks(tasks, manager)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    templated = chat_template and bool(getattr(tokenizer, "chat_template", None))
    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        log_samples=False,
        bootstrap_iters=0,  # no bootstrap: seconds, not minutes, on small tasks
        apply_chat_template=templated,
    )
    found = scores(results or {})
    logger.info("lm-evaluation-harness: %s", ", ".join(f"{k}={v:.4g}" for k, v in found.items()))
    return found
