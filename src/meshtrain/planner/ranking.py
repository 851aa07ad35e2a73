"""How the search ranks planned layouts (throughput, peak memory, the tie) and the
words comparing two, shared by the search's explanation and each axis's lines.
"""

from __future__ import annotations

from meshtrain.planner.types import Plan

TIE = 1.02


def speed(plan: Plan) -> float:
    """Throughput, not step time: without training.global_batch_size the global batch
    grows with dp, so steps of different layouts hold different numbers of tokens."""
    return plan.time_estimate["tokens_per_s"]


def peak(p: Plan) -> int:
    return p.memory_estimate_per_rank["process_total"]


def versus(chosen: Plan, other: Plan) -> str:
    ratio = speed(chosen) / speed(other)
    if ratio > TIE:
        return f"{ratio:.2f}x slower"
    if ratio * TIE < 1:
        return f"{1 / ratio:.2f}x faster"
    return "the same speed within 2%"


def model_states(p: Plan) -> int:
    m = p.memory_estimate_per_rank
    return m["parameters"] + m["gradients"] + m["optimizer_states"]
