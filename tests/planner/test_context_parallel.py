"""Context parallelism in the planner: cp resolved and refused, its memory and time terms,
and when `context_parallel_size: auto` weighs it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import PretrainedConfig

from meshtrain.commands import main
from meshtrain.config import RunConfig
from meshtrain.models import build_model_config
from meshtrain.models.llama.parameter_names import llama_family_shapes
from meshtrain.planner import LayoutError, Plan, plan_run
from meshtrain.planner.axes.context import (
    context_parallel_degrees,
    context_parallel_wanted,
    gathered_kv_bytes,
    kv_gradient_bytes,
    mask_bytes,
)
from meshtrain.planner.flops import attention_excess
from meshtrain.planner.memory import estimate_memory
from meshtrain.planner.shapes import FP32, ModelShape
from meshtrain.tracking.mlflow_run import flatten
from tests.planner.test_layout import SHAPE as LAYOUT_SHAPE

# test_layout's small Llama, with room for long blocks.
SHAPE = {**LAYOUT_SHAPE, "max_position_embeddings": 8192}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_configs"


@pytest.fixture(scope="module")
def model_config() -> PretrainedConfig:
    return build_model_config("llama", dict(SHAPE), vocab_size=4096)


def _plan(model_config: PretrainedConfig, world: int = 4, block: int = 4096, **groups: Any) -> Plan:
    parallel = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, **groups.pop("parallel")}
    run = RunConfig.from_params(
        parallel=parallel,
        launch={"nproc_per_node": world},
        data={"block_size": block},
        training={"per_device_train_batch_size": 1, **groups.pop("training", {})},
        planner={"device": "cpu", **groups.pop("planner", {})},
    )
    return plan_run(
        run, model_config, num_train_blocks=1000, num_validation_blocks=50, cuda_available=False
    )


def _refusals(model_config: PretrainedConfig, **kwargs: Any) -> dict[str, str]:
    with pytest.raises(LayoutError) as info:
        _plan(model_config, **kwargs)
    return {r.parameter: str(r) for r in info.value.refusals}


# --- resolution and refusals ------------------------------------------------------------------


def test_cp_takes_its_ranks_from_dp_and_names_the_layout(model_config) -> None:
    two = _plan(model_config, parallel={"context_parallel_size": 2})
    assert (two.layout.data_parallel_size, two.layout.context_parallel_size) == (2, 2)
    assert two.layout.name == "dp2-tp1-pp1-cp2"
    four = _plan(model_config, parallel={"context_parallel_size": 4, "zero_1": True})
    assert four.layout.name == "dp1-tp1-pp1-cp4-zero1"  # ZeRO-1 shards over dp x cp = 4
    assert four.global_batch_size == 1  # cp ranks see the same samples: the batch follows dp
    # MLflow's params come from the plan's layout: the size and the name are there.
    logged = flatten({"parallel": four.to_dict()["layout"]})
    assert logged["parallel.context_parallel_size"] == "4"
    assert four.to_dict()["layout_name"] == "dp1-tp1-pp1-cp4-zero1"


def test_a_block_that_does_not_cut_into_2cp_chunks_is_refused_with_what_works(
    model_config,
) -> None:
    refused = _refusals(model_config, block=4100, parallel={"context_parallel_size": 4})
    why = refused["data.block_size"]
    assert "context_parallel_size=4 cuts each block into 2 x 4 = 8 equal chunks" in why
    assert "Use a block size divisible by 8 (e.g. 4096)" in why
    assert "or parallel.context_parallel_size=2" in why  # 4100 = 4 x 1025 cuts into 4


def test_cp_that_does_not_fill_the_world_is_refused(model_config) -> None:
    refused = _refusals(model_config, parallel={"context_parallel_size": 3})
    why = refused["parallel.context_parallel_size"]
    assert "it must divide the world size 4. Values that work here: 1, 2, 4" in why
    refused = _refusals(
        model_config, parallel={"context_parallel_size": 4, "data_parallel_size": 2}
    )
    why = refused["parallel.data_parallel_size"]
    assert "dp x tp x pp x cp = 2 x 1 x 1 x 4 = 8 must equal the world size 4" in why
    assert context_parallel_degrees(8, 4096, search=True) == [1, 2, 4, 8]
    assert context_parallel_degrees(6, 4096) == [1, 2]  # 3 and 6 do not cut 4096 evenly


def test_sequence_parallel_needs_the_ranks_share_to_split_over_tp(model_config) -> None:
    # 36 cuts into cp2's 4 chunks, but a rank's 18 tokens do not split over tp4.
    with pytest.raises(LayoutError) as info:
        _plan(
            model_config,
            world=8,
            block=36,
            parallel={"context_parallel_size": 2, "tensor_parallel_size": 4},
        )
    (refusal,) = [r for r in info.value.refusals if r.parameter == "data.block_size"]
    assert "tensor_parallel_size=4 x context_parallel_size=2" in str(refusal)
    assert "divisible by 8" in str(refusal)


# --- memory ---------------------------------------------------------------------------------


def _memory(model_config: PretrainedConfig, **step: Any):
    shape = ModelShape.from_config(model_config)
    base = dataclasses.replace(FP32, stage_layers=(shape.layers,), seq_len=4096)
    return estimate_memory(
        llama_family_shapes(model_config), shape, dataclasses.replace(base, **step)
    )


def test_activations_divide_by_cp_plus_every_layers_gathered_kv_on_accelerators(
    model_config,
) -> None:
    shape = ModelShape.from_config(model_config)
    one, four = _memory(model_config), _memory(model_config, cp=4)
    per_token = four.activations - four.context_kv
    assert per_token == pytest.approx(one.activations / 4, rel=0.1)
    # Autograd through sdpa: every layer keeps the whole sequence's K and V
    # (2 x 4096 x 2 KV heads x 32, fp32).
    assert four.context_kv == shape.layers * 2 * 4096 * 64 * 4
    # One sequence per row runs unmasked kernels: no mask at all.
    assert four.context_mask == 0 and "context_mask" not in four.to_dict()
    assert four.loss == pytest.approx(one.loss / 4, rel=0.1)
    assert one.context_kv == one.context_mask == 0 and "context_kv" not in one.to_dict()
    assert four.to_dict()["context_kv"] == four.context_kv


def test_only_packed_examples_have_masks(model_config) -> None:
    # (2cp + 1) c^2 mask elements per row, c = 4096 / 8, shared by the layers.
    packed = _memory(model_config, cp=4, packed=True)
    assert packed.context_mask == 9 * 512**2 * 4
    two_rows = _memory(model_config, cp=4, microbatch_size=2, packed=True)
    assert two_rows.context_mask == 2 * packed.context_mask
    cpu = _memory(model_config, cp=4, packed=True, cp_fused_backward=True)
    assert cpu.context_mask == packed.context_mask


def test_cpu_keeps_no_gathered_kv_and_gathers_them_again_in_the_backward(model_config) -> None:
    shape = ModelShape.from_config(model_config)
    step = dataclasses.replace(FP32, seq_len=4096, cp=4)
    pair = gathered_kv_bytes(shape, step)
    cpu = _memory(model_config, cp=4, cp_fused_backward=True)
    accelerator = _memory(model_config, cp=4)
    # The rank keeps only its own q, K, V, output and log-sum-exps (the per-token terms).
    assert cpu.context_kv == 0 < accelerator.context_kv
    kept = shape.layers * pair * 3 // 4  # every layer's other ranks' share
    assert accelerator.activations - cpu.activations == kept  # the loss sets the peak here
    # The backward's layer holds the pair gathered again, its gradient and the rank-order
    # copy for the reduce-scatter: three pairs against the accelerators' two.
    assert kv_gradient_bytes(shape, step) == 2 * pair
    cpu_step = dataclasses.replace(step, cp_fused_backward=True)
    assert kv_gradient_bytes(shape, cpu_step) == 3 * pair
    # With a chunked loss a layer's backward sets the peak: there the CPU holds a pair more.
    chunked = {"cp": 4, "loss_chunk_tokens": 256}
    cpu = _memory(model_config, cp_fused_backward=True, **chunked)
    assert _memory(model_config, **chunked).activations - cpu.activations == kept - pair


def test_model_states_shard_over_dp_times_cp(model_config) -> None:
    plain = _memory(model_config)
    zero_1 = _memory(model_config, cp=4, layout=dataclasses.replace(FP32.layout, zero_1=True))
    assert zero_1.optimizer_states == pytest.approx(plain.optimizer_states / 4, rel=0.01)
    sharded = _memory(model_config, dp=2, cp=2, sharded=2)  # FSDP2 over sdp x cp = 4
    assert sharded.parameters == pytest.approx(plain.parameters / 4, rel=0.01)


def test_the_cp_terms_follow_checkpointing_and_the_compute_dtype(model_config) -> None:
    full = _memory(model_config, cp=4, activation_checkpointing="full")
    shape = ModelShape.from_config(model_config)
    step = dataclasses.replace(FP32, seq_len=4096, cp=4)
    assert full.context_kv == gathered_kv_bytes(shape, step)  # one recomputed layer's
    bf16 = dataclasses.replace(step, bf16=True, packed=True)
    assert gathered_kv_bytes(shape, bf16) * 2 == gathered_kv_bytes(shape, step)
    assert mask_bytes(bf16) * 2 == mask_bytes(dataclasses.replace(step, packed=True))


# --- time -----------------------------------------------------------------------------------


def test_the_kv_exchange_is_exposed_and_attention_is_the_causal_share(model_config) -> None:
    one = _plan(
        model_config, parallel={"context_parallel_size": 1, "data_parallel_size": 1}, world=1
    )
    four = _plan(model_config, parallel={"context_parallel_size": 4})
    t, layers = four.time_estimate, SHAPE["num_hidden_layers"]
    # On CPU, per layer: the forward's all-gather, the backward's again and its
    # reduce-scatter, nothing hidden.
    assert t["cp_kv_all_gathers_per_layer"] == 2
    assert t["cp_exchanges_per_step"] == layers * 3
    assert t["cp_overlapped_share"] == 0.0
    assert t["context_parallel_s"] == pytest.approx(
        layers * (2 * t["cp_kv_all_gather_per_layer_s"] + t["cp_kv_reduce_scatter_per_layer_s"])
    )
    assert t["step_s"] >= t["compute_s"] + t["context_parallel_s"]
    # A quarter of the tokens, each attending its causal share: no masked chunk computed
    # whole, except where packed examples' masked call covers each chunk's rectangle.
    step = dataclasses.replace(FP32, cp=4)
    assert attention_excess(step) == 1.0 and attention_excess(FP32) == 1.0
    assert attention_excess(dataclasses.replace(step, packed=True)) == 1.125
    assert t["compute_s"] / one.time_estimate["compute_s"] < 1.01 / 4
    full = _plan(
        model_config, parallel={"context_parallel_size": 4, "activation_checkpointing": "full"}
    )
    assert full.time_estimate["cp_exchanges_per_step"] == layers * 4
    # The gradients are averaged over the dp x cp = 4 ranks that hold the parameters.
    assert t["data_parallel_s"] > 0


def test_accelerators_keep_the_gathered_kv_and_gather_once_a_layer(model_config) -> None:
    h100 = {"planner": {"device": "h100"}}
    four = _plan(model_config, parallel={"context_parallel_size": 4}, **h100)
    t, layers = four.time_estimate, SHAPE["num_hidden_layers"]
    assert t["cp_kv_all_gathers_per_layer"] == 1
    assert t["cp_exchanges_per_step"] == layers * 2
    # Every layer keeps the whole sequence's K and V (fp32: no mixed precision here).
    shape = ModelShape.from_config(model_config)
    step = dataclasses.replace(FP32, seq_len=4096, cp=4)
    assert four.memory_estimate_per_rank["context_kv"] == layers * gathered_kv_bytes(shape, step)
    full = _plan(
        model_config,
        parallel={"context_parallel_size": 4, "activation_checkpointing": "full"},
        **h100,
    )
    assert full.time_estimate["cp_exchanges_per_step"] == layers * 3


# --- auto -----------------------------------------------------------------------------------


def test_auto_weighs_cp_where_nothing_fits_without_it(model_config) -> None:
    plan = _plan(
        model_config,
        block=8192,
        parallel={"context_parallel_size": "auto", "data_parallel_size": "auto"},
        planner={"device_profiles": {"cpu": {"memory_gib": 0.85}}, "memory_margin": 0.0},
    )
    assert plan.layout.context_parallel_size > 1
    (note,) = [n for n in plan.notes if "context_parallel_size=auto" in n]
    assert f"cp{plan.layout.context_parallel_size}: no layout without it fits" in note
    assert "none hidden behind compute" in note


def test_auto_leaves_cp_off_where_model_states_dominate(model_config) -> None:
    plan = _plan(model_config, block=64, parallel={"context_parallel_size": "auto"}, world=2)
    assert plan.layout.context_parallel_size == 1
    (note,) = [n for n in plan.notes if "context_parallel_size=auto" in n]
    assert "cp1, larger sizes not weighed" in note
    assert not any("-cp" in c["layout"] for c in plan.candidates)


def test_auto_weighs_cp_for_long_blocks_whatever_their_share(model_config) -> None:
    plan = _plan(model_config, block=64, parallel={"context_parallel_size": 1}, world=2)
    assert context_parallel_wanted([plan], budget=1e15, block_size=64) is None
    why = context_parallel_wanted([plan], budget=1e15, block_size=16384)
    assert why == "blocks of 16,384 tokens, at least 16,384"


def _plan_8b(capsys, *extra: str) -> str:
    """`python -m meshtrain plan` for Llama-3.1-8B on 8 x H100 at 131,072 tokens: its output."""
    args = [
        "plan", "--model", str(EXAMPLES / "llama-3.1-8b.json"), "--devices", "8",
        "--device", "h100", "--seq-len", "131072", "--global-batch", "8", "--bf16", *extra,
    ]  # fmt: skip
    assert main(args) == 0
    return capsys.readouterr().out


def test_8b_at_128k_chooses_cp_and_says_why(capsys) -> None:
    plan = json.loads(_plan_8b(capsys, "--json"))
    # cp's K/V exchange (0.12 s a step at cp2) costs less than tp's collectives (1.89 s at
    # tp4), attention is its exact causal share and no mask exists: cp wins on speed.
    assert plan["layout"]["context_parallel_size"] > 1
    assert "context_mask" not in plan["memory_estimate_per_rank"]
    (note,) = [n for n in plan["notes"] if "context_parallel_size=auto" in n]
    assert "activations and loss are" in note
    assert "the fastest layout without cp, dp2-tp4-pp1-sp-ac-full, is" in note
    assert "K/V exchange takes" in note and "tp 1.89" in note
    weighed = [c["layout"] for c in plan["candidates"] if "lost_because" in c]
    assert any("-cp4-" in name for name in weighed)
    # With tensor parallelism held to 2, nothing fits without cp.
    pinned = json.loads(_plan_8b(capsys, "--tp", "2", "--json"))
    assert pinned["layout"]["context_parallel_size"] == 2
    assert pinned["memory_estimate_per_rank"]["context_kv"] > 0  # an accelerator keeps them
    text = _plan_8b(capsys, "--tp", "2")
    assert "context parallel over 2 ranks: 65,536 of each sequence's 131,072 tokens" in text
    assert "2 K/V all-gathers" in text  # the forward's and full checkpointing's
    assert "cp2: no layout without it fits" in text
