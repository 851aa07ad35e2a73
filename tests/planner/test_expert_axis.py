"""Expert parallelism in the planner (issue 47): each rank's experts, their states under
ZeRO-1, the all-to-alls and dispatch buffers, the refusals, and what `auto` picks.

The expected numbers are counted from the configs by hand, not by the planner's helpers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from transformers import PretrainedConfig

from meshtrain.commands import main
from meshtrain.config import LoraSettings, RunConfig
from meshtrain.models import build_model_config
from meshtrain.models.shapes import lora_adapter_shapes, parameter_shapes
from meshtrain.planner import LayoutError, Plan, Refusal, plan_run
from meshtrain.planner.axes import local_share
from meshtrain.planner.devices import BUILTIN_PROFILES
from meshtrain.planner.options import search_space
from meshtrain.planner.parameters import ParameterShapes, stage_parameter_counts
from meshtrain.planner.shapes import FP32, ModelShape
from tests.planner.test_layout import SHAPE as LLAMA_SHAPE

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_configs"
QWEN3_30B = str(EXAMPLES / "qwen3-30b-a3b.json")

# A small Qwen3-MoE whose sizes are odd, so that every flat buffer pads: layer 0 dense,
# layer 1 sparse (every second layer), 12 experts of which 2 a token.
SHAPE = {
    "hidden_size": 63,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "num_experts": 12,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 25,
    "decoder_sparse_step": 2,
    "max_position_embeddings": 512,
}
VOCAB = 500
BLOCK = 128
EP = "parallel.expert_parallel_size"


def _config(**changes: Any) -> PretrainedConfig:
    return build_model_config("qwen3_moe", {**SHAPE, **changes}, vocab_size=VOCAB)


def _llama() -> PretrainedConfig:
    return build_model_config("llama", dict(LLAMA_SHAPE), vocab_size=VOCAB)


def _plan(config: PretrainedConfig, **groups: dict[str, Any]) -> Plan:
    groups = {"model": {"architecture": config.model_type}, "data": {"block_size": BLOCK}, **groups}
    return plan_run(
        RunConfig.from_params(**groups),
        config,
        num_train_blocks=1000,
        num_validation_blocks=50,
        cuda_available=False,
    )


def _refusal(config: PretrainedConfig, **groups: dict[str, Any]) -> Refusal:
    with pytest.raises(LayoutError) as info:
        _plan(config, **groups)
    found = [r for r in info.value.refusals if r.parameter == EP]
    assert len(found) == 1, info.value.refusals
    return found[0]


def _by_hand() -> tuple[int, int]:
    """(every other parameter, the experts) of `SHAPE`'s model, in elements."""
    h, heads, kv = SHAPE["hidden_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    head_dim = h // heads
    attention = 2 * heads * head_dim * h + 2 * kv * head_dim * h + 2 * head_dim + 2 * h
    dense_mlp = 3 * h * SHAPE["intermediate_size"]
    router = SHAPE["num_experts"] * h
    experts = SHAPE["num_experts"] * 3 * h * SHAPE["moe_intermediate_size"]
    embeddings = 2 * VOCAB * h + h  # input, untied head, final norm
    return 2 * attention + dense_mlp + router + embeddings, experts


def _padded(elements: int, ranks: int) -> int:
    return -(-elements // ranks) * ranks


@pytest.mark.parametrize("zero_1", [False, True])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_model_states_per_rank_follow_the_experts_over_ep(ep: int, zero_1: bool) -> None:
    """fp32 on 8 ranks: 4 B weight + 4 B gradient + 8 B moments an element. At ep1 one flat
    buffer; at ep > 1 the rank's E/ep experts in a buffer of their own, whose moments ZeRO-1
    splits over the 8/ep ranks holding the same experts (each buffer padded to its ranks)."""
    dense, experts = _by_hand()
    dp = 8
    plan = _plan(
        _config(),
        launch={"nproc_per_node": dp},
        parallel={"expert_parallel_size": ep, "zero_1": zero_1},
    )
    assert plan.num_parameters == dense + experts
    assert plan.layout.expert_parallel_size == ep
    if ep == 1:
        held = _padded(dense + experts, dp) if zero_1 else dense + experts
        owned, expert_held, expert_owned = (held // dp if zero_1 else held), 0, 0
    else:
        replicas, local = dp // ep, experts // ep
        expert_held = _padded(local, replicas) if zero_1 else local
        expert_owned = expert_held // replicas if zero_1 else local
        dense_held = _padded(dense, dp) if zero_1 else dense
        held = dense_held + expert_held
        owned = (dense_held // dp if zero_1 else dense) + expert_owned
    memory = plan.memory_estimate_per_rank
    assert (memory["parameters"], memory["gradients"]) == (4 * held, 4 * held)
    assert memory["optimizer_states"] == 8 * owned
    if ep == 1:
        assert "expert_parameters" not in memory
        return
    assert memory["expert_parameters"] == memory["expert_gradients"] == 4 * expert_held
    assert memory["expert_optimizer_states"] == 8 * expert_owned
    # The rules in words: weights and gradients / ep; moments / ep, and / (dp/ep) more
    # under ZeRO-1 (the padding aside).
    assert expert_held == pytest.approx(experts / ep, abs=dp)
    assert expert_owned == pytest.approx(experts / ep / (dp / ep if zero_1 else 1), abs=1)


def test_all_to_all_seconds_grow_with_ep_as_the_share_leaving_the_rank() -> None:
    """Per sparse layer and microbatch four all-to-alls of tokens x top-k x hidden (fp32),
    the busiest rank's 1.25 x, (ep-1)/ep of it over NVLink: none at ep1."""
    config = _config(num_experts=8)
    h100 = BUILTIN_PROFILES["h100"]
    planner = {"device": "h100", "device_profiles": {"h100": {"latency_us": 0.0}}}
    seconds = {}
    for ep in (1, 2, 4, 8):
        plan = _plan(
            config,
            launch={"nproc_per_node": 8},
            parallel={"expert_parallel_size": ep},
            planner=planner,
        )
        t = plan.time_estimate
        if ep == 1:
            assert "expert_parallel_s" not in t and "ep_all_to_all_s" not in t
            continue
        rows = plan.per_device_train_batch_size * BLOCK * SHAPE["num_experts_per_tok"]
        payload = rows * SHAPE["hidden_size"] * 4
        assert t["ep_all_to_all_bytes"] == payload
        one = 1.25 * payload * (ep - 1) / ep / (h100.intra_node_gbps * 1e9)
        assert t["ep_all_to_all_per_layer_s"] == pytest.approx(one, rel=1e-12)
        microbatches = plan.gradient_accumulation_steps  # one forward each, no pp
        assert t["ep_all_to_all_s"] == pytest.approx(1 * microbatches * 4 * one, rel=1e-12)
        assert t["expert_parallel_s"] > t["ep_all_to_all_s"]  # and the imbalance's compute
        seconds[ep] = t["ep_all_to_all_s"]
    for ep in (4, 8):
        share = ((ep - 1) / ep) / (1 / 2)
        assert seconds[ep] / seconds[2] == pytest.approx(share, rel=1e-12)


def test_full_checkpointing_repeats_the_forward_all_to_alls() -> None:
    parallel = {"expert_parallel_size": 2}
    kept = _plan(_config(), launch={"nproc_per_node": 2}, parallel=parallel)
    full = {**parallel, "activation_checkpointing": "full"}
    recomputed = _plan(_config(), launch={"nproc_per_node": 2}, parallel=full)
    assert kept.time_estimate["ep_all_to_alls_per_layer"] == 4
    assert recomputed.time_estimate["ep_all_to_alls_per_layer"] == 6
    assert recomputed.time_estimate["ep_all_to_all_s"] == pytest.approx(
        kept.time_estimate["ep_all_to_all_s"] * 6 / 4
    )


def test_dispatch_buffers_are_kept_per_sparse_layer_at_the_stated_imbalance() -> None:
    """The busiest rank's experts compute 0.25 x tokens x top-k rows more than the mean,
    and keep for the backward their gathered input and gate, up, activation and product
    (hidden + 4 x expert width each, fp32), for the one sparse layer: the only
    activations ep adds (no checkpointing)."""
    launch = {"nproc_per_node": 2}
    one = _plan(_config(), launch=launch)
    two = _plan(_config(), launch=launch, parallel={"expert_parallel_size": 2})
    rows = two.per_device_train_batch_size * BLOCK * SHAPE["num_experts_per_tok"]
    width = SHAPE["hidden_size"] + 4 * SHAPE["moe_intermediate_size"]
    dispatch = 0.25 * rows * width * 4  # one sparse layer
    assert two.memory_estimate_per_rank["expert_dispatch"] == dispatch
    added = (
        two.memory_estimate_per_rank["activations"] - one.memory_estimate_per_rank["activations"]
    )
    assert added == pytest.approx(dispatch, abs=1)
    assert "expert_dispatch" not in one.memory_estimate_per_rank


def test_expert_parallelism_on_a_dense_model_is_refused() -> None:
    llama = _llama()
    refusal = _refusal(
        llama,
        model={"architecture": "llama"},
        launch={"nproc_per_node": 2},
        parallel={"expert_parallel_size": 2},
    )
    assert "not a mixture of experts" in refusal.reason
    assert f"Use {EP}=1" in refusal.fix


@pytest.mark.parametrize(
    ("ep", "says"),
    [
        (8, "it must divide the 12 experts of each sparse layer"),
        (3, "taken from the 4 data-parallel ranks, so it must divide 4"),
    ],
)
def test_ep_must_divide_the_experts_and_the_data_parallel_ranks(ep: int, says: str) -> None:
    refusal = _refusal(
        _config(), launch={"nproc_per_node": 4}, parallel={"expert_parallel_size": ep}
    )
    assert str(refusal).startswith(f"{EP}={ep}: ")
    assert says in refusal.reason
    assert refusal.fix == "Values that work here: 1, 2, 4."


def test_ep_beside_hybrid_sharding_is_refused_with_what_works() -> None:
    parallel = {"expert_parallel_size": 2, "sharded_data_parallel_degree": 2}
    refusal = _refusal(_config(), launch={"nproc_per_node": 4}, parallel=parallel)
    assert "hybrid" in refusal.reason and "not built yet" in refusal.reason
    assert refusal.fix == (
        "Use sharded_data_parallel_degree=1 or 4 (full sharding), or expert_parallel_size=1."
    )


@pytest.mark.parametrize("ep", [2, 4])
def test_model_states_under_full_sharding_split_the_experts_over_their_replicas(ep: int) -> None:
    """fp32 on 8 ranks, fully sharded: every rank holds 1/8 of the dense parameters and
    1/(8/ep) of its E/ep experts, padded to the ranks sharing each (so 1/8 of the experts
    too: ep changes what a layer gathers and who exchanges, not the states)."""
    dense, experts = _by_hand()
    parallel = {"expert_parallel_size": ep, "sharded_data_parallel_degree": 8}
    plan = _plan(_config(), launch={"nproc_per_node": 8}, parallel=parallel)
    replicas = 8 // ep
    expert_shard = -(-(experts // ep) // replicas)
    shard = -(-dense // 8) + expert_shard
    memory = plan.memory_estimate_per_rank
    assert (memory["parameters"], memory["gradients"]) == (4 * shard, 4 * shard)
    assert memory["optimizer_states"] == 8 * shard
    assert memory["expert_parameters"] == 4 * expert_shard


def test_auto_weighs_ep_unsharded_and_fully_sharded_on_a_mixture_of_experts_only() -> None:
    """At `auto` each layout weighs the ep sizes dividing the experts and its dp, unsharded
    and fully sharded (hybrid sharding only at ep1); a fixed ep > 1 keeps those two; a
    dense model plans ep1."""
    auto = {"expert_parallel_size": "auto", "sharded_data_parallel_degree": "auto"}

    def weighed(config: PretrainedConfig, **parallel: Any) -> set[tuple[int, int]]:
        run = RunConfig.from_params(
            model={"architecture": config.model_type},
            launch={"nproc_per_node": 8},
            parallel=parallel,
        )
        return {
            (v.parallel.expert_parallel_size, v.parallel.sharded_data_parallel_degree)
            for v in search_space(run, config)
        }

    assert weighed(_config(), **auto) == {(1, 1), (2, 1), (4, 1), (1, 8), (2, 8), (4, 8)}
    assert weighed(_config(), **{**auto, "expert_parallel_size": 2}) == {(2, 1), (2, 8)}
    llama = _llama()
    assert weighed(llama, **auto) == {(1, 1), (1, 8)}


def _cli(capsys, *args: str) -> dict[str, Any]:
    """`plan --json` for Qwen3-30B-A3B at 4,096 tokens, global batch 256, bf16."""
    flags = ["--seq-len", "4096", "--global-batch", "256", "--bf16", "--json"]
    assert main(["plan", "--model", QWEN3_30B, *args, *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_auto_on_eight_h100_shards_the_experts_over_their_replicas(capsys) -> None:
    """Qwen3-30B-A3B at 4,096 tokens on 8 x H100: unsharded, even at ep8 every rank holds
    16 experts' fp32 weights, gradients and moments (no replica to split them over),
    over the 72 GiB budget with the step's tensors. Fully sharded, ep still pays: each
    layer gathers E/ep experts, not all of them."""
    plan = _cli(capsys, "--devices", "8", "--device", "h100")
    layout = plan["layout"]
    ep = layout["expert_parallel_size"]
    assert ep > 1 and layout["sharded_data_parallel_degree"] == 8
    note = next(n for n in plan["notes"] if n.startswith(f"expert parallelism: ep{ep}"))
    # (The fastest layout with the experts replicated pipelines them: pp8.)
    assert "(ep1)" in note and "x slower" in note


@pytest.mark.parametrize(("devices", "device"), [("16", "h100"), ("16", "h200")])
def test_auto_picks_ep_for_qwen3_30b_where_memory_needs_it(
    capsys, devices: str, device: str
) -> None:
    """With room for the experts (16 GPUs: two replicas to split their moments over) a
    layout with expert parallelism fits and is faster than sharding. (On 8 H200s the
    unsharded ep layouts miss by a few GiB: selective recomputation keeps each sparse
    layer's exchanged rows.)"""
    plan = _cli(capsys, "--devices", devices, "--device", device)
    layout = plan["layout"]
    ep = layout["expert_parallel_size"]
    assert ep > 1 and layout["sharded_data_parallel_degree"] == 1
    assert f"-ep{ep}" in plan["layout_name"]
    assert plan["time_estimate"]["expert_parallel_s"] > 0
    assert plan["memory_estimate_per_rank"]["expert_parameters"] > 0
    assert any(n.startswith(f"expert parallelism: ep{ep}") for n in plan["notes"])
    assert Plan.from_dict(plan).layout.expert_parallel_size == ep


def test_plan_ep_flag_fixes_the_degree_and_the_description_says_it(capsys) -> None:
    args = ["plan", "--model", QWEN3_30B, "--devices", "8", "--device", "h200"]
    assert main([*args, "--seq-len", "4096", "--bf16", "--ep", "4"]) == 0
    out = capsys.readouterr().out
    assert "chosen: dp8-tp1-pp1-ep4" in out
    assert "expert parallel over 4 ranks: 32 of each sparse layer's 128 experts per rank" in out
    assert "routing imbalance 1.25 assumed" in out
    step = next(line for line in out.splitlines() if line.startswith("  step "))
    assert "expert parallel" in step
    assert main([*args, "--ep", "3"]) == 1
    assert f"{EP}=3: it must divide the 128 experts" in capsys.readouterr().out


def test_dense_plans_are_the_same_with_ep_at_auto() -> None:
    llama = _llama()
    common = {"model": {"architecture": "llama"}, "launch": {"nproc_per_node": 4}}
    fixed = _plan(llama, **common, parallel={"expert_parallel_size": 1, "zero_1": "auto"})
    auto = _plan(llama, **common, parallel={"expert_parallel_size": "auto", "zero_1": "auto"})
    assert auto.to_dict() == fixed.to_dict()
    assert math.isclose(auto.time_estimate["step_s"], fixed.time_estimate["step_s"])


@pytest.mark.parametrize("top_k", [0, 13])
def test_more_experts_a_token_than_there_are_is_refused(top_k: int) -> None:
    """top-k of the router's scores needs 1 <= k <= the experts (12 here)."""
    with pytest.raises(LayoutError) as info:
        _plan(_config(num_experts_per_tok=top_k), launch={"nproc_per_node": 2})
    (refusal,) = [
        r for r in info.value.refusals if r.parameter == "model.config.num_experts_per_tok"
    ]
    assert refusal.value == top_k
    assert refusal.fix == "Use num_experts_per_tok between 1 and 12."


def test_tensor_parallelism_without_sequence_parallelism_is_refused() -> None:
    """The sparse layers run on each tp rank's share of the sequence: SP is needed."""
    with pytest.raises(LayoutError) as info:
        _plan(
            _config(),
            launch={"nproc_per_node": 2},
            parallel={"tensor_parallel_size": 2, "sequence_parallel": False},
        )
    (refusal,) = [r for r in info.value.refusals if r.parameter == "parallel.sequence_parallel"]
    assert "mixture of experts" in refusal.reason and "sequence_parallel=true" in refusal.fix


def test_the_assumed_imbalance_is_a_setting() -> None:
    """`planner.moe_imbalance` sizes the busiest rank's dispatch and all-to-alls."""
    layout = {"data_parallel_size": 4, "expert_parallel_size": 2}
    runs = {
        imbalance: _plan(
            _config(),
            launch={"nproc_per_node": 4},
            parallel=layout,
            planner={"moe_imbalance": imbalance},
        )
        for imbalance in (1.0, 1.25, 2.0)
    }
    dispatch = {k: p.memory_estimate_per_rank.get("expert_dispatch", 0) for k, p in runs.items()}
    assert dispatch[1.0] == 0 < dispatch[1.25] < dispatch[2.0]
    assert dispatch[2.0] == pytest.approx(4 * dispatch[1.25], rel=1e-6)
    times = {k: p.time_estimate["ep_all_to_all_s"] for k, p in runs.items()}
    assert times[1.0] < times[1.25] < times[2.0]
    assert runs[2.0].time_estimate["ep_imbalance"] == 2.0


@pytest.mark.parametrize(
    ("tp", "ep", "stage_layers", "tied"),
    [(1, 1, (5,), False), (2, 2, (2, 1, 2), True), (3, 4, (1, 4), False), (1, 2, (0, 3, 2), True)],
)
def test_stage_counts_by_role_are_the_counts_by_parameter(
    tp: int, ep: int, stage_layers: tuple[int, ...], tied: bool
) -> None:
    """The planner asks each role's share once (`ParameterShapes`): the same counts per
    stage as asking each parameter, on dense and sparse layers, tied or not, with the
    LoRA adapters of every kind (the experts' included) beside them."""
    config = _config(num_hidden_layers=5, tie_word_embeddings=tied)
    lora = LoraSettings(
        r=4,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
            "embed_tokens",
            "lm_head",
        ],
        target_parameters=["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    parameters = {**parameter_shapes(config), **lora_adapter_shapes(config, lora)}
    m = ModelShape.from_config(config)
    layout = dataclasses.replace(_plan(config).layout, expert_parallel_size=ep)
    step = dataclasses.replace(
        FP32, tp=tp, pp=len(stage_layers), stage_layers=stage_layers, layout=layout
    )
    share = local_share(m, step)
    by_parameter = [0] * len(stage_layers)
    for name, shape in parameters.items():
        layer = int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else None
        stage = 0 if "embed_tokens" in name else len(stage_layers) - 1
        if layer is not None:
            stage = max(s for s in range(len(stage_layers)) if sum(stage_layers[:s]) <= layer)
        by_parameter[stage] += share(name, shape)
        if name == "model.embed_tokens.weight" and tied and len(stage_layers) > 1:
            by_parameter[-1] += share(name, shape)
    grouped = ParameterShapes(parameters)
    assert len(grouped.groups) < len(parameters) / 3
    counts = stage_parameter_counts(grouped.groups, stage_layers, share=share, tied_embeddings=tied)
    assert counts == by_parameter
