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
from meshtrain.planner.devices import GIB
from meshtrain.planner.types import Plan

# Preference among layouts whose estimated step times are within this factor of the best.
TIE = 1.02


def speed(plan: Plan) -> float:
    """Throughput, not step time: without training.global_batch_size the global batch
    grows with dp, so steps of different layouts hold different numbers of tokens."""
    return plan.time_estimate["tokens_per_s"]


def candidates(planned: list[Plan], chosen: Plan, budget: float) -> list[dict[str, Any]]:
    """Every other planned layout, fastest first, with why it lost to `chosen`."""
    found: list[dict[str, Any]] = []
    fastest = max((p for p in planned if _peak(p) <= budget), key=speed, default=chosen)
    for p in sorted(planned, key=speed, reverse=True):
        if p is chosen:
            continue
        why = _lost_because(p, chosen, fastest, budget) + _sharding_clause(p, planned, budget)
        found.append(summary(p) | {"lost_because": why})
    return found


def _lost_because(p: Plan, chosen: Plan, fastest: Plan, budget: float) -> str:
    ratio = speed(chosen) / speed(p)
    if _peak(p) > budget:
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
    keys = (
        ("context_parallel_size", "less context parallelism", "cp"),
        ("tensor_parallel_size", "less tensor parallelism", "tp"),
        ("pipeline_parallel_size", "less pipeline parallelism", "pp"),
        ("sharded_data_parallel_degree", "less sharding (paid only when it buys memory)", "sdp"),
    )
    for field, words, short in keys:
        mine, theirs = getattr(chosen, field), getattr(other, field)
        if mine != theirs:
            return f"{words}: {short}{mine} against {short}{theirs}"
    if chosen.activation_checkpointing != other.activation_checkpointing:
        return (
            f"less recomputation: activation checkpointing {chosen.activation_checkpointing} "
            f"against {other.activation_checkpointing}"
        )
    return "the same sizes, and came first"


def _sharding_clause(p: Plan, planned: list[Plan], budget: float) -> str:
    """What sharding did for (or cost) this layout, when that is part of why it lost."""
    if p.layout.sharded:
        if _peak(p) > budget:
            return ""
        t = p.time_estimate
        return (
            f"; sdp{p.layout.sharded_data_parallel_degree}: model states "
            f"{_model_states(p) / GIB:.2f} GiB + "
            f"{p.memory_estimate_per_rank.get('gathered', 0) / GIB:.2f} GiB gathered, "
            f"collectives {_collectives(t):.2f} s per step "
            f"({t.get('sdp_exposed_s', 0.0):.2f} s exposed)"
        )
    sibling = _sharded_sibling(p.layout, planned, budget)
    if sibling is not None and _peak(p) > budget:
        return (
            f"; sharded as {sibling.layout.name} it needs "
            f"{sibling.memory_estimate_per_rank['total'] / GIB:.2f} GiB"
        )
    return ""


def sharding_note(chosen: Plan, planned: list[Plan], budget: float) -> str | None:
    """Why the chosen layout does or does not shard, against its own twin the other way."""
    lay = chosen.layout
    if lay.sharded:
        twin = _twin(lay, planned, sharded=1)
        verdict = f"sharded data parallelism ({_kind(lay)}) is chosen: {_sharding_cost(chosen)}"
        if twin is None:
            return verdict
        if _peak(twin) > budget:
            return (
                f"{verdict}; unsharded, {twin.layout.name} needs "
                f"{twin.memory_estimate_per_rank['total'] / GIB:.2f} GiB per rank, over the "
                f"{budget / GIB:.2f} GiB budget (model states "
                f"{_model_states(twin) / GIB:.2f} GiB against {_model_states(chosen) / GIB:.2f})"
            )
        return f"{verdict}; unsharded, {twin.layout.name} fits but is {_versus(chosen, twin)}"
    sibling = _sharded_sibling(lay, planned, budget)
    if sibling is None:
        return None
    return (
        f"not sharded: this layout fits without it, and {sibling.layout.name} would hold "
        f"{_model_states(sibling) / GIB:.2f} GiB of model states instead of "
        f"{_model_states(chosen) / GIB:.2f} at {_versus(chosen, sibling)} "
        f"({_sharding_cost(sibling)})"
    )


def summary(plan: Plan) -> dict[str, Any]:
    return {
        "layout": plan.layout.name,
        "memory_per_rank_bytes": plan.memory_estimate_per_rank["process_total"],
        "step_s": plan.time_estimate["step_s"],
        "tokens_per_s": plan.time_estimate["tokens_per_s"],
    }


def _sharding_cost(p: Plan) -> str:
    t = p.time_estimate
    return (
        f"sdp{p.layout.sharded_data_parallel_degree} holds "
        f"{_model_states(p) / GIB:.2f} GiB of model states and "
        f"{p.memory_estimate_per_rank.get('gathered', 0) / GIB:.2f} GiB gathered, and its "
        f"all-gathers and reduce-scatters take {_collectives(t):.2f} s per step, "
        f"{t.get('sdp_exposed_s', 0.0):.2f} s of it not hidden behind compute"
    )


def _kind(lay: Layout) -> str:
    n, dp, cp = lay.sharded_data_parallel_degree, lay.data_parallel_size, lay.context_parallel_size
    over = f" x {cp} context-parallel" if cp > 1 else ""
    if n == dp:
        return f"full sharding over the {dp} data-parallel{over} ranks, which includes ZeRO-1"
    return f"hybrid: sharded within groups of {n}{over} ranks, {dp // n} replicas"


def _behind(fastest: Plan, p: Plan) -> str:
    return (
        f"more than 2% behind the fastest, {fastest.layout.name} ({speed(fastest) / speed(p):.3f}x)"
    )


def _versus(chosen: Plan, other: Plan) -> str:
    ratio = speed(chosen) / speed(other)
    if ratio > TIE:
        return f"{ratio:.2f}x slower"
    if ratio * TIE < 1:
        return f"{1 / ratio:.2f}x faster"
    return "the same speed within 2%"


def _sharded_sibling(lay: Layout, planned: list[Plan], budget: float) -> Plan | None:
    """The fastest sharded layout fitting the budget that differs from `lay` only there."""
    twins = [
        p
        for p in planned
        if p.layout.sharded and _peak(p) <= budget and _same_but_sharding(p.layout, lay)
    ]
    return max(twins, key=speed, default=None)


def _twin(lay: Layout, planned: list[Plan], *, sharded: int) -> Plan | None:
    return next(
        (
            p
            for p in planned
            if p.layout.sharded_data_parallel_degree == sharded
            and _same_but_sharding(p.layout, lay)
        ),
        None,
    )


def _same_but_sharding(a: Layout, b: Layout) -> bool:
    return (
        a.data_parallel_size,
        a.tensor_parallel_size,
        a.pipeline_parallel_size,
        a.context_parallel_size,
        a.activation_checkpointing,
    ) == (
        b.data_parallel_size,
        b.tensor_parallel_size,
        b.pipeline_parallel_size,
        b.context_parallel_size,
        b.activation_checkpointing,
    )


def _model_states(p: Plan) -> int:
    m = p.memory_estimate_per_rank
    return m["parameters"] + m["gradients"] + m["optimizer_states"]


def _collectives(t: dict[str, float]) -> float:
    return (
        t.get("sdp_all_gather_s", 0.0)
        + t.get("sdp_reduce_scatter_s", 0.0)
        + t.get("sdp_replica_all_reduce_s", 0.0)
    )


def _peak(p: Plan) -> int:
    return p.memory_estimate_per_rank["process_total"]


# cp is weighed where activations and loss are at least this share of the step's tensors,
# or blocks are at least this long (attention's K/V exchange is then small beside its
# compute, and a sequence's activations are what grows); not for conf/base's 128 tokens.
CP_WORTH_WEIGHING = 0.5
CP_LONG_BLOCK = 16384


def context_parallel_wanted(without_cp: list[Plan], budget: float, block_size: int) -> str | None:
    """Why `context_parallel_size: auto` should weigh cp > 1 beside the layouts planned
    without it, or None: where no layout fits, where what cp divides (activations and
    loss) is at least half the best fitting layout's step tensors, or for long blocks."""
    fitting = [p for p in without_cp if _peak(p) <= budget]
    if not fitting:
        return f"no layout without it fits the {budget / GIB:.2f} GiB budget"
    best = max(fitting, key=speed)
    share = _per_token_share(best)
    if share >= CP_WORTH_WEIGHING:
        return f"activations and loss are {share:.0%} of {best.layout.name}'s step tensors"
    if block_size >= CP_LONG_BLOCK:
        return f"blocks of {block_size:,} tokens, at least {CP_LONG_BLOCK:,}"
    return None


def context_note(
    chosen: Plan, planned: list[Plan], without_cp: list[Plan], budget: float, reason: str | None
) -> str:
    """Why `context_parallel_size: auto` came out as it did, against the other side."""
    cp = chosen.layout.context_parallel_size
    head = f"parallel.context_parallel_size=auto: cp{cp}"
    if reason is None:
        return (
            f"{head}, larger sizes not weighed: activations and loss, which cp divides, are "
            f"{_per_token_share(chosen):.0%} of the step's tensors and blocks are shorter "
            f"than {CP_LONG_BLOCK:,} tokens"
        )
    with_cp = [p for p in planned if p.layout.context_parallel_size > 1 and _peak(p) <= budget]
    fits = [p for p in without_cp if _peak(p) <= budget]
    if cp == 1:
        rival = max(with_cp, key=speed, default=None)
        if rival is None:
            return f"{head} ({reason}); no cp layout runs here or fits either"
        return (
            f"{head} ({reason}); the fastest cp layout, {rival.layout.name}, is "
            f"{_versus(chosen, rival)}"
        )
    t, memory = chosen.time_estimate, chosen.memory_estimate_per_rank
    masks = memory.get("context_mask", 0)
    exchange = (
        f"cp{cp}'s K/V exchange takes {t.get('context_parallel_s', 0.0):.2f} s per step, none "
        f"hidden behind compute; activations {memory['activations'] / GIB:.2f} GiB, of which "
        f"gathered K/V {memory.get('context_kv', 0) / GIB:.2f}"
        + (f" and masks {masks / GIB:.2f}" if masks else "")
    )
    if not fits:
        return f"{head}: {reason}; {exchange}"
    best = max(fits, key=speed)
    fastest = max([*with_cp, *fits], key=speed)
    # A cp layout wins only where no layout without cp ties with the fastest.
    tie = (
        f" and {speed(fastest) / speed(best):.3f}x behind the fastest, {fastest.layout.name}, "
        "outside the 2% tie-break"
        if fastest is not chosen
        else ""
    )
    return (
        f"{head} ({reason}); the fastest layout without cp, {best.layout.name}, is "
        f"{speed(chosen) / speed(best):.3f}x slower{tie}: step {_step_parts(best)} against "
        f"{_step_parts(chosen)}; {exchange}"
    )


def _step_parts(p: Plan) -> str:
    """A step's seconds and their nonzero parts, e.g. `66.92 s (compute 65.01, tp 1.89)`."""
    t = p.time_estimate
    parts = (
        ("compute", "compute_s"),
        ("tp", "tensor_parallel_s"),
        ("cp", "context_parallel_s"),
        ("pp", "pipeline_s"),
        ("dp", "data_parallel_s"),
    )
    named = [f"{short} {t[key]:.2f}" for short, key in parts if t.get(key, 0.0) >= 0.005]
    return f"{t['step_s']:.2f} s ({', '.join(named)})"


def _per_token_share(p: Plan) -> float:
    m = p.memory_estimate_per_rank
    return (m["activations"] + m["loss"]) / max(1, m["total"])
