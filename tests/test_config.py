"""RunConfig: defaults, refusal of unknown keys and wrong kinds, `--params` strings."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from meshtrain.config import (
    AUTO,
    ConfigError,
    ConsolidationConfig,
    DataConfig,
    EvaluationConfig,
    LaunchConfig,
    ParallelConfig,
    PlannerConfig,
    RunConfig,
    TrainingConfig,
    parse,
)
from meshtrain.config_parsing import Bound
from meshtrain.config_ranges import (
    DATA_RANGES,
    EVALUATION_RANGES,
    LAUNCH_RANGES,
    PLANNER_RANGES,
    TRAINING_RANGES,
)

SRC = Path(__file__).resolve().parents[1] / "src" / "meshtrain"


def test_defaults_when_nothing_is_given() -> None:
    run = RunConfig.from_params()
    assert run.parallel == ParallelConfig()
    assert run.training == TrainingConfig()
    assert run.launch == LaunchConfig()
    assert run.data == DataConfig()
    assert run.parallel.data_parallel_size == AUTO
    assert run.parallel.tensor_parallel_size == 1
    assert run.parallel.zero_1 == AUTO
    assert run.parallel.context_parallel_size == 1  # off unless asked for
    assert run.training.resume_from is None
    assert run.launch.world_size == 2
    assert run.model.architecture == "auto"
    assert run.model.config == {}


def test_empty_dicts_are_the_defaults() -> None:
    assert RunConfig.from_params(parallel={}, training={}, launch={}, model={}, data={}) == (
        RunConfig.from_params()
    )


def test_world_size_is_nproc_times_nnodes() -> None:
    run = RunConfig.from_params(launch={"nproc_per_node": 4, "nnodes": 3})
    assert run.launch.world_size == 12


def test_unknown_key_names_the_dotted_parameter_and_suggests_the_close_match() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_params(parallel={"tensor_paralel_size": 2})
    message = str(info.value)
    assert "`parallel.tensor_paralel_size` is not a meshtrain parameter" in message
    assert "did you mean `parallel.tensor_parallel_size`?" in message


def test_unknown_key_without_close_match_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_params(training={"zzzzzz": 1})
    message = str(info.value)
    assert "`training.zzzzzz`" in message
    assert "did you mean" not in message
    assert "max_steps" in message and "learning_rate" in message


def test_unknown_key_in_a_later_group_is_refused_too() -> None:
    with pytest.raises(ConfigError, match=r"`data\.blok_size`.*`data\.block_size`"):
        RunConfig.from_params(data={"blok_size": 64})


@pytest.mark.parametrize(
    ("group", "key", "value"),
    [
        ("training", "max_steps", "many"),
        ("training", "max_steps", 2.5),
        ("training", "max_steps", True),
        ("training", "learning_rate", "fast"),
        ("training", "learning_rate", False),
        ("training", "mixed_precision", "fp16"),
        ("parallel", "zero_1", "maybe"),
        ("parallel", "zero_1", 1),
        ("parallel", "tensor_parallel_size", "two"),
        ("parallel", "activation_checkpointing", "some"),
        ("launch", "backend", "mpi"),
        ("model", "config", "hidden_size=64"),
        ("data", "text_files", [1, 2]),
        ("data", "source", None),
    ],
)
def test_wrong_kind_is_refused_with_the_dotted_name(group: str, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"`{group}\.{key}` got"):
        RunConfig.from_params(**{group: {key: value}})


def test_wrong_kind_message_says_what_was_expected() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_params(parallel={"sequence_parallel": "yes"})
    message = str(info.value)
    assert "'yes'" in message
    assert "bool" in message and "'auto'" in message


@pytest.mark.parametrize(
    ("group", "key", "text", "expected"),
    [
        ("parallel", "data_parallel_size", "2", 2),
        ("parallel", "data_parallel_size", "auto", AUTO),
        ("parallel", "data_parallel_size", "AUTO", AUTO),
        ("parallel", "tensor_parallel_size", "auto", AUTO),
        ("parallel", "context_parallel_size", "4", 4),
        ("parallel", "context_parallel_size", "auto", AUTO),
        ("parallel", "zero_1", "true", True),
        ("parallel", "zero_1", "False", False),
        ("parallel", "zero_1", "auto", AUTO),
        ("parallel", "activation_offloading", "true", True),
        ("parallel", "pipeline_schedule", "GPipe", "gpipe"),
        ("training", "max_steps", "50", 50),
        ("training", "seed", "-3", -3),
        ("training", "learning_rate", "1e-3", 1e-3),
        ("training", "learning_rate", 2, 2.0),
        ("training", "mixed_precision", "bf16", "bf16"),
        ("launch", "nproc_per_node", "4", 4),
        ("launch", "backend", "NCCL", "nccl"),
        ("data", "num_proc", "null", None),
        ("data", "num_proc", "none", None),
        ("data", "builtin_max_chars", "None", None),
        ("data", "builtin_max_chars", "1000", 1000),
        ("data", "text_files", "a.txt", ["a.txt"]),
        ("data", "text_files", ("a.txt", "b.txt"), ["a.txt", "b.txt"]),
        ("data", "tokenizer", None, None),
    ],
)
def test_params_strings_are_converted(group: str, key: str, text: object, expected: object) -> None:
    value = getattr(getattr(RunConfig.from_params(**{group: {key: text}}), group), key)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize("text", ["null", "None"])
@pytest.mark.parametrize(
    ("group", "key"), [("training", "resume_from"), ("data", "tokenizer"), ("data", "text_files")]
)
def test_null_string_is_none_for_optional_strings(group: str, key: str, text: str) -> None:
    assert getattr(getattr(RunConfig.from_params(**{group: {key: text}}), group), key) is None


@pytest.mark.parametrize(
    ("group", "key"),
    [
        ("parallel", "data_parallel_size"),
        ("parallel", "tensor_parallel_size"),
        ("parallel", "pipeline_parallel_size"),
        ("parallel", "pipeline_parallel_num_microbatches"),
        ("parallel", "context_parallel_size"),
        ("training", "per_device_train_batch_size"),
        ("training", "gradient_accumulation_steps"),
        ("training", "max_steps"),
        ("launch", "nproc_per_node"),
        ("launch", "nnodes"),
        ("data", "block_size"),
        ("data", "vocab_size"),
    ],
)
@pytest.mark.parametrize("value", [0, -1, "0"])
def test_sizes_below_one_are_refused(group: str, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"`{group}\.{key}` must be at least 1"):
        RunConfig.from_params(**{group: {key: value}})


def test_one_is_a_valid_size_and_other_ints_may_be_zero_or_negative() -> None:
    run = RunConfig.from_params(
        parallel={"data_parallel_size": 1}, training={"seed": -5, "keep_last": 0}
    )
    assert run.parallel.data_parallel_size == 1
    assert run.training.seed == -5
    assert run.training.keep_last == 0


def test_malformed_number_string_is_refused_with_the_dotted_name() -> None:
    with pytest.raises(ConfigError, match=r"`training\.seed`"):
        RunConfig.from_params(training={"seed": "--3"})


def test_parse_builds_a_single_group() -> None:
    parallel = parse(ParallelConfig, {"zero_1": "false", "data_parallel_size": "4"}, "parallel")
    assert parallel == ParallelConfig(zero_1=False, data_parallel_size=4)
    assert parse(ParallelConfig, None, "parallel") == ParallelConfig()


def test_parse_uses_the_given_group_name_in_errors() -> None:
    with pytest.raises(ConfigError, match=r"`custom\.max_steps` got"):
        parse(TrainingConfig, {"max_steps": "x"}, "custom")


@pytest.mark.parametrize(
    ("cls", "group", "typo", "meant"),
    [
        (ConsolidationConfig, "consolidation", "max_shard_sise", "max_shard_size"),
        (EvaluationConfig, "evaluation", "max_new_token", "max_new_tokens"),
    ],
)
def test_consolidation_and_evaluation_typos_are_refused(cls, group, typo, meant) -> None:
    with pytest.raises(ConfigError, match=rf"`{group}\.{typo}`.*did you mean `{group}\.{meant}`"):
        parse(cls, {typo: "1"}, group)


def test_evaluation_sizes_below_one_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"`evaluation\.batch_size` must be at least 1"):
        parse(EvaluationConfig, {"batch_size": 0}, "evaluation")


def test_the_shipped_consolidation_and_evaluation_parameters_parse() -> None:
    """conf/base's values are the dataclasses' defaults: one meaning, written twice only
    because Kedro users read their parameters in conf/."""
    conf = Path(__file__).resolve().parents[1] / "conf" / "base"
    for cls, group in ((ConsolidationConfig, "consolidation"), (EvaluationConfig, "evaluation")):
        values = yaml.safe_load((conf / f"parameters_{group}.yml").read_text())[group]
        assert parse(cls, values, group) == cls()


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"learning_rate": -1}, "training.learning_rate"),
        ({"max_grad_norm": -1}, "training.max_grad_norm"),
        ({"run_name": "../../../escaped"}, "training.run_name"),
        ({"run_name": "runs/a"}, "training.run_name"),
        ({"run_name": ".."}, "training.run_name"),
        ({"dpo": {"beta": 0}}, "training.dpo.beta"),
        ({"dpo": {"label_smoothing": 0.5, "loss_type": "robust"}}, "training.dpo.label_smoothing"),
        ({"dpo": {"label_smoothing": 0.1}}, "training.dpo.label_smoothing"),
    ],
)
def test_training_values_that_mean_nothing_are_refused(values: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=rf"`{named}` is"):
        RunConfig.from_params(training=values)


def test_zero_learning_rate_and_no_clipping_are_meaningful() -> None:
    run = RunConfig.from_params(training={"learning_rate": 0, "max_grad_norm": 0})
    assert (run.training.learning_rate, run.training.max_grad_norm) == (0.0, 0.0)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_groups_are_frozen() -> None:
    run = RunConfig.from_params()
    with pytest.raises(AttributeError):
        run.training.max_steps = 3  # type: ignore[misc]


def test_to_dict_from_dict_round_trip_through_json() -> None:
    run = RunConfig.from_params(
        parallel={"data_parallel_size": "2", "zero_1": "false", "activation_checkpointing": "full"},
        training={"max_steps": 7, "learning_rate": "1e-4", "resume_from": "runs/x"},
        launch={"nproc_per_node": 2, "backend": "gloo"},
        model={"architecture": "qwen2", "config": {"hidden_size": 64, "num_hidden_layers": 2}},
        data={"source": "text_files", "text_files": ["a.txt", "b.txt"], "num_proc": None},
    )
    values = run.to_dict()
    assert set(values) == {"parallel", "training", "launch", "model", "data", "planner"}
    assert values["parallel"]["data_parallel_size"] == 2
    assert values["model"]["config"] == {"hidden_size": 64, "num_hidden_layers": 2}
    assert RunConfig.from_dict(values) == run
    assert RunConfig.from_dict(json.loads(json.dumps(values))) == run


def test_from_dict_refuses_unknown_keys_too() -> None:
    values = RunConfig.from_params().to_dict()
    values["launch"]["nproc_per_nod"] = 2
    with pytest.raises(ConfigError, match=r"`launch\.nproc_per_nod`.*`launch\.nproc_per_node`"):
        RunConfig.from_dict(values)


@pytest.mark.parametrize(
    ("cls", "rows"),
    [
        (TrainingConfig, TRAINING_RANGES),
        (DataConfig, DATA_RANGES),
        (EvaluationConfig, EVALUATION_RANGES),
        (LaunchConfig, LAUNCH_RANGES),
        (PlannerConfig, PLANNER_RANGES),
    ],
)
def test_every_range_row_names_a_field_and_its_refusal_names_it(cls: type, rows) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, bound, message in rows:
        assert name in fields, name
        assert f".{name}" in message, message
        default = fields[name].default
        assert default is None or default == "auto" or bound.holds(default), name


def test_a_bound_refuses_nan_and_keeps_its_open_ends() -> None:
    fraction = Bound(low=0, high=1, high_open=True)
    assert fraction.holds(0) and fraction.holds(0.5)
    assert not fraction.holds(1) and not fraction.holds(float("nan"))
    assert Bound(low=0, low_open=True).holds(1e-9) and not Bound(low=0, low_open=True).holds(0)


def test_config_imports_nothing_from_the_layers_above_it() -> None:
    """config (and its parsing and ranges) sit below data, models and the rest: they import
    only from each other, so no import runs back up."""
    own = {
        "meshtrain.config",
        "meshtrain.config_parsing",
        "meshtrain.config_ranges",
        "meshtrain.config_dpo",
        "meshtrain.config_lora",
        "meshtrain.config_data",
        "meshtrain.config_launch",
        # A leaf below them all: the schedules' names and rules import no meshtrain module.
        "meshtrain.pipeline_schedules",
    }
    for name in own:
        tree = ast.parse((SRC / f"{name.split('.')[1]}.py").read_text())
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            for module in modules:
                if module.startswith("meshtrain"):
                    assert module in own, f"{name} imports {module}"
