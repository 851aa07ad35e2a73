"""The planner's sharded data parallelism: memory /N, gathered layers, the collectives'
time, `auto` weighing it against ZeRO-1, tp and pp, and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType
from transformers import PretrainedConfig

from meshtrain.commands import main
from meshtrain.config import RunConfig
from meshtrain.models import build_model_config
from meshtrain.models.llama.parameter_names import llama_family_shapes
from meshtrain.planner import LayoutError, Plan, plan_run
from meshtrain.planner.axes import local_share
from meshtrain.planner.axes.data import estimate_model_states
from meshtrain.planner.axes.pipeline import interleaved_gradient_chunks, interleaved_order
from meshtrain.planner.axes.sharding import gathered_bytes, sharded_data_parallel_degrees
from meshtrain.planner.memory import estimate_memory
from meshtrain.planner.parameters import gather_units
from meshtrain.planner.shapes import FP32, ModelShape
from tests.planner.test_layout import SHAPE, VOCAB

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_configs"
GIB = 2**30


@pytest.fixture(scope="module")
def model_config() -> PretrainedConfig:
    return build_model_config("llama", dict(SHAPE), vocab_size=VOCAB)


def _plan(model_config: PretrainedConfig, ranks: int = 4, **parallel: Any) -> Plan:
    groups: dict[str, Any] = {"launch": {"nproc_per_node": ranks}, "parallel": parallel}
    return plan_run(
        RunConfig.from_params(**groups),
        model_config,
        num_train_blocks=10_000,
        num_validation_blocks=50,
        cuda_available=False,
    )


def _states(plan: Plan) -> int:
    m = plan.memory_estimate_per_rank
    return m["parameters"] + m["gradients"] + m["optimizer_states"]


# --- memory ---------------------------------------------------------------------------------


def test_dp4_fp32_full_sharding_holds_4_of_zero_1s_10_and_plain_dps_16_bytes(model_config):
    sharded = _plan(model_config, sharded_data_parallel_degree=4)
    zero_1 = _plan(model_config, zero_1=True)
    plain = _plan(model_config, zero_1=False)
    assert sharded.layout.name == "dp4-tp1-pp1-sdp4" and not sharded.layout.zero_1
    n = sharded.num_parameters
    shard = math.ceil(n / 4)
    memory = sharded.memory_estimate_per_rank
    assert (memory["parameters"], memory["gradients"], memory["optimizer_states"]) == (
        4 * shard,
        4 * shard,
        8 * shard,
    )
    assert _states(sharded) / _states(zero_1) == pytest.approx(4 / 10, rel=1e-3)
    assert _states(sharded) / _states(plain) == pytest.approx(4 / 16, rel=1e-3)
    assert _states(sharded) <= 0.42 * _states(zero_1)
    assert _states(sharded) <= 0.27 * _states(plain)
    # Unsharded plans keep their breakdown as it was: no `gathered` term.
    assert "gathered" not in zero_1.memory_estimate_per_rank


def test_gathered_is_the_root_and_one_layer_at_the_backwards_start(model_config) -> None:
    """The peak of a sharded step without pp is the backward's start (the dry run's
    finding): the root group gathered, the last layer gathered again, no unsharded
    gradient yet, and no sharded one either (FSDP2 makes them late in the backward)."""
    plan = _plan(model_config, sharded_data_parallel_degree=4)
    h, i, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], 2 * 32
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; the MLP; two norms
    root = 2 * VOCAB * h + h  # embedding, LM head, final norm
    assert plan.num_parameters == SHAPE["num_hidden_layers"] * layer + root
    gathered = (root + layer) * 4
    memory = plan.memory_estimate_per_rank
    assert memory["gathered"] == gathered
    states = _states(plan) - memory["gradients"]
    assert memory["total"] == states + gathered + memory["activations"] + memory["loss"]


def test_bf16_master_shards_the_fp32_master_and_gathers_in_bf16(model_config) -> None:
    """Under bf16_master the sharded parameters are the fp32 masters (no separate copy in
    the optimizer), the sharded gradients fp32; only what is gathered is bf16."""
    shapes = llama_family_shapes(model_config)
    m = ModelShape.from_config(model_config)
    step = _step(model_config, sharded=4, dp=4, master_weights=True, bf16=True)
    estimate = estimate_memory(shapes, m, step)
    n = sum(math.prod(s) for s in shapes.values())
    shard = math.ceil(n / 4)
    assert (estimate.parameters, estimate.gradients, estimate.optimizer_states) == (
        4 * shard,
        4 * shard,
        8 * shard,
    )
    units = gather_units(shapes, m, step, local_share(m, step))
    assert estimate.gathered == (units.root + units.layer) * 2  # gathered in bf16
    reduced_bf16 = estimate_memory(shapes, m, _with(step, grad_reduce_bf16=True))
    assert reduced_bf16.gradients == estimate.gradients  # FSDP2 casts back to fp32
    # Under pp the stage keeps its gradients unsharded: their dtype counts there.
    piped = estimate_memory(shapes, m, _with(step, pp=2, stage_layers=(1, 1)))
    piped_bf16 = estimate_memory(
        shapes, m, _with(step, pp=2, stage_layers=(1, 1), grad_reduce_bf16=True)
    )
    assert piped_bf16.gathered < piped.gathered


def test_hybrid_sharding_divides_by_the_group_and_all_reduces_across(model_config) -> None:
    hybrid = _plan(model_config, sharded_data_parallel_degree=2)
    full = _plan(model_config, sharded_data_parallel_degree=4)
    assert hybrid.layout.name == "dp4-tp1-pp1-sdp2"
    assert _states(hybrid) == 16 * math.ceil(hybrid.num_parameters / 2)
    assert hybrid.memory_estimate_per_rank["gathered"] == full.memory_estimate_per_rank["gathered"]
    assert hybrid.time_estimate["sdp_replica_all_reduce_s"] > 0
    assert full.time_estimate["sdp_replica_all_reduce_s"] == 0


def test_under_pp_the_stage_stays_gathered_so_zero_1_holds_less(model_config) -> None:
    sharded = _plan(model_config, pipeline_parallel_size=2, sharded_data_parallel_degree=2)
    zero_1 = _plan(model_config, pipeline_parallel_size=2, zero_1=True)
    assert sharded.layout.name.startswith("dp2-tp1-pp2-") and "sdp2" in sharded.layout.name
    rank = sharded.memory_estimate_per_rank["peak_pipeline_rank"]
    shapes = llama_family_shapes(model_config)
    step = _step(model_config, sharded=2, dp=2, pp=2, stage_layers=(2, 2))
    shape = ModelShape.from_config(model_config)
    units = gather_units(shapes, shape, step, local_share(shape, step))
    local = units.local
    assert rank in (0, 1)
    # The whole stage's parameters and gradients, and one group's reduce-scatter buffer.
    flat_buffer = max(units.root, units.layer) * 4
    assert sharded.memory_estimate_per_rank["gathered"] == local * (4 + 4) + flat_buffer
    assert _states(sharded) == 16 * math.ceil(local / 2)
    # 8 B gathered + 16/2 B sharded against ZeRO-1's 8 B + 8/2 B: ZeRO-1 holds less.
    assert _states(sharded) < _states(zero_1)
    assert sharded.memory_estimate_per_rank["total"] > zero_1.memory_estimate_per_rank["total"]


def test_the_model_states_helper_takes_the_degree() -> None:
    norm = {"model.norm.weight": (8,)}
    states = estimate_model_states(norm, dp=4, tp=1, pp=1, zero_1=False, sharded=4)
    assert (states.parameters, states.gradients, states.optimizer_states) == (8, 8, 16)


# --- time -----------------------------------------------------------------------------------


def test_without_pp_every_microbatch_gathers_each_layer_twice(model_config) -> None:
    def sharded(accumulation: int, **parallel: Any) -> dict[str, float]:
        run = RunConfig.from_params(
            launch={"nproc_per_node": 4},
            parallel={"sharded_data_parallel_degree": 4, **parallel},
            training={"gradient_accumulation_steps": accumulation},
        )
        return plan_run(
            run, model_config, num_train_blocks=10_000, num_validation_blocks=50,
            cuda_available=False,
        ).time_estimate  # fmt: skip

    one, four = sharded(1), sharded(4)
    assert one["sdp_rounds_per_step"] == 1 and four["sdp_rounds_per_step"] == 4
    assert four["sdp_all_gather_s"] == pytest.approx(4 * one["sdp_all_gather_s"])
    assert four["sdp_reduce_scatter_s"] == pytest.approx(4 * one["sdp_reduce_scatter_s"])
    layers = SHAPE["num_hidden_layers"]
    per_layer = one["sdp_all_gather_per_layer_s"]
    assert one["sdp_all_gather_s"] > 2 * layers * per_layer  # plus the root's
    assert (
        one["data_parallel_s"]
        == one["sdp_exposed_s"]
        <= (one["sdp_all_gather_s"] + one["sdp_reduce_scatter_s"])
    )
    assert 0 <= one["sdp_overlapped_share"] <= 1


def test_under_pp_the_stage_is_gathered_once_per_schedule_step(model_config) -> None:
    plan = _plan(
        model_config,
        pipeline_parallel_size=2,
        sharded_data_parallel_degree=2,
        pipeline_parallel_num_microbatches=4,
    )
    t = plan.time_estimate
    assert t["sdp_rounds_per_step"] == 1  # one schedule step, four microbatches in it
    layers = SHAPE["num_hidden_layers"] // 2
    assert layers * t["sdp_all_gather_per_layer_s"] < t["sdp_all_gather_s"]
    assert t["sdp_all_gather_s"] < 2 * layers * t["sdp_all_gather_per_layer_s"] * 2


# --- search ---------------------------------------------------------------------------------


def test_auto_weighs_off_full_and_across_nodes_hybrid() -> None:
    assert sharded_data_parallel_degrees(1, 8, 8) == [1]
    assert sharded_data_parallel_degrees(8, 1, 8) == [1, 8]
    assert sharded_data_parallel_degrees(16, 1, 8) == [1, 8, 16]
    assert sharded_data_parallel_degrees(16, 2, 8) == [1, 4, 16]
    assert sharded_data_parallel_degrees(4, 4, 8) == [1, 2, 4]  # tp4 x sdp2 in a node
    assert sharded_data_parallel_degrees(2, 4, 8) == [1, 2]  # one node: no hybrid


def test_auto_does_not_shard_when_memory_fits_and_sharding_costs(model_config) -> None:
    """On a slow link the per-microbatch all-gathers cannot hide behind compute: plain data
    parallelism's one all-reduce per step is cheaper, and memory does not ask for more."""
    slow = {"cpu": {"intra_node_gbps": 0.01, "inter_node_gbps": 0.01}}
    run = RunConfig.from_params(
        launch={"nproc_per_node": 4},
        parallel={"sharded_data_parallel_degree": "auto"},
        planner={"device": "cpu", "device_profiles": slow},
    )
    plan = plan_run(
        run, model_config, num_train_blocks=10_000, num_validation_blocks=50, cuda_available=False
    )
    assert not plan.layout.sharded and not plan.layout.zero_1
    lost = {c["layout"]: c["lost_because"] for c in plan.candidates}
    assert "sdp4: model states" in lost["dp4-tp1-pp1-sdp4"]
    assert any(note.startswith("not sharded: this layout fits without it") for note in plan.notes)


def test_auto_shards_when_only_sharding_fits(model_config) -> None:
    sharded = _plan(model_config, sharded_data_parallel_degree=4)
    zero_1 = _plan(model_config, zero_1=True)
    need_sharded = sharded.memory_estimate_per_rank["total"]
    need_zero_1 = zero_1.memory_estimate_per_rank["total"]
    assert need_sharded < need_zero_1
    budget = (need_sharded + need_zero_1) / 2
    device = {"cpu": {"memory_gib": budget / 0.9 / GIB, "runtime_gib": 0.0}}
    run = RunConfig.from_params(
        launch={"nproc_per_node": 4},
        parallel={"sharded_data_parallel_degree": "auto"},
        planner={"device": "cpu", "device_profiles": device},
    )
    plan = plan_run(
        run, model_config, num_train_blocks=10_000, num_validation_blocks=50, cuda_available=False
    )
    assert plan.layout.name == "dp4-tp1-pp1-sdp4"
    lost = {c["layout"]: c["lost_because"] for c in plan.candidates}
    assert lost["dp4-tp1-pp1-zero1"].startswith("does not fit")
    assert "sharded as dp4-tp1-pp1-sdp4 it needs" in lost["dp4-tp1-pp1-zero1"]
    assert any("full sharding over the 4 data-parallel ranks" in n for n in plan.notes)


def test_auto_with_zero_1_asked_for_weighs_only_unsharded(model_config) -> None:
    plan = _plan(model_config, sharded_data_parallel_degree="auto", zero_1=True, **_auto_tp())
    assert not any("sdp" in c["layout"] for c in plan.candidates)


def _auto_tp() -> dict[str, str]:
    return {"tensor_parallel_size": "auto"}


# --- refusals -------------------------------------------------------------------------------


def test_a_degree_that_does_not_divide_dp_is_refused_with_the_ones_that_do(model_config):
    with pytest.raises(LayoutError) as error:
        _plan(model_config, sharded_data_parallel_degree=3)
    message = str(error.value)
    assert "parallel.sharded_data_parallel_degree=3" in message
    assert "must divide 4" in message and "Use one of 1, 2, 4" in message


def test_zero_1_beside_sharding_is_refused_and_auto_turns_it_off(model_config) -> None:
    with pytest.raises(LayoutError) as error:
        _plan(model_config, sharded_data_parallel_degree=4, zero_1=True)
    assert "parallel.zero_1=True" in str(error.value)
    assert "already shards the optimizer states" in str(error.value)
    assert not _plan(model_config, sharded_data_parallel_degree=4).layout.zero_1


def test_over_memory_refusal_offers_sharding(model_config) -> None:
    tiny = {"cpu": {"memory_gib": 0.01}}
    with pytest.raises(LayoutError) as error:
        plan_run(
            RunConfig.from_params(planner={"device": "cpu", "device_profiles": tiny}),
            model_config,
            num_train_blocks=10_000,
            num_validation_blocks=50,
            cuda_available=False,
        )
    assert "parallel.sharded_data_parallel_degree=auto" in str(error.value)


# --- the 8B example -------------------------------------------------------------------------


def _plan_8b(capsys, *extra: str) -> dict:
    args = [
        "plan", "--model", str(EXAMPLES / "llama-3.1-8b.json"), "--devices", "8",
        "--device", "h100", "--seq-len", "4096", "--global-batch", "256", "--bf16", *extra,
    ]  # fmt: skip
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_8b_on_eight_h100_weighs_sharded_dp8_and_says_why(capsys) -> None:
    plan = _plan_8b(capsys)
    layouts = {c["layout"]: c for c in plan["candidates"]}
    chosen = plan["layout"]
    name = (
        f"dp{chosen['data_parallel_size']}-tp{chosen['tensor_parallel_size']}"
        f"-pp{chosen['pipeline_parallel_size']}"
    )
    assert "dp8-tp1-pp1-sdp8" in layouts or name == "dp8-tp1-pp1"
    # Unsharded dp8 does not fit; sharded, it does, and the reason says so.
    assert "sharded as dp8-tp1-pp1-sdp8 it needs" in layouts["dp8-tp1-pp1-zero1"]["lost_because"]
    if chosen["sharded_data_parallel_degree"] == 8:
        assert any(n.startswith("sharded data parallelism (full sharding") for n in plan["notes"])
    else:
        assert "sdp8: model states" in layouts["dp8-tp1-pp1-sdp8"]["lost_because"]
    assert plan["memory_estimate_per_rank"]["process_total"] <= 72 * GIB


def test_8b_with_sdp_fixed_off_plans_as_before(capsys) -> None:
    plan = _plan_8b(capsys, "--sdp", "1")
    assert not any("sdp" in c["layout"] for c in plan["candidates"])
    assert plan["layout"]["sharded_data_parallel_degree"] == 1


def test_8b_table_prints_the_sharding_line(capsys) -> None:
    args = [
        "plan", "--model", str(EXAMPLES / "llama-3.1-8b.json"), "--devices", "8",
        "--device", "h100", "--seq-len", "4096", "--global-batch", "256", "--bf16",
        "--tp", "1", "--pp", "1", "--sdp", "8",
    ]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "chosen: dp8-tp1-pp1-sdp8" in out
    assert "gathered" in out and "sharded over 8 of 8 dp ranks" in out
    assert "two all-gathers (forward, backward)" in out


def test_8b_with_a_degree_no_layout_accepts_is_refused(capsys) -> None:
    args = [
        "plan", "--model", str(EXAMPLES / "llama-3.1-8b.json"), "--devices", "8",
        "--device", "h100", "--seq-len", "4096", "--sdp", "3",
    ]  # fmt: skip
    assert main(args) == 1
    assert "parallel.sharded_data_parallel_degree=3" in capsys.readouterr().out


# --- helpers --------------------------------------------------------------------------------


def _step(model_config: PretrainedConfig, **fields: Any):
    layers = model_config.num_hidden_layers
    fields.setdefault("stage_layers", (layers,))
    return _with(FP32, **{"microbatch_size": 1, "seq_len": 64, **fields})


def _with(step, **fields: Any):
    import dataclasses

    return dataclasses.replace(step, **fields)


# --- interleaved 1F1B: the order the planner walks is torch's ---------------------------------


@pytest.mark.parametrize(
    ("pp", "virtual", "microbatches"),
    [(2, 2, 2), (2, 2, 8), (4, 2, 8), (4, 3, 12), (8, 2, 8), (8, 2, 16)],
)
def test_the_interleaved_order_is_torchs(pp: int, virtual: int, microbatches: int) -> None:
    """Every rank's forwards and backwards, chunk by chunk, as torch's own schedule
    computes them (its per-rank order, without the idle slots)."""
    rounds = max(1, microbatches // pp)
    schedule = SimpleNamespace(
        n_local_stages=virtual,
        pp_group_size=pp,
        _n_microbatches=microbatches,
        microbatches_per_round=microbatches // rounds,
    )
    step = _with(FP32, pp=pp, virtual_stages=virtual, microbatches=microbatches)
    for rank in range(pp):
        actions = ScheduleInterleaved1F1B._calculate_single_rank_operations(schedule, rank)
        torchs = [
            (a.computation_type != _ComputationType.FORWARD, a.stage_index // pp)
            for a in actions
            if a is not None
        ]
        assert interleaved_order(step, rank) == torchs


def test_interleaved_gradients_of_every_chunk_are_unsharded_at_the_peak_past_one_round() -> None:
    """One round of microbatches (m <= pp): the warm-up runs every forward and the last
    chunk finishes its backwards before the next starts, so one chunk's gradients are
    unsharded at the peak. Two rounds: the steady phase starts the first chunk's
    backwards while the last one's wait for the second round (the 405B dry run at 16
    microbatches: both chunks, 25 GiB of gradients)."""
    one_round = _with(FP32, pp=8, virtual_stages=2, microbatches=8)
    two_rounds = _with(one_round, microbatches=16)
    assert [interleaved_gradient_chunks(one_round, r) for r in (0, 7)] == [1, 1]
    assert [interleaved_gradient_chunks(two_rounds, r) for r in (0, 7)] == [2, 2]
    shapes = {"model.layers.0.mlp.up_proj.weight": (64, 64)}  # one chunk's, per rank
    grads = 64 * 64 * FP32.gradient_bytes
    step = _with(two_rounds, sharded=8, schedule="interleaved_1f1b", stage_layers=(1,) * 16)
    local = 2 * math.prod(shapes["model.layers.0.mlp.up_proj.weight"])
    params = local * step.parameter_bytes
    assert gathered_bytes(step, local=local, layer=local // 2, layers=2) == params + 2 * grads
    step = _with(step, microbatches=8)
    assert gathered_bytes(step, local=local, layer=local // 2, layers=2) == params + grads
