"""The planner: `auto` resolution, refusals with working fixes, memory estimate, plan.json."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import pytest
from transformers import PretrainedConfig

from meshtrain.config import Layout, RunConfig
from meshtrain.models import build_model, build_model_config
from meshtrain.planner import LayoutError, Plan, Refusal, plan_run, search
from meshtrain.planner.axes.data import estimate_model_states
from meshtrain.planner.devices import GIB
from meshtrain.planner.plan_inputs import check_plan_matches, plan_inputs_hash
from meshtrain.planner.resolve import plan_for_run

SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
VOCAB = 4096
TRAIN_BLOCKS = 1000
VALIDATION_BLOCKS = 50


@pytest.fixture(scope="module")
def model_config() -> PretrainedConfig:
    return build_model_config("llama", dict(SHAPE), vocab_size=VOCAB)


def _plan(
    model_config: PretrainedConfig,
    *,
    num_train_blocks: int = TRAIN_BLOCKS,
    num_validation_blocks: int = VALIDATION_BLOCKS,
    tokenizer_size: int | None = None,
    cuda_available: bool = False,
    **groups: dict[str, Any],
) -> Plan:
    return plan_run(
        RunConfig.from_params(**groups),
        model_config,
        num_train_blocks=num_train_blocks,
        num_validation_blocks=num_validation_blocks,
        tokenizer_size=tokenizer_size,
        cuda_available=cuda_available,
    )


def _refusals(model_config: PretrainedConfig, **kwargs: Any) -> LayoutError:
    with pytest.raises(LayoutError) as info:
        _plan(model_config, **kwargs)
    assert info.value.refusals, "a LayoutError must carry at least one refusal"
    assert all(isinstance(r, Refusal) for r in info.value.refusals)
    return info.value


def _refusal(error: LayoutError, parameter: str) -> Refusal:
    matching = [r for r in error.refusals if r.parameter == parameter]
    assert len(matching) == 1, f"expected one refusal of {parameter}, got {error.refusals}"
    return matching[0]


# --- auto resolution ------------------------------------------------------------------------


def test_auto_data_parallel_fills_the_world(model_config: PretrainedConfig) -> None:
    plan = _plan(model_config, launch={"nproc_per_node": 2})
    layout = plan.layout
    assert layout.data_parallel_size == 2
    assert layout.tensor_parallel_size == 1
    assert layout.pipeline_parallel_size == 1
    assert layout.zero_1 is False  # `auto`: the optimizer states fit without it
    assert layout.sequence_parallel is False
    assert layout.name == "dp2-tp1-pp1"
    assert plan.world_size == 2
    assert plan.backend == "gloo"
    assert plan.global_batch_size == 8 * 1 * 2
    assert plan.tokens_per_step == 16 * 128
    assert plan.num_train_blocks == TRAIN_BLOCKS
    assert plan.num_validation_blocks == VALIDATION_BLOCKS
    assert plan.notes == ["parallel.zero_1=auto: off, dp2-tp1-pp1 fits without it"]


def test_single_process_has_no_zero_1(model_config: PretrainedConfig) -> None:
    plan = _plan(model_config, launch={"nproc_per_node": 1})
    assert plan.layout.data_parallel_size == 1
    assert plan.layout.zero_1 is False
    assert plan.layout.name == "dp1-tp1-pp1"
    assert plan.global_batch_size == 8


def test_auto_data_parallel_spans_nodes(model_config: PretrainedConfig) -> None:
    plan = _plan(
        model_config,
        launch={"nproc_per_node": 4, "nnodes": 2},
        training={"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3},
    )
    assert plan.world_size == 8
    assert plan.layout.data_parallel_size == 8
    assert plan.global_batch_size == 2 * 3 * 8


def test_explicit_zero_1_off(model_config: PretrainedConfig) -> None:
    plan = _plan(model_config, parallel={"zero_1": False})
    assert plan.layout.zero_1 is False
    assert plan.layout.name == "dp2-tp1-pp1"


def test_zero_1_on_at_one_rank_is_turned_off_with_a_note(model_config: PretrainedConfig) -> None:
    plan = _plan(model_config, parallel={"zero_1": True}, launch={"nproc_per_node": 1})
    assert plan.layout.zero_1 is False
    assert any("zero_1" in note for note in plan.notes)


def test_explicit_sizes_that_fit_are_kept(model_config: PretrainedConfig) -> None:
    plan = _plan(
        model_config,
        parallel={
            "data_parallel_size": 2,
            "tensor_parallel_size": "auto",
            "pipeline_parallel_size": "auto",
            "sequence_parallel": False,
            "activation_checkpointing": "full",
        },
    )
    assert plan.layout.data_parallel_size == 2
    assert plan.layout.tensor_parallel_size == 1
    assert plan.layout.pipeline_parallel_size == 1
    assert plan.layout.name == "dp2-tp1-pp1-ac-full"


def test_microbatches_without_pipeline_resolve_to_one_with_a_note(
    model_config: PretrainedConfig,
) -> None:
    plan = _plan(model_config, parallel={"pipeline_parallel_num_microbatches": 4})
    assert plan.layout.pipeline_parallel_num_microbatches == 1
    assert any("pipeline_parallel_num_microbatches=4" in note for note in plan.notes)


def test_too_few_validation_blocks_is_a_note(model_config: PretrainedConfig) -> None:
    plan = _plan(model_config, num_validation_blocks=1)
    assert any("validation blocks" in note for note in plan.notes)


def test_layout_name_lists_the_options() -> None:
    layout = Layout(
        data_parallel_size=2,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        pipeline_parallel_num_microbatches=4,
        pipeline_schedule="gpipe",
        sequence_parallel=True,
        zero_1=True,
        activation_checkpointing="full",
        activation_offloading=False,
    )
    assert layout.name == "dp2-tp2-pp2-zero1-sp-gpipe-mb4-ac-full"


# --- refusals -------------------------------------------------------------------------------

# (overrides, refused parameter, text the fix must offer, overrides with that fix applied)
REFUSALS = [
    pytest.param(
        {"parallel": {"tensor_parallel_size": 3}},
        "parallel.tensor_parallel_size",
        "1",
        {"parallel": {"tensor_parallel_size": 1}},
        id="tp-does-not-divide-heads",
    ),
    pytest.param(
        {"parallel": {"tensor_parallel_size": 2}, "data": {"block_size": 15}},
        "data.block_size",
        "14",
        {"parallel": {"tensor_parallel_size": 2}, "data": {"block_size": 14}},
        id="sequence-parallel-block-not-divisible",
    ),
    pytest.param(
        {"parallel": {"pipeline_parallel_size": 8}},
        "parallel.pipeline_parallel_size",
        "1",
        {"parallel": {"pipeline_parallel_size": 1}},
        id="pp-more-than-layers",
    ),
    pytest.param(
        {"parallel": {"pipeline_parallel_size": 2, "pipeline_parallel_num_microbatches": 1}},
        "parallel.pipeline_parallel_num_microbatches",
        "2",
        {"parallel": {"pipeline_parallel_size": 2, "pipeline_parallel_num_microbatches": 2}},
        id="1f1b-fewer-microbatches-than-stages",
    ),
    pytest.param(
        {"parallel": {"data_parallel_size": 4}},
        "parallel.data_parallel_size",
        "data_parallel_size=2",
        {"parallel": {"data_parallel_size": 2}},
        id="dp-too-large",
    ),
    pytest.param(
        {"parallel": {"data_parallel_size": 1}},
        "parallel.data_parallel_size",
        "data_parallel_size=2",
        {"parallel": {"data_parallel_size": 2}},
        id="dp-too-small",
    ),
    pytest.param(
        {"parallel": {"sequence_parallel": True}},
        "parallel.sequence_parallel",
        "sequence_parallel=auto",
        {"parallel": {"sequence_parallel": "auto"}},
        id="sp-without-tp",
    ),
    pytest.param(
        {"data": {"block_size": 1024}},
        "data.block_size",
        "data.block_size<=512",
        {"data": {"block_size": 512}},
        id="block-longer-than-positions",
    ),
    pytest.param(
        {"launch": {"backend": "nccl"}},
        "launch.backend",
        "launch.backend=gloo",
        {"launch": {"backend": "gloo"}},
        id="nccl-without-cuda",
    ),
]


@pytest.mark.parametrize(("overrides", "parameter", "offered", "fixed"), REFUSALS)
def test_refusal_names_the_parameter_and_a_fix_that_works(
    model_config: PretrainedConfig,
    overrides: dict[str, dict[str, Any]],
    parameter: str,
    offered: str,
    fixed: dict[str, dict[str, Any]],
) -> None:
    error = _refusals(model_config, **overrides)
    refusal = _refusal(error, parameter)
    short_name = parameter.split(".")[1]
    assert short_name in str(error)
    assert f"{parameter}=" in str(error)
    assert refusal.reason
    assert offered in refusal.fix
    assert str(refusal) in str(error)
    # The offered value really plans.
    _plan(model_config, **fixed)


def test_tp_not_dividing_heads_explains_why(model_config: PretrainedConfig) -> None:
    error = _refusals(model_config, parallel={"tensor_parallel_size": 3})
    refusal = _refusal(error, "parallel.tensor_parallel_size")
    assert refusal.value == 3
    assert "num_attention_heads=4" in refusal.reason
    assert "num_key_value_heads=2" in refusal.reason
    assert "world size 2" in refusal.reason
    assert refusal.fix == "Values that work here: 1, 2."


def test_tp_two_plans_with_sequence_parallel_and_shards_the_model_states(
    model_config: PretrainedConfig,
) -> None:
    plan = _plan(model_config, parallel={"tensor_parallel_size": 2})
    assert plan.layout.name == "dp1-tp2-pp1-sp"
    single = _plan(model_config, launch={"nproc_per_node": 1})
    # Everything but the norms is split in two.
    assert (
        plan.memory_estimate_per_rank["parameters"]
        < 0.51 * (single.memory_estimate_per_rank["parameters"])
    )


def test_tp_more_than_kv_heads_plans_with_replicated_kv(model_config: PretrainedConfig) -> None:
    plan = _plan(model_config, parallel={"tensor_parallel_size": 4}, launch={"nproc_per_node": 4})
    assert plan.layout.tensor_parallel_size == 4  # 2 KV heads, each held by 2 ranks


def test_tp_that_would_split_a_kv_head_is_refused() -> None:
    config = build_model_config(
        "llama",
        {
            "hidden_size": 96,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
        },
        vocab_size=VOCAB,
    )
    error = _refusals(config, parallel={"tensor_parallel_size": 2})
    refusal = _refusal(error, "parallel.tensor_parallel_size")
    assert "num_key_value_heads=3" in refusal.reason
    assert refusal.fix == "Values that work here: 1."


def test_pp_above_layers_says_how_many_layers(model_config: PretrainedConfig) -> None:
    error = _refusals(
        model_config, parallel={"pipeline_parallel_size": 8}, launch={"nproc_per_node": 8}
    )
    refusal = _refusal(error, "parallel.pipeline_parallel_size")
    assert refusal.value == 8
    assert "num_hidden_layers=4" in refusal.reason
    assert refusal.fix == "Values that work here: 1, 2, 4."


def test_dp_mismatch_reports_the_product(model_config: PretrainedConfig) -> None:
    error = _refusals(model_config, parallel={"data_parallel_size": 4})
    refusal = _refusal(error, "parallel.data_parallel_size")
    assert refusal.value == 4
    assert "4 x 1 x 1 = 4" in refusal.reason
    assert "world size 2" in refusal.reason


@pytest.mark.parametrize(
    ("per_device", "accumulation", "nproc", "blocks"),
    [(16, 1, 2, 20), (8, 3, 2, 20), (100, 1, 1, 37), (9, 2, 4, 70)],
)
def test_batch_larger_than_the_data_offers_the_largest_batch_that_plans(
    model_config: PretrainedConfig, per_device: int, accumulation: int, nproc: int, blocks: int
) -> None:
    training = {
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
    }
    error = _refusals(
        model_config, training=training, launch={"nproc_per_node": nproc}, num_train_blocks=blocks
    )
    refusal = _refusal(error, "training.per_device_train_batch_size")
    assert refusal.value == per_device
    assert f"the {blocks} training blocks" in refusal.reason
    match = re.search(r"per_device_train_batch_size<=(\d+)", refusal.fix)
    assert match, refusal.fix
    offered = int(match.group(1))
    assert 1 <= offered < per_device

    plan = _plan(
        model_config,
        training={**training, "per_device_train_batch_size": offered},
        launch={"nproc_per_node": nproc},
        num_train_blocks=blocks,
    )
    assert plan.global_batch_size <= blocks
    # ... and it is the largest such value.
    with pytest.raises(LayoutError):
        _plan(
            model_config,
            training={**training, "per_device_train_batch_size": offered + 1},
            launch={"nproc_per_node": nproc},
            num_train_blocks=blocks,
        )


def test_batch_fix_works_when_blocks_are_fewer_than_accumulation_times_dp(
    model_config: PretrainedConfig,
) -> None:
    training = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}
    error = _refusals(model_config, training=training, num_train_blocks=3)
    fix = _refusal(error, "training.per_device_train_batch_size").fix
    offered = int(re.search(r"gradient_accumulation_steps<=(\d+)", fix).group(1))
    _plan(
        model_config,
        training={"per_device_train_batch_size": 1, "gradient_accumulation_steps": offered},
        num_train_blocks=3,
    )


def test_fewer_blocks_than_ranks_says_so(model_config: PretrainedConfig) -> None:
    error = _refusals(model_config, num_train_blocks=1)
    assert (
        "fewer training blocks than" in _refusal(error, "training.per_device_train_batch_size").fix
    )


def test_global_batch_equal_to_the_blocks_is_accepted(model_config: PretrainedConfig) -> None:
    plan = _plan(model_config, num_train_blocks=16)
    assert plan.global_batch_size == 16


def test_block_size_equal_to_positions_is_accepted(model_config: PretrainedConfig) -> None:
    error = _refusals(model_config, data={"block_size": 513})
    assert _refusal(error, "data.block_size").value == 513
    assert _plan(model_config, data={"block_size": 512}).tokens_per_step == 16 * 512


def test_tokenizer_larger_than_the_vocab_is_refused(model_config: PretrainedConfig) -> None:
    error = _refusals(model_config, tokenizer_size=VOCAB + 1, data={"tokenizer": "my/tok"})
    refusal = _refusal(error, "data.tokenizer")
    assert refusal.value == "my/tok"
    assert "data.tokenizer" in str(error)
    assert f"{VOCAB + 1} tokens" in refusal.reason
    assert f"vocab_size is {VOCAB}" in refusal.reason
    assert refusal.fix
    _plan(model_config, tokenizer_size=VOCAB, data={"tokenizer": "my/tok"})
    _plan(model_config, tokenizer_size=VOCAB - 100)


def test_auto_backend_follows_cuda(
    model_config: PretrainedConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(search, "accelerator_count", lambda: 2)
    assert _plan(model_config, cuda_available=False).backend == "gloo"
    assert _plan(model_config, cuda_available=True).backend == "nccl"
    assert _plan(model_config, cuda_available=True, launch={"backend": "gloo"}).backend == "gloo"


def test_more_processes_than_gpus_is_refused(
    model_config: PretrainedConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(search, "accelerator_count", lambda: 1)
    error = _refusals(model_config, cuda_available=True, launch={"nproc_per_node": 2})
    refusal = _refusal(error, "launch.nproc_per_node")
    assert refusal.value == 2
    assert "launch.nproc_per_node<=1" in refusal.fix
    plan = _plan(model_config, cuda_available=True, launch={"nproc_per_node": 1})
    assert plan.backend == "nccl"


def test_every_problem_is_reported_at_once(model_config: PretrainedConfig) -> None:
    error = _refusals(
        model_config,
        parallel={"tensor_parallel_size": 3},
        training={"per_device_train_batch_size": 2000},
        launch={"backend": "nccl"},
        data={"block_size": 1024, "tokenizer": "big"},
        tokenizer_size=VOCAB * 2,
    )
    parameters = {r.parameter for r in error.refusals}
    expected = {
        "parallel.tensor_parallel_size",
        "parallel.data_parallel_size",  # auto cannot fill world 2 with tp 3
        "training.per_device_train_batch_size",
        "launch.backend",
        "data.block_size",
        "data.tokenizer",
    }
    assert expected <= parameters
    message = str(error)
    for parameter in expected:
        assert f"{parameter}=" in message
    assert message.count("\n  - ") == len(error.refusals)


def test_layout_error_is_a_value_error() -> None:
    refusal = Refusal("parallel.x", 3, "it is wrong", "Use x=1.")
    error = LayoutError([refusal])
    assert isinstance(error, ValueError)
    assert error.refusals == [refusal]
    assert str(refusal) == "parallel.x=3: it is wrong. Use x=1."
    assert "parallel.x=3: it is wrong. Use x=1." in str(error)


# --- memory estimate ------------------------------------------------------------------------


def test_num_parameters_is_the_real_parameter_count(model_config: PretrainedConfig) -> None:
    model = build_model(model_config, seed=0)
    real = sum(p.numel() for p in model.parameters())
    plan = _plan(model_config)
    assert plan.num_parameters == real
    memory = plan.memory_estimate_per_rank
    assert memory["parameters"] == 4 * real
    assert memory["gradients"] == 4 * real
    parts = ("parameters", "gradients", "optimizer_states")
    assert memory["total"] == sum(memory[p] for p in (*parts, "activations", "loss"))


def test_zero_1_shards_the_optimizer_states(model_config: PretrainedConfig) -> None:
    sharded = _plan(model_config, parallel={"zero_1": True})
    full = _plan(model_config)
    n = sharded.num_parameters
    assert sharded.layout.zero_1 and not full.layout.zero_1
    assert sharded.memory_estimate_per_rank["optimizer_states"] == 2 * 4 * math.ceil(n / 2)
    assert full.memory_estimate_per_rank["optimizer_states"] == 2 * 4 * n
    assert (
        sharded.memory_estimate_per_rank["parameters"]
        == full.memory_estimate_per_rank["parameters"]
    )
    assert (
        sharded.memory_estimate_per_rank["gradients"] == full.memory_estimate_per_rank["gradients"]
    )


def test_zero_1_over_four_ranks(model_config: PretrainedConfig) -> None:
    plan = _plan(model_config, launch={"nproc_per_node": 4}, parallel={"zero_1": True})
    n = plan.num_parameters
    assert plan.memory_estimate_per_rank["optimizer_states"] == 8 * math.ceil(n / 4)


def test_zero_1_auto_turns_on_only_when_the_layout_needs_it_to_fit(
    model_config: PretrainedConfig,
) -> None:
    launch = {"nproc_per_node": 4}
    plain = _plan(model_config, launch=launch, parallel={"zero_1": False})
    zero_1 = _plan(model_config, launch=launch, parallel={"zero_1": True})
    need_plain = plain.memory_estimate_per_rank["process_total"]
    need_zero_1 = zero_1.memory_estimate_per_rank["process_total"]
    assert need_zero_1 < need_plain
    roomy = _plan(model_config, launch=launch)
    assert not roomy.layout.zero_1 and roomy.layout.name == "dp4-tp1-pp1"
    budget = (need_plain + need_zero_1) / 2  # only ZeRO-1 fits
    tight = {"cpu": {"memory_gib": budget / 0.9 / GIB}}
    plan = _plan(model_config, launch=launch, planner={"device": "cpu", "device_profiles": tight})
    assert plan.layout.zero_1 and plan.layout.name == "dp4-tp1-pp1-zero1"
    assert plan.memory_estimate_per_rank == zero_1.memory_estimate_per_rank
    note = next(n for n in plan.notes if n.startswith("parallel.zero_1=auto: on"))
    assert "without it dp4-tp1-pp1 needs" in note and "over the" in note


def test_memory_estimate_pads_the_zero_1_shard() -> None:
    estimate = estimate_model_states({"model.norm.weight": (7,)}, dp=2, tp=1, pp=1, zero_1=True)
    assert estimate.parameters == 28
    assert estimate.gradients == 28
    assert estimate.optimizer_states == 4 * 2 * 4
    assert estimate.total == 28 + 28 + 32
    assert estimate.to_dict() | {"total_per_pipeline_rank": []} == {
        "parameters": 28,
        "gradients": 28,
        "optimizer_states": 32,
        "activations": 0,
        "loss": 0,
        "total": 88,
        "runtime": 0,
        "process_total": 88,
        "peak_pipeline_rank": 0,
        "total_per_pipeline_rank": [],
    }
    # What the process holds besides: its runtime.
    assert dataclasses.replace(estimate, runtime=100).process_total == 100 + 88
    norm = {"model.norm.weight": (7,)}
    assert estimate_model_states(norm, dp=2, tp=1, pp=1, zero_1=False).optimizer_states == 56
    # A sharded matrix halves over tp; a replicated norm does not.
    shapes = {"model.layers.0.mlp.up_proj.weight": (10, 2), "model.norm.weight": (4,)}
    assert estimate_model_states(shapes, dp=1, tp=2, pp=1, zero_1=False).parameters == 14 * 4
    # Replicated KV heads: 2 copies of a (4, 2) projection over 4 ranks = 4 elements each.
    kv = {"model.layers.0.self_attn.k_proj.weight": (4, 2)}
    assert (
        estimate_model_states(kv, dp=1, tp=4, pp=1, zero_1=False, kv_replication=2).parameters == 16
    )


def test_bf16_master_counts_2_plus_4_plus_12_over_dp_bytes(model_config: PretrainedConfig) -> None:
    """bf16 parameters, fp32 gradients, and the fp32 master with both moments under ZeRO-1;
    with bf16 gradient reduction the optimizer keeps an fp32 copy of its gradient range."""
    launch = {"nproc_per_node": 4}
    fp32 = _plan(model_config, launch=launch).memory_estimate_per_rank
    zero_1 = {"zero_1": True}
    plan = _plan(
        model_config, launch=launch, parallel=zero_1, training={"mixed_precision": "bf16_master"}
    )
    n, memory = plan.num_parameters, plan.memory_estimate_per_rank
    padded = 4 * math.ceil(n / 4)
    assert plan.layout.zero_1
    assert memory["parameters"] == 2 * padded
    assert memory["gradients"] == 4 * padded
    assert memory["optimizer_states"] == 12 * padded // 4
    # The activations are bf16: less than the fp32 run's.
    assert memory["activations"] < fp32["activations"]
    bf16_reduce = _plan(
        model_config,
        launch=launch,
        parallel=zero_1,
        training={"mixed_precision": "bf16_master", "grad_reduce_dtype": "bf16"},
    ).memory_estimate_per_rank
    assert bf16_reduce["gradients"] == 2 * padded
    assert bf16_reduce["optimizer_states"] == 16 * padded // 4


# --- plan.json ------------------------------------------------------------------------------


def _json_round_trip(plan: Plan) -> Plan:
    return Plan.from_dict(json.loads(json.dumps(plan.to_dict())))


def test_plan_round_trips_through_json(model_config: PretrainedConfig) -> None:
    plan = _plan(model_config, parallel={"pipeline_parallel_num_microbatches": 2})
    values = plan.to_dict()
    assert values["layout_name"] == "dp2-tp1-pp1"
    assert values["layout"]["data_parallel_size"] == 2
    loaded = _json_round_trip(plan)
    assert isinstance(loaded.layout, Layout)
    assert loaded.layout == plan.layout
    assert loaded.layout.name == plan.layout.name
    assert loaded.notes == plan.notes
    for field in dataclasses.fields(Plan):
        if field.name != "model_config":  # JSON turns id2label's int keys into strings
            assert getattr(loaded, field.name) == getattr(plan, field.name), field.name
    assert loaded.model_config["hidden_size"] == 128
    assert loaded.model_config["vocab_size"] == VOCAB
    # A second round trip changes nothing.
    assert _json_round_trip(loaded) == loaded


def test_plan_from_dict_without_json_is_identical(model_config: PretrainedConfig) -> None:
    plan = _plan(model_config)
    assert Plan.from_dict(plan.to_dict()) == plan


class _Tokenizer:
    """Just the attributes plan_for_run reads."""

    def __init__(self, size: int = VOCAB) -> None:
        self.size = size
        self.bos_token_id = 1
        self.eos_token_id = 2
        self.pad_token_id = 0

    def __len__(self) -> int:
        return self.size


def _run(**overrides: dict[str, Any]) -> RunConfig:
    return RunConfig.from_params(**{"model": {"config": dict(SHAPE)}, **overrides})


def _plan_for_run(run: RunConfig, *, blocks: int = TRAIN_BLOCKS, size: int = VOCAB) -> Plan:
    return plan_for_run(
        run, _Tokenizer(size), num_train_blocks=blocks, num_validation_blocks=VALIDATION_BLOCKS
    )


def test_plan_for_run_takes_vocab_and_special_tokens_from_the_tokenizer() -> None:
    plan = _plan_for_run(_run(), size=1000)
    assert plan.model_config["vocab_size"] == 1000
    assert plan.model_config["bos_token_id"] == 1
    assert plan.model_config["eos_token_id"] == 2
    assert plan.model_config["pad_token_id"] == 0
    assert plan.model_config["hidden_size"] == 128


def _hash(run: RunConfig, *, blocks: int = TRAIN_BLOCKS, size: int = VOCAB) -> str:
    return plan_inputs_hash(
        run, _Tokenizer(size), num_train_blocks=blocks, num_validation_blocks=VALIDATION_BLOCKS
    )


def test_the_same_plan_is_current_after_json() -> None:
    run = _run()
    stored = _json_round_trip(_plan_for_run(run))
    check_plan_matches(stored, _hash(run))


@pytest.mark.parametrize(
    ("changed", "blocks"),
    [
        ({"training": {"per_device_train_batch_size": 4}}, TRAIN_BLOCKS),
        ({"parallel": {"zero_1": True}}, TRAIN_BLOCKS),
        ({"launch": {"nproc_per_node": 1}}, TRAIN_BLOCKS),
        ({"model": {"config": {**SHAPE, "hidden_size": 64}}}, TRAIN_BLOCKS),
        ({}, TRAIN_BLOCKS + 1),
    ],
)
def test_a_plan_from_other_parameters_is_stale(
    changed: dict[str, dict[str, Any]], blocks: int
) -> None:
    stored = _json_round_trip(_plan_for_run(_run()))
    with pytest.raises(ValueError, match="kedro run --pipeline planning") as info:
        check_plan_matches(stored, _hash(_run(**changed), blocks=blocks))
    assert "other parameters or data" in str(info.value)


def test_a_plan_with_another_backend_is_stale() -> None:
    stored = _json_round_trip(_plan_for_run(_run(launch={"backend": "gloo"})))
    with pytest.raises(ValueError, match="kedro run --pipeline planning"):
        check_plan_matches(stored, _hash(_run(launch={"backend": "nccl"})))


# --- pipeline parallelism -------------------------------------------------------------------


def test_pipeline_plans_balanced_stages_and_auto_microbatches(model_config) -> None:
    plan = _plan(model_config, parallel={"pipeline_parallel_size": 2})
    layout = plan.layout
    assert layout.pipeline_parallel_layers == [2, 2]
    assert layout.pipeline_parallel_num_microbatches == 4  # 2 per stage, divides batch 8
    assert layout.name == "dp1-tp1-pp2-1f1b-mb4"


def test_interleaving_splits_layers_over_virtual_stages(model_config) -> None:
    plan = _plan(
        model_config,
        parallel={"pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b"},
    )
    assert plan.layout.pipeline_parallel_layers == [1, 1, 1, 1]
    assert plan.layout.num_stages == 4
    assert plan.layout.name == "dp1-tp1-pp2-interleaved_1f1b-v2-mb4"


def test_interleaving_without_enough_layers_is_refused(model_config) -> None:
    error = _refusals(
        model_config,
        parallel={
            "pipeline_parallel_size": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "pipeline_parallel_virtual_stages": 3,
        },
    )
    refusal = _refusal(error, "parallel.pipeline_parallel_virtual_stages")
    assert "Use at most 2 virtual stages" in refusal.fix


def test_interleaving_needs_microbatches_in_rounds_of_pp(model_config) -> None:
    error = _refusals(
        model_config,
        parallel={
            "pipeline_parallel_size": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "pipeline_parallel_num_microbatches": 1,
        },
    )
    assert _refusal(error, "parallel.pipeline_parallel_num_microbatches")


def test_microbatches_must_divide_the_batch(model_config) -> None:
    error = _refusals(
        model_config,
        parallel={"pipeline_parallel_size": 2, "pipeline_parallel_num_microbatches": 3},
    )
    refusal = _refusal(error, "parallel.pipeline_parallel_num_microbatches")
    assert "1, 2, 4, 8" in refusal.fix


def test_gpipe_accepts_fewer_microbatches_than_stages(model_config) -> None:
    plan = _plan(
        model_config,
        parallel={
            "pipeline_parallel_size": 2,
            "pipeline_schedule": "gpipe",
            "pipeline_parallel_num_microbatches": 1,
        },
    )
    assert plan.layout.pipeline_parallel_num_microbatches == 1


def test_pinned_layer_split_is_checked(model_config) -> None:
    plan = _plan(
        model_config,
        parallel={"pipeline_parallel_size": 2, "pipeline_parallel_layers": [1, 3]},
    )
    assert plan.layout.pipeline_parallel_layers == [1, 3]
    error = _refusals(
        model_config,
        parallel={"pipeline_parallel_size": 2, "pipeline_parallel_layers": [1, 2]},
    )
    assert "[2, 2]" in _refusal(error, "parallel.pipeline_parallel_layers").fix


def test_tied_embeddings_with_pipeline_count_the_last_stages_copy() -> None:
    """The last stage holds a copy of the tied weight as its LM head: its parameters,
    gradients and moments are what an untied head would cost; the first stage's are not
    changed; and the copies' gradient sum is on the pipeline's time."""
    pipeline = {"launch": {"nproc_per_node": 2}, "parallel": {"pipeline_parallel_size": 2}}
    tied = _plan(
        build_model_config("llama", {**SHAPE, "tie_word_embeddings": True}, vocab_size=VOCAB),
        **pipeline,
    )
    untied = _plan(build_model_config("llama", dict(SHAPE), vocab_size=VOCAB), **pipeline)
    assert tied.layout.pipeline_parallel_size == 2
    per_rank = "total_per_pipeline_rank"
    assert tied.memory_estimate_per_rank[per_rank] == untied.memory_estimate_per_rank[per_rank]
    assert tied.num_parameters == untied.num_parameters - VOCAB * SHAPE["hidden_size"]
    assert tied.time_estimate["pipeline_s"] > untied.time_estimate["pipeline_s"]


def test_microbatch_count_from_params_strings() -> None:
    run = RunConfig.from_params(parallel={"pipeline_parallel_layers": "[1, 3]"})
    assert run.parallel.pipeline_parallel_layers == [1, 3]


MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}


@pytest.mark.parametrize(
    ("architecture", "extra"),
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {"head_dim": 32}),
        ("mistral", {}),
        # Dense layers 0 and 3, sparse 1 (every second from layer 1) ...
        ("qwen3_moe", {**MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
        ("qwen3_moe", {**MOE, "tie_word_embeddings": True}),
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ],
)
def test_shapes_from_the_config_equal_the_built_model(architecture: str, extra: dict) -> None:
    """The planner's shapes (no modelling code imported) are the real model's, name by name."""
    from meshtrain.models import parameter_shapes
    from meshtrain.models.llama.parameter_names import llama_family_shapes

    config = build_model_config(architecture, {**SHAPE, **extra}, vocab_size=VOCAB)
    assert llama_family_shapes(config) == parameter_shapes(config)


def test_overlapped_averaging_and_gather_leave_only_their_edge_buckets_exposed(
    model_config: PretrainedConfig,
) -> None:
    """The time model on a device whose collectives run beside compute (on CPU nothing
    hides: tests/planner/test_time_model.py): overlapped, a reduction shorter than the
    last backward costs one bucket's share, and so does ZeRO-1's all-gather under the
    next forward; not overlapped, each costs all of its time."""
    one_bucket, small = {"grad_bucket_mb": 1000}, {"grad_bucket_mb": 0.5}
    beside = {"device": "cpu", "device_profiles": {"cpu": {"collective_overlap": 1.0}}}

    def dp_seconds(**training: Any) -> float:
        plan = _plan(model_config, parallel={"zero_1": True}, training=training, planner=beside)
        return plan.time_estimate["data_parallel_s"]

    gather_after = {"overlap_param_gather": False}
    after = dp_seconds(overlap_grad_reduce=False, **gather_after, **small)
    gather_only = after / 2  # ZeRO-1: reduction and all-gather move the same bytes
    assert dp_seconds(overlap_grad_reduce=True, **gather_after, **one_bucket) == pytest.approx(
        after
    )
    overlapped = dp_seconds(overlap_grad_reduce=True, **gather_after, **small)
    assert gather_only < overlapped < after
    both = dp_seconds(**small)  # the defaults overlap both
    assert 0 < both < overlapped - gather_only / 2
    # Compiled layers gather after the update (hooks inside them would be traced).
    assert dp_seconds(compile=True, **small) == pytest.approx(overlapped)
