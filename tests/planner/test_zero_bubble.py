"""The zero-bubble pipeline schedules as the planner sees them: where each puts the
stages, what it refuses before any worker starts (naming the parameter), and the walk of
torch's own order that gives each rank's activations in flight."""

from __future__ import annotations

import pytest

from meshtrain.pipeline_schedules import (
    last_stage_rank,
    microbatch_rule,
    rank_of_stage,
    schedule_order,
    stage_ids_of_rank,
)
from meshtrain.planner.axes.pipeline import fill_and_drain, in_flight_microbatches
from meshtrain.planner.schedule_walk import simulated_idle, split_backward_peak
from meshtrain.planner.shapes import FP32
from tests.planner.test_layout import _plan, _refusal, _refusals, model_config  # noqa: F401
from tests.planner.test_sharding import _with

TWO = {"pipeline_parallel_size": 2}


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_v_placement_puts_stage_r_and_its_mirror_on_rank_r(pp: int) -> None:
    for rank in range(pp):
        assert stage_ids_of_rank(rank, pp, "zbv", 2) == [rank, 2 * pp - 1 - rank]
        for stage in stage_ids_of_rank(rank, pp, "dualpipev", 2):
            assert rank_of_stage(stage, pp, "dualpipev") == rank
    assert last_stage_rank(pp, "zbv") == 0 and last_stage_rank(pp, "interleaved_zb") == pp - 1
    assert stage_ids_of_rank(1, pp, "interleaved_zb", 3) == [1, 1 + pp, 1 + 2 * pp]


@pytest.mark.parametrize(
    ("schedule", "pp", "microbatches"),
    [("zbv", 2, 1), ("zbv", 4, 5), ("interleaved_zb", 4, 6), ("dualpipev", 4, 8)],
)
def test_the_order_walked_is_every_microbatch_of_every_stage_once(
    schedule: str, pp: int, microbatches: int
) -> None:
    """Each stage's forwards, then backwards (whole, or input and weight) of each
    microbatch, in torch's order: what the walk of `split_backward_peak` counts."""
    order = schedule_order(schedule, pp, microbatches, 2)
    assert len(order) == pp
    for rank, actions in enumerate(order):
        stages = set(stage_ids_of_rank(rank, pp, schedule, 2))
        assert {stage for _, stage, _ in actions} == stages
        for stage in stages:
            kinds = [(k, mb) for k, s, mb in actions if s == stage]
            forwards = [mb for k, mb in kinds if k == "F"]
            freed = [mb for k, mb in kinds if k in "BW"]
            assert sorted(forwards) == sorted(freed) == list(range(microbatches))


def test_zbv_holds_what_1f1b_holds_on_its_first_rank_on_every_rank() -> None:
    """ZB-V's point (the zero-bubble paper's section 6): the activations of pp stages'
    worth of microbatches on every rank, 1F1B's first rank's peak, while some of them
    wait for their weight gradients. (A chunk is half a 1F1B stage.)"""
    layers = {"zbv": 2, "1f1b": 1}
    steps = {
        name: _with(
            FP32, pp=4, virtual_stages=v, microbatches=8, schedule=name, stage_layers=(1,) * 4 * v
        )
        for name, v in layers.items()
    }
    zbv = [in_flight_microbatches(steps["zbv"], rank) / 2 for rank in range(4)]
    one_f_one_b = [in_flight_microbatches(steps["1f1b"], rank) for rank in range(4)]
    assert zbv == [4, 4, 4, 4] and one_f_one_b == [4, 3, 2, 1]
    assert all(split_backward_peak(steps["zbv"], rank).waiting == 1 for rank in range(4))
    assert split_backward_peak(steps["zbv"], 0).last_stage >= 1  # rank 0 holds the last stage


def test_dualpipev_below_twice_the_stages_is_refused(model_config) -> None:  # noqa: F811
    error = _refusals(
        model_config,
        parallel={**TWO, "pipeline_schedule": "dualpipev", "pipeline_parallel_num_microbatches": 2},
    )
    refusal = _refusal(error, "parallel.pipeline_parallel_num_microbatches")
    assert "at least 2 x pipeline_parallel_size = 4" in refusal.reason
    assert "Use one of 4, 8" in refusal.fix


def test_interleaved_zero_bubble_needs_equal_rounds() -> None:
    assert microbatch_rule("interleaved_zb", 9, 4) is not None  # 2 rounds of 4.5
    assert microbatch_rule("interleaved_zb", 6, 4) is None  # one round of 6
    assert microbatch_rule("interleaved_zb", 12, 4) is None
    assert microbatch_rule("zbv", 1, 4) is None  # torch pads the V's warm-up itself


def test_compile_with_a_zero_bubble_schedule_is_refused(model_config) -> None:  # noqa: F811
    error = _refusals(
        model_config,
        parallel={**TWO, "pipeline_schedule": "zbv"},
        training={"compile": True},
    )
    refusal = _refusal(error, "training.compile")
    assert "splits each backward" in refusal.reason
    assert "training.compile=false" in refusal.fix


def test_a_v_schedule_plans_two_stages_a_rank(model_config) -> None:  # noqa: F811
    plan = _plan(model_config, parallel={**TWO, "pipeline_schedule": "zbv"})
    assert plan.layout.pipeline_parallel_virtual_stages == 2
    assert plan.layout.num_stages == 4
    assert plan.layout.name == "dp1-tp1-pp2-zbv-mb4"


@pytest.mark.parametrize(("pp", "virtual", "microbatches"), [(2, 2, 4), (4, 2, 8), (4, 4, 8)])
def test_the_simulated_order_gives_interleaved_1f1b_its_textbook_bubble(
    pp: int, virtual: int, microbatches: int
) -> None:
    """The replay of torch's order (`simulated_idle`) agrees with the closed form where
    there is one: interleaved 1F1B's (p - 1) / v microbatch times on balanced stages."""
    step = _with(
        FP32,
        pp=pp,
        virtual_stages=virtual,
        microbatches=microbatches,
        schedule="interleaved_1f1b",
        stage_layers=(1,) * pp * virtual,
    )
    costs = [1.0] * pp * virtual
    assert simulated_idle(step, costs) == pytest.approx(fill_and_drain([1 / pp] * pp, virtual))


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv", "dualpipev"])
def test_a_zero_bubble_schedule_idles_at_most_a_sixth_of_1f1b(schedule: str) -> None:
    """pp4, 8 microbatches: 1F1B idles 3 microbatch times; the weight gradients fill
    most of that (half a microbatch time is left in the replay)."""
    step = _with(
        FP32, pp=4, virtual_stages=2, microbatches=8, schedule=schedule, stage_layers=(1,) * 8
    )
    assert simulated_idle(step, [1.0] * 8) <= 3 / 6


def test_a_v_schedule_without_two_layers_a_rank_is_refused_naming_the_schedule(
    model_config,  # noqa: F811
) -> None:
    error = _refusals(
        model_config, parallel={"pipeline_parallel_size": 4, "pipeline_schedule": "zbv"}
    )
    refusal = _refusal(error, "parallel.pipeline_schedule")
    assert "zbv places two stages on every rank: 8 stages" in refusal.reason
    assert "pipeline_parallel_size=2 or less" in refusal.fix


def test_auto_weighs_every_schedule_and_says_which_won(model_config) -> None:  # noqa: F811
    """`pipeline_schedule: auto` plans each schedule the pipeline can run and keeps the
    fastest estimate that fits; the note names the others' estimates."""
    plan = _plan(
        model_config,
        parallel={**TWO, "pipeline_schedule": "auto", "pipeline_parallel_num_microbatches": 4},
    )
    weighed = {c["layout"].split("-")[3] for c in plan.candidates if "-pp2-" in c["layout"]}
    assert plan.layout.pipeline_schedule in {"interleaved_zb", "zbv", "dualpipev"}
    note = next(n for n in plan.notes if n.startswith("pipeline_schedule: "))
    assert plan.layout.pipeline_schedule in note and "1f1b" in note
    assert len(weighed | {plan.layout.pipeline_schedule}) >= 4, plan.candidates


def test_auto_without_a_pipeline_plans_1f1b(model_config) -> None:  # noqa: F811
    plan = _plan(model_config, parallel={"pipeline_schedule": "auto"})
    assert plan.layout.pipeline_parallel_size == 1
    assert plan.layout.pipeline_schedule == "1f1b"
