"""The pipeline schedules meshtrain runs, where each puts the stages, and what each asks of
its microbatches: one torch-free place that the parameters, the planner, the model
builder, the trainer and the dry run read.

- `gpipe`, `1f1b`: one stage per rank.
- `interleaved_1f1b`, `interleaved_zb`: `v` stages per rank, looped (rank r holds r,
  r + pp, r + 2pp, ...).
- `zbv`, `dualpipev`: exactly two stages per rank in a V (rank r holds r and 2pp-1-r), so
  the first and the last stage share rank 0.

The zero-bubble schedules (`interleaved_zb`, `zbv`, `dualpipev`) split each backward into
the input gradient, which the previous stage waits for, and the weight gradient, which
fills the bubble.
"""

from __future__ import annotations

from functools import cache
from typing import Literal, get_args

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]
SCHEDULES: tuple[str, ...] = get_args(ScheduleName)
LOOPED = frozenset({"interleaved_1f1b", "interleaved_zb"})
V_SHAPED = frozenset({"zbv", "dualpipev"})
ZERO_BUBBLE = frozenset({"interleaved_zb", "zbv", "dualpipev"})
# What `auto` weighs, in the order a tie is broken (the simpler schedule first). GPipe
# holds every microbatch's activations and is never faster than 1F1B.
AUTO_CHOICES = ("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
# torch's names (`torch.distributed.pipelining.schedules.get_schedule_class`).
TORCH_NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "interleaved_zb": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Stages each rank holds: `parallel.pipeline_parallel_virtual_stages` for the looped
    schedules, two in a V, else one."""
    if schedule in LOOPED:
        return virtual_stages
    return 2 if schedule in V_SHAPED else 1


def stage_ids_of_rank(pp_rank: int, pp: int, schedule: str, per_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds, in the order its schedule lists them."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def rank_of_stage(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank that holds `stage`."""
    if schedule in V_SHAPED and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def last_stage_rank(pp: int, schedule: str) -> int:
    """The pipeline rank holding the last stage (the LM head and the loss)."""
    return 0 if schedule in V_SHAPED else pp - 1


def microbatch_rule(schedule: str, microbatches: int, pp: int) -> str | None:
    """Why `schedule` cannot run `microbatches` over `pp` ranks (torch's schedules raise,
    or would hang), or None where it can."""
    m = microbatches
    if schedule in ("1f1b", "interleaved_1f1b") and m < pp:
        return f"{schedule} needs at least one microbatch per stage (pipeline_parallel_size={pp})"
    if schedule == "interleaved_1f1b" and m % pp:
        return f"interleaved_1f1b runs microbatches in rounds of pipeline_parallel_size={pp}"
    if schedule == "interleaved_zb" and m % max(1, m // pp):
        return (
            f"interleaved_zb runs {m} microbatches in {m // pp} rounds of "
            f"pipeline_parallel_size={pp} or more, which must be equal"
        )
    if schedule == "dualpipev" and m < 2 * pp:
        return f"dualpipev needs at least 2 x pipeline_parallel_size = {2 * pp} microbatches"
    return None


# One compute action of a schedule: (kind, stage, microbatch); kind F (forward), B (whole
# backward), I (input gradient) or W (weight gradient).
Action = tuple[str, int, int]
COMPUTE = ("F", "B", "I", "W")


@cache
def schedule_order(schedule: str, pp: int, microbatches: int, per_rank: int) -> tuple:
    """Each pipeline rank's compute actions in the order torch's multi-stage schedule runs
    them (one tuple of `Action`s per rank; an overlapped forward and backward as the two;
    no sends, receives or gradient reductions). torch
    builds the order without stages or a process group; imported here, when a plan
    needs it, since the rest of the planner runs without torch."""
    from torch.distributed.pipelining._schedule_visualizer import (  # noqa: PLC0415
        get_schedule_ops,
    )

    ops = get_schedule_ops(TORCH_NAMES[schedule], pp, microbatches, per_rank)
    return tuple(
        tuple(
            (part.computation_type.value, part.stage_index, part.microbatch_index)
            for action in rank_ops
            if action is not None
            for part in (action.sub_actions or (action,))
            if part.computation_type.value in COMPUTE
        )
        for rank_ops in ops
    )
