"""Why the planner chose what it chose: each runner-up's reason, and the verdicts on
sharding and on context parallelism.

The search (`meshtrain.planner.search`) ranks the layouts; this module only puts the
ranking into words, for `Plan.candidates` and the plan's notes, so a reader sees what
each layout would have cost and, for sharded data parallelism, what it buys (model
states divided by N) against what it costs (all-gathers and reduce-scatters).
"""

from __future__ import annotations

from typing import Any

from meshtrain.config import Layout
from meshtrain.planner.axes import AXES, TIE_BREAK
from meshtrain.planner.devices import GIB
from meshtrain.planner.ranking import TIE, peak, speed
from meshtrain.planner.types import Plan


def candidates(planned: list[Plan], chosen: Plan, budget: float) -> list[dict[str, Any]]:
    """Every other planned layout, fastest first, with why it lost to `chosen`."""
    found: list[dict[str, Any]] = []
    fastest = max((p for p in planned if peak(p) <= budget), key=speed, default=chosen)
    for p in sorted(planned, key=speed, reverse=True):
        if p is chosen:
            continue
        why = _lost_because(p, chosen, fastest, budget) + "".join(
            axis.lost_clause(p, planned, budget) for axis in AXES
        )
        found.append(summary(p) | {"lost_because": why})
    return found


def _lost_because(p: Plan, chosen: Plan, fastest: Plan, budget: float) -> str:
    ratio = speed(chosen) / speed(p)
    if peak(p) > budget:
        return (
            f"does not fit: {p.memory_estimate_per_rank['total'] / GIB:.2f} GiB per rank "
            f"over the {budget / GIB:.2f} GiB budget"
        )
    if ratio > TIE:
        return f"slower: the chosen layout's estimated tokens/s is {ratio:.2f}x"
    if speed(p) * TIE < speed(fastest):
        # Ties are measured against the fastest: within 2% of the chosen one is not enough.
        return (
            f"slower: {ratio:.3f}x behind the chosen layout and {_behind(fastest, p)}, "
            "outside the tie-break"
        )
    return f"as fast within 2%; the chosen one has {_preferred_because(chosen.layout, p.layout)}"


def _preferred_because(chosen: Layout, other: Layout) -> str:
    """The first tie-breaker (tp, pp, sharding, recomputation) that told the two apart."""
    for degree, words, short in TIE_BREAK:
        mine, theirs = degree(chosen), degree(other)
        if mine != theirs:
            return f"{words}: {short}{mine} against {short}{theirs}"
    if chosen.activation_checkpointing != other.activation_checkpointing:
        return (
            f"less recomputation: activation checkpointing {chosen.activation_checkpointing} "
            f"against {other.activation_checkpointing}"
        )
    return "the same sizes, and came first"


def summary(plan: Plan) -> dict[str, Any]:
    return {
        "layout": plan.layout.name,
        "memory_per_rank_bytes": plan.memory_estimate_per_rank["process_total"],
        "step_s": plan.time_estimate["step_s"],
        "tokens_per_s": plan.time_estimate["tokens_per_s"],
    }


def _behind(fastest: Plan, p: Plan) -> str:
    return (
        f"more than 2% behind the fastest, {fastest.layout.name} ({speed(fastest) / speed(p):.3f}x)"
    )
