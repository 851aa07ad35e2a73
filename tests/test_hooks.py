"""`hooks/` holds Kedro hook classes only: what they use lives in rooms named for it."""

from __future__ import annotations

import ast
from pathlib import Path

import meshtrain.hooks

HOOKS = Path(meshtrain.hooks.__file__).parent


def test_every_hooks_module_defines_only_hook_classes():
    for path in sorted(HOOKS.glob("*.py")):
        tree = ast.parse(path.read_text())
        defined = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
        for node in defined:
            assert isinstance(node, ast.ClassDef), f"{path.name}: {node.name} is not a class"
            assert node.name.endswith("Hook"), f"{path.name}: {node.name} is not a hook"


def test_the_package_exports_the_hooks_settings_registers():
    assert set(meshtrain.hooks.__all__) == {"MlflowRunHook", "RunChecksHook", "StagedDataHook"}
