"""Walks of the order a zero-bubble pipeline schedule runs on each rank (torch's own,
`pipeline_schedules.schedule_order`): the most activations a rank holds at once, and the
idle time its dependencies leave.

These schedules split each backward into the input gradient (I), which the previous
stage waits for, and the weight gradient (W), which nothing waits for and which fills
the idle slots; their orders are too irregular for the closed forms that GPipe and 1F1B
have, so the planner replays them.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.pipeline_schedules import ZERO_BUBBLE, Action, schedule_order
from meshtrain.planner.shapes import StepShape

# Each action's time in forwards of its stage: a whole backward twice a forward, its
# input and weight halves one each.
DURATION = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class SplitBackwardPeak:
    """A rank at its most activations: the chunk x microbatches it holds (from the forward
    to the weight gradient: the input-gradient pass keeps the graph for the weights'),
    how many of them wait for their weight gradients, and how many are the last stage's
    (whose loss each keeps)."""

    in_flight: int
    waiting: int
    last_stage: int


def _order(step: StepShape) -> tuple[tuple[Action, ...], ...]:
    return schedule_order(step.schedule, step.pp, step.microbatches, step.virtual_stages)


def split_backward_peak(
    step: StepShape, rank: int, held: float = 1.0, held_waiting: float = 0.0
) -> SplitBackwardPeak:
    """Walk rank `rank`'s actions and keep the moment it holds the most: `held` per chunk x
    microbatch in flight, `held_waiting` more for each whose weight gradient waits (what
    its input pass kept for the weight pass)."""
    last = len(step.stage_layers) - 1
    alive: set[tuple[int, int]] = set()
    waiting: set[tuple[int, int]] = set()
    peak = SplitBackwardPeak(0, 0, 0)

    def weight(moment: SplitBackwardPeak) -> tuple[float, int]:
        return (moment.in_flight * held + moment.waiting * held_waiting, moment.waiting)

    for kind, stage, microbatch in _order(step)[rank]:
        unit = (stage, microbatch)
        if kind == "F":
            alive.add(unit)
        elif kind == "I":
            waiting.add(unit)
        else:  # B or W: the microbatch's graph on this stage is freed
            alive.discard(unit)
            waiting.discard(unit)
            continue
        now = SplitBackwardPeak(len(alive), len(waiting), sum(1 for s, _ in alive if s == last))
        if weight(now) > weight(peak):
            peak = now
    return peak


def _needs(action: Action, last: int) -> list[tuple[str, int, int]]:
    """The actions `action` waits for (sends between ranks taken as instant)."""
    kind, stage, microbatch = action
    if kind == "F":
        return [("F", stage - 1, microbatch)] if stage > 0 else []
    if kind == "W":
        return [("I", stage, microbatch)]
    needs = [("F", stage, microbatch)]
    if stage < last:  # the next stage's input gradient, whole or split
        needs.append(("dX", stage + 1, microbatch))
    return needs


def simulated_idle(step: StepShape, stage_costs: list[float]) -> float:
    """`replayed_idle` of the step's schedule."""
    return replayed_idle(
        step.schedule, step.pp, step.microbatches, step.virtual_stages, stage_costs
    )


def balanced_bubble(schedule: str, pp: int, microbatches: int, per_rank: int) -> float:
    """The idle share of a step on stages of equal cost (the textbook's assumption):
    ((p-1)/v) / (m + (p-1)/v) for GPipe, 1F1B and interleaved 1F1B, and for a zero-bubble
    schedule the same with `replayed_idle` in place of (p-1)/v."""
    idle = (pp - 1) / per_rank
    if schedule in ZERO_BUBBLE:
        idle = replayed_idle(schedule, pp, microbatches, per_rank, [1.0] * pp * per_rank)
    return idle / (microbatches + idle)


def replayed_idle(
    schedule: str, pp: int, microbatches: int, per_rank: int, stage_costs: list[float]
) -> float:
    """The busiest rank's idle time in one pass of the schedule, in its own microbatch
    times (what `pipeline.fill_and_drain` gives GPipe and 1F1B): every rank runs its
    actions in order, each as soon as the rank is free and what it needs is done; a
    stage's forward takes its cost (`stage_costs`), its backward twice that."""
    order = schedule_order(schedule, pp, microbatches, per_rank)
    last = len(stage_costs) - 1
    finished: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * pp
    position = [0] * pp
    while any(position[r] < len(order[r]) for r in range(pp)):
        moved = False
        for rank in range(pp):
            while position[rank] < len(order[rank]):
                action = order[rank][position[rank]]
                needs = _needs(action, last)
                if any(need not in finished for need in needs):
                    break
                kind, stage, microbatch = action
                start = max([clock[rank], *(finished[need] for need in needs)])
                clock[rank] = start + DURATION[kind] * stage_costs[stage]
                finished[action] = clock[rank]
                if kind in "BI":
                    finished[("dX", stage, microbatch)] = clock[rank]
                position[rank] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule}: the order waits on itself (pp={pp})")
    busy = [
        sum(DURATION[kind] * stage_costs[stage] for kind, stage, _ in actions) for actions in order
    ]
    busiest = max(busy)
    return (max(clock) - busiest) / (busiest / microbatches)
