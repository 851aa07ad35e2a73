"""How many microbatches' activations a pipeline rank holds at once, under each of
torch's schedules (the multipliers of `planner.memory`'s per-microbatch terms)."""

from __future__ import annotations

from meshtrain.planner.shapes import StepShape


def in_flight_microbatches(step: StepShape, rank: int) -> int:
    """Model chunks x microbatches whose activations a pipeline rank holds at once."""
    m, p = step.microbatches, step.pp
    if p == 1:
        return 1
    if step.schedule == "gpipe":  # one model chunk per rank: virtual stages interleave only
        return m
    if step.schedule == "interleaved_1f1b":
        warmup = (step.virtual_stages - 1) * p + 2 * (p - 1 - rank)
        return min(m * step.virtual_stages, warmup + 1)
    return min(m, p - rank)


def last_stage_in_flight(step: StepShape) -> int:
    """Microbatches whose logits the last stage's rank holds at once (interleaved: its
    first chunk holds all of them before its last chunk, the last stage, starts)."""
    if step.pp == 1 or step.schedule == "1f1b":
        return 1
    if step.schedule == "gpipe":
        return step.microbatches
    last_rank = (len(step.stage_layers) - 1) % step.pp
    earlier_chunks = (step.virtual_stages - 1) * step.microbatches
    return max(1, in_flight_microbatches(step, last_rank) - earlier_chunks)
