"""plan.json's hash of what it was made from, and the training node that compares it
instead of planning again (issue 29): the parameters a plan reads change the hash, those
it never reads do not, the hash is the same in another process, a plan from other
inputs is refused naming the pipeline to re-run, and the node never calls the search."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import meshtrain.data.blocks
import meshtrain.launch.job
import meshtrain.planner.resolve
import meshtrain.planner.search
from meshtrain.config import RUN_GROUPS, RunConfig
from meshtrain.pipelines.run_config import RUN_PARAMETERS, run_config
from meshtrain.pipelines.training import nodes as training_nodes
from meshtrain.planner import Plan
from meshtrain.planner.plan_inputs import StalePlanError, check_plan_matches, plan_inputs_hash
from meshtrain.planner.resolve import plan_for_run
from tests.conftest import TINY_BLOCK, TINY_MODEL, TINY_VOCAB

REPO = Path(__file__).resolve().parents[1]
TRAIN_BLOCKS, VALIDATION_BLOCKS = 128, 32


class _Tokenizer:
    """Just what planning and the hash read of a tokenizer."""

    bos_token_id = eos_token_id = pad_token_id = 0

    def __len__(self) -> int:
        return TINY_VOCAB


PARAMS: dict[str, Any] = {
    "parallel": {"data_parallel_size": 2},
    "launch": {"nproc_per_node": 2},
    "model": {"config": TINY_MODEL},
    "data": {"block_size": TINY_BLOCK},
}


def _hash(params: dict[str, Any], train_blocks: int = TRAIN_BLOCKS) -> str:
    return plan_inputs_hash(
        run_config(params),
        _Tokenizer(),
        num_train_blocks=train_blocks,
        num_validation_blocks=VALIDATION_BLOCKS,
    )


def _with(group: str, key: str, value: Any) -> dict[str, Any]:
    return {**PARAMS, group: {**PARAMS.get(group, {}), key: value}}


def test_the_run_groups_are_the_run_configs_and_the_nodes_params():
    assert RUN_GROUPS == ("parallel", "training", "launch", "model", "data", "planner")
    assert {group: f"params:{group}" for group in RUN_GROUPS} == RUN_PARAMETERS
    assert run_config(PARAMS) == RunConfig.from_params(**PARAMS)


@pytest.mark.parametrize(
    ("group", "key", "value"),
    [
        ("training", "resume_from", "latest"),
        ("training", "max_steps", 3),
        ("training", "learning_rate", 1e-4),
        ("training", "output_dir", "elsewhere"),
        ("launch", "node_rank", 1),
        ("launch", "rdzv_endpoint", "node001:29500"),
        ("data", "num_proc", 1),
    ],
)
def test_what_no_plan_reads_leaves_the_hash(group: str, key: str, value: Any):
    assert _hash(_with(group, key, value)) == _hash(PARAMS)


@pytest.mark.parametrize(
    ("group", "key", "value"),
    [
        ("parallel", "zero_1", True),
        ("training", "per_device_train_batch_size", 4),
        ("training", "mixed_precision", "bf16"),
        ("launch", "nproc_per_node", 1),
        ("launch", "backend", "gloo"),
        ("model", "config", {**TINY_MODEL, "hidden_size": 32}),
        ("data", "block_size", 16),
        ("planner", "memory_margin", 0.2),
    ],
)
def test_what_a_plan_reads_changes_the_hash(group: str, key: str, value: Any):
    assert _hash(_with(group, key, value)) != _hash(PARAMS)


def test_the_data_sizes_change_the_hash():
    assert _hash(PARAMS, train_blocks=TRAIN_BLOCKS + 1) != _hash(PARAMS)


def test_the_hash_is_the_same_in_another_process():
    probe = "from tests.test_plan_inputs import PARAMS, _hash\nprint(_hash(PARAMS))\n"
    other = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert other.returncode == 0, other.stderr[-2000:]
    assert other.stdout.strip() == _hash(PARAMS)
    assert len(_hash(PARAMS)) == 64  # sha256, hex


def _plan() -> Plan:
    """A plan as the planning node makes it, through plan.json's JSON."""
    plan = plan_for_run(
        run_config(PARAMS),
        _Tokenizer(),
        num_train_blocks=TRAIN_BLOCKS,
        num_validation_blocks=VALIDATION_BLOCKS,
    )
    return Plan.from_dict(json.loads(json.dumps(plan.to_dict())))


def test_a_plan_carries_the_hash_of_what_it_was_made_from():
    plan = _plan()
    assert plan.config_hash == _hash(PARAMS)
    check_plan_matches(plan, _hash(PARAMS))


def test_a_plan_from_other_inputs_or_without_a_hash_is_refused_naming_the_fix():
    plan = _plan()
    with pytest.raises(StalePlanError, match="kedro run --pipeline planning") as stale:
        check_plan_matches(plan, _hash(_with("parallel", "zero_1", True)))
    assert "other parameters or data" in str(stale.value)
    with pytest.raises(StalePlanError, match="kedro run --pipeline planning") as old:
        check_plan_matches(dataclasses.replace(plan, config_hash=""), _hash(PARAMS))
    assert "no hash" in str(old.value)


def _train(monkeypatch: pytest.MonkeyPatch, plan: Plan, params: dict[str, Any]) -> dict:
    """The training node with the planner's search and the workers replaced by stubs."""

    def no_search(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the training node ran the planner's search")

    monkeypatch.setattr(meshtrain.planner.search, "plan_run", no_search)
    monkeypatch.setattr(meshtrain.planner.resolve, "plan_run", no_search)
    monkeypatch.setattr(meshtrain.planner.resolve, "plan_for_run", no_search)
    # (the node imports these when it runs: patched where they live)
    monkeypatch.setattr(meshtrain.data.blocks, "arrow_files", lambda split: [])
    monkeypatch.setattr(
        meshtrain.launch.job,
        "run_training",
        lambda run, resolved, **kwargs: {"layout_name": resolved.layout.name, "converters": []},
    )
    blocks = {"train": [0] * TRAIN_BLOCKS, "validation": [0] * VALIDATION_BLOCKS}
    groups = {group: params.get(group) for group in RUN_GROUPS}
    return training_nodes.train_model(plan.to_dict(), blocks, _Tokenizer(), **groups)


def test_the_training_node_compares_hashes_and_never_searches(monkeypatch):
    plan = _plan()
    summary = _train(monkeypatch, plan, _with("training", "resume_from", "latest"))
    assert summary["layout_name"] == plan.layout.name
    with pytest.raises(StalePlanError, match="kedro run --pipeline planning"):
        _train(monkeypatch, plan, _with("launch", "nproc_per_node", 1))
