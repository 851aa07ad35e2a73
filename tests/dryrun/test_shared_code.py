"""The dry run's fidelity by construction: it builds and steps a rank through the
trainer's own two functions, and defines no build or step of its own to keep in step."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import meshtrain.dryrun
from meshtrain import trainer
from meshtrain.components import rank_build, train_step
from meshtrain.dryrun import rank


def test_the_dry_run_defines_no_build_or_step_of_its_own():
    folder = Path(meshtrain.dryrun.__file__).parent
    own = [
        f"{path.name}:{node.name}"
        for path in sorted(folder.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and ("step" in node.name or "build" in node.name)
    ]
    assert own == []


def test_the_dry_run_and_the_trainer_call_the_same_build_and_step():
    assert rank.build_rank is rank_build.build_rank
    assert rank.optimizer_step is train_step.optimizer_step
    assert trainer.build_rank is rank_build.build_rank
    assert trainer.optimizer_step is train_step.optimizer_step
    source = inspect.getsource(trainer.Trainer)
    assert "build_rank(" in source and "optimizer_step(" in source
