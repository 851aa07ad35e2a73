"""Before a pipeline starts: its parameters parse and check, and its inputs exist.

A bad value or a missing dataset is refused before any node writes under data/ and
before the MLflow hook opens a run (the nodes would refuse too, but later); the
project hook (`hooks.RunChecksHook`) asks, with the pipeline and catalog Kedro built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from meshtrain.config import Refused, RunParameters
from meshtrain.pipelines.run_config import TRAINS


class MissingInputError(Refused):
    """A pipeline was run before the one that writes its input (e.g. `--pipeline planning`
    on a fresh clone): the message names the dataset, its file and the pipeline to run."""


def check_parameters(
    params: Mapping[str, Any], pipeline: Any, on_parsed: Callable[[], None] | None = None
) -> list[str]:
    """Check every parameter group `pipeline`'s nodes read, as the nodes will, before any
    node runs: each group's own checks, then (`on_parsed` called between) this machine's
    and its files' (`meshtrain.preflight`); returns the warnings to show."""
    used = {
        name.removeprefix("params:").split(".")[0]
        for name in pipeline.inputs()
        if name.startswith("params:")
    }
    trains = any(TRAINS in node.tags for node in pipeline.nodes)
    parameters = RunParameters(params).parse(used)
    if on_parsed is not None:
        on_parsed()
    # (imported here, once the groups parse: the machine checks load torch and
    # transformers, which a refused typo should not wait for)
    from meshtrain.preflight import preflight  # noqa: PLC0415

    return preflight(parameters, used, trains=trains)


def warm_up(params: Mapping[str, Any], pipeline: Any) -> None:
    """Once the parameters parse, start the warm-rank server (`launch.warm`) of a run that
    trains here: its imports (about 6 s of one core) then run on another core beside the
    machine checks, the MLflow run's start and the nodes before training, instead of
    after them. (Not before the parse: a typo is refused without starting it. A run the
    machine checks refuse has started one for nothing, on a core the checks do not use;
    it ends with the run.)"""
    if any(TRAINS in node.tags for node in pipeline.nodes):
        from meshtrain.launch.warm import prestart  # noqa: PLC0415

        prestart(RunParameters(params).parse({"launch"}).group("launch").warm_ranks)


def _where(catalog: Any, name: str, project_path: str | None) -> str:
    try:
        described = catalog[name]._describe()
    except Exception:  # noqa: BLE001 - only for the message
        return ""
    path = described.get("path") or described.get("filepath")
    if not path:
        return ""
    if project_path and Path(str(path)).is_relative_to(project_path):
        path = Path(str(path)).relative_to(project_path)
    return f" at {path}"


def _missing_inputs(
    pipeline: Any, catalog: Any, registered: Mapping[str, Any], project_path: str | None
) -> list[tuple[str, str, list[str]]]:
    """(dataset, where it would be, the registered pipelines that write it) for each input
    dataset of `pipeline` that its store says does not exist."""
    missing = []
    for name in sorted(pipeline.inputs()):
        if name == "parameters" or name.startswith("params:") or name not in catalog:
            continue
        try:
            if catalog.exists(name):
                continue
        except Exception:  # noqa: BLE001 - a store we cannot ask: let the node try
            continue
        makers = [
            key
            for key, other in registered.items()
            if key != "__default__" and name in other.all_outputs()
        ]
        missing.append((name, _where(catalog, name, project_path), makers))
    return missing


def check_inputs_exist(
    pipeline: Any, catalog: Any, registered: Mapping[str, Any], run_params: Mapping[str, Any]
) -> None:
    """Refuse to start a pipeline whose input datasets were never written, naming each one,
    its file, and the registered pipeline that writes it (instead of the error the first
    node would meet reading it, e.g. transformers' "Repo id must be in the form ...")."""
    missing = _missing_inputs(pipeline, catalog, registered, run_params.get("project_path"))
    if not missing:
        return
    env = run_params.get("env")
    options = f" --env {env}" if env and env != "local" else ""
    if run_params.get("runtime_params"):
        options += " --params ... (the same data.* values)"
    lines = []
    for name, where, makers in missing:
        made_by = (
            f"written by the {' or '.join(makers)} pipeline" if makers else "no pipeline writes it"
        )
        lines.append(f"  - the {name}{where} does not exist yet ({made_by})")
    first = next((makers[0] for _, _, makers in missing if makers), None)
    fix = (
        f"Run `kedro run --pipeline {first}{options}` first (or plain `kedro run{options}`, "
        "which runs every pipeline in order)."
        if first
        else "Create it, or point conf/<env>/catalog.yml at it."
    )
    raise MissingInputError(
        "meshtrain cannot start: this pipeline reads what an earlier one writes, and it is "
        "not there:\n" + "\n".join(lines) + "\n" + fix
    )
