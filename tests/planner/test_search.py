"""The planner's search: every layout `auto` allows, the memory budget, the choice, and why
the others lost."""

from __future__ import annotations

import re
from typing import Any

import pytest
from transformers import PretrainedConfig

from meshtrain.config import RunConfig
from meshtrain.config_parsing import ConfigError
from meshtrain.models import build_model_config
from meshtrain.planner import LayoutError, plan_run
from meshtrain.planner.devices import device_profile
from tests.planner.test_layout import SHAPE, VOCAB

AUTO_SIZES = {"tensor_parallel_size": "auto", "pipeline_parallel_size": "auto"}


@pytest.fixture(scope="module")
def model_config() -> PretrainedConfig:
    return build_model_config("llama", dict(SHAPE), vocab_size=VOCAB)


def _plan(model_config: PretrainedConfig, **groups: dict[str, Any]):
    return plan_run(
        RunConfig.from_params(**groups),
        model_config,
        num_train_blocks=10_000,
        num_validation_blocks=50,
        cuda_available=False,
    )


def test_every_auto_layout_is_weighed_and_the_losers_say_why(model_config) -> None:
    plan = _plan(
        model_config,
        parallel={**AUTO_SIZES, "activation_checkpointing": "auto"},
        launch={"nproc_per_node": 4},
    )
    names = {c["layout"] for c in plan.candidates} | {plan.layout.name}
    # tp in {1, 2, 4} x pp in {1, 2, 4} that fill 4 ranks, each with 3 checkpointing modes.
    assert len(names) == 6 * 3
    assert all(c["lost_because"] for c in plan.candidates)
    best = plan.time_estimate["tokens_per_s"]
    assert all(c["tokens_per_s"] <= best * 1.02 for c in plan.candidates)
    # On a CPU nothing is short of memory: no recomputation is chosen.
    assert plan.layout.activation_checkpointing == "none"


def test_a_layout_over_the_device_memory_is_refused_with_the_numbers(model_config) -> None:
    tiny_device = {"cpu": {"memory_gib": 0.05}}
    with pytest.raises(LayoutError) as error:
        _plan(model_config, planner={"device": "cpu", "device_profiles": tiny_device})
    message = str(error.value)
    assert "the estimated peak is" in message and "planner.memory_margin=0.1" in message
    assert "activation_checkpointing" in message


def test_the_search_turns_to_recomputation_and_parallelism_when_memory_is_short(
    model_config,
) -> None:
    roomy = _plan(model_config, parallel={**AUTO_SIZES, "activation_checkpointing": "auto"})
    need = roomy.memory_estimate_per_rank["total"]
    # No process runtime on this imaginary device: the budget is about the step's tensors.
    tight = {"cpu": {"memory_gib": need * 0.8 / 0.9 / 2**30, "runtime_gib": 0.0}}
    plan = _plan(
        model_config,
        parallel={**AUTO_SIZES, "activation_checkpointing": "auto"},
        planner={"device": "cpu", "device_profiles": tight},
    )
    assert plan.memory_estimate_per_rank["total"] <= need * 0.8
    assert plan.layout.name != roomy.layout.name
    assert any(c["lost_because"].startswith("does not fit") for c in plan.candidates)


def test_global_batch_is_held_fixed_over_layouts(model_config) -> None:
    for tp in (1, 2):
        plan = _plan(
            model_config,
            parallel={"tensor_parallel_size": tp},
            training={"per_device_train_batch_size": 2, "global_batch_size": 16},
            launch={"nproc_per_node": 2},
        )
        dp = plan.layout.data_parallel_size
        assert plan.global_batch_size == 16
        assert plan.per_device_train_batch_size * plan.gradient_accumulation_steps * dp == 16
        assert plan.per_device_train_batch_size <= 2


def test_device_profile_overrides_are_checked() -> None:
    assert device_profile("h100", {"h100": {"tflops_bf16": 450.0}}).tflops_bf16 == 450.0
    with pytest.raises(ValueError, match="tflops_bf17 is not a profile field"):
        device_profile("h100", {"h100": {"tflops_bf17": 1.0}})
    with pytest.raises(ValueError, match="needs every field"):
        device_profile("mi300", {"mi300": {"memory_gib": 192}})


def test_a_refusal_every_candidate_shares_is_said_once(model_config) -> None:
    """Blocks longer than the model's positions refuse every checkpointing choice alike:
    the refusal is that parameter's, said once, with no layout to blame."""
    with pytest.raises(LayoutError) as info:
        _plan(
            model_config, parallel={"activation_checkpointing": "auto"}, data={"block_size": 1024}
        )
    message = str(info.value)
    assert message.count("max_position_embeddings=512") == 1, message
    assert "  - data.block_size=1024: " in message and "ac-none" not in message


@pytest.mark.parametrize(
    ("groups", "says"),
    [
        ({"training": {"objective": "dpo"}}, "needs `model.init_from`"),
        (
            {
                "training": {"objective": "dpo", "dpo": {"reference": "base"}},
                "model": {"init_from": "m"},
            },
            "`model.lora` is not set",
        ),
        (
            {"training": {"objective": "dpo", "loss_chunk_tokens": 0}, "model": {"init_from": "m"}},
            "training.loss_chunk_tokens=0",
        ),
        (
            {
                "training": {"objective": "dpo"},
                "model": {"init_from": "m"},
                "planner": {"dry_run": True},
            },
            "planner.dry_run=false",
        ),
    ],
)
def test_a_dpo_run_the_engine_cannot_train_is_refused_before_planning(model_config, groups, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        _plan(model_config, **groups)


def test_a_dpo_run_weighs_pipeline_layouts_like_any_other(model_config) -> None:
    plan = _plan(
        model_config,
        training={"objective": "dpo"},
        model={"init_from": "m"},
        parallel=AUTO_SIZES,
        launch={"nproc_per_node": 4},
    )
    names = [plan.layout.name, *(c["layout"] for c in plan.candidates)]
    assert any("-pp1" not in name for name in names), names
