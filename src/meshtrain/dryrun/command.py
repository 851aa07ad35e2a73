"""`python -m meshtrain dryrun`: the planned layout's real code for chosen ranks, on fake
tensors, beside the planner's estimate.

    python -m meshtrain dryrun --model examples/model_configs/llama-3.1-8b.json \
        --devices 8 --device h100 --seq-len 8192 --global-batch 8 --bf16 --sdp 8 --dp 8

Takes `plan`'s flags; plans, then runs each chosen rank's training step (`dryrun.rank`)
and prints, per rank, the step's peak and its model states term by term against the
planner's, with the difference, where the step peaked, and this process's own peak
resident memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource

import torch

from meshtrain.config import RunConfig
from meshtrain.dryrun import pipeline
from meshtrain.dryrun.fake_world import dry_run_device
from meshtrain.dryrun.rank import RankMemory, dry_run_rank
from meshtrain.planner import Plan
from meshtrain.planner.command import plan_from_args
from meshtrain.planner.devices import GIB

log = logging.getLogger(__name__)
STATES = ("parameters", "gradients", "optimizer_states")
PIPELINES_NOT_YET = (
    f"this torch ({torch.__version__}) sets its pipeline stages up in a way the dry run "
    "does not settle (it follows torch 2.13's `_warmup_p2p`): fix --pp 1 to dry-run the "
    "other axes, or dry-run with torch 2.13"
)


def run_dryrun(args: argparse.Namespace) -> int:
    planned = plan_from_args(args)
    if isinstance(planned, str):
        print(f"error: {planned}")
        return 1
    run, plan = planned
    if why := why_not_here(plan):
        print(f"error: {plan.layout.name}: {why}")
        return 1
    ranks = args.rank or busiest_ranks(plan)
    if bad := [r for r in ranks if not 0 <= r < plan.world_size]:
        print(f"error: --rank {bad}: the world has ranks 0 to {plan.world_size - 1}")
        return 1
    device, why = dry_run_device(plan.device)
    print(f"{plan.layout.name} on {plan.world_size} x {plan.device}; {why}", flush=True)
    results = []
    for rank in ranks:
        memory = dry_run_rank(run, plan, rank, device)
        results.append(compare(memory, plan))
        if not args.json:
            print(describe(results[-1], memory), flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if args.json:
        print(json.dumps({"layout": plan.layout.name, "ranks": results, "peak_rss": rss}))
    else:
        print(f"this process's peak resident memory: {rss / GIB:.2f} GiB")
    return 0


def dry_run_plan(run: RunConfig, plan: Plan) -> list[dict]:
    """`planner.dry_run`: the busiest ranks' comparisons, for plan.json and MLflow (none,
    with a warning, where the dry run cannot run the plan: `why_not_here`)."""
    if why := why_not_here(plan):
        log.warning("no dry run of %s: %s", plan.layout.name, why)
        return []
    device, why = dry_run_device(plan.device)
    log.info("dry run of %s: %s", plan.layout.name, why)
    ranks = [dry_run_rank(run, plan, rank, device) for rank in busiest_ranks(plan)]
    return [compare(memory, plan) for memory in ranks]


def why_not_here(plan: Plan) -> str | None:
    """Why the dry run cannot run the plan here (None: it can): a pipeline needs torch
    2.13's schedules."""
    if plan.layout.pipeline_parallel_size > 1 and not pipeline.supported():
        return PIPELINES_NOT_YET
    return None


def busiest_ranks(plan: Plan) -> list[int]:
    """The first rank of the first and the last pipeline stage, and of the pipeline rank
    the planner finds busiest (the other dp and tp ranks hold the same shapes)."""
    layout = plan.layout
    per_stage = plan.world_size // layout.pipeline_parallel_size
    peak = plan.memory_estimate_per_rank.get("peak_pipeline_rank", 0)
    stages = sorted({0, layout.pipeline_parallel_size - 1, peak})
    return [stage * per_stage for stage in stages]


def compare(memory: RankMemory, plan: Plan) -> dict:
    """The dry run's terms beside the planner's for that pipeline rank, with the ratio."""
    estimate = plan.memory_estimate_per_rank
    pp_rank = memory.coordinates["pp"]
    planned_total = estimate["total_per_pipeline_rank"][pp_rank]
    terms = {"step_peak": (memory.peak_bytes, planned_total)}
    if pp_rank == estimate["peak_pipeline_rank"]:  # the planner breaks down that one only
        for name in STATES:
            terms[name] = (memory.model_states[name], estimate[name])
        planned_rest = planned_total - sum(estimate[name] for name in STATES)
        terms["beyond_model_states"] = (memory.beyond_model_states, planned_rest)
    return {
        "rank": memory.rank,
        **memory.coordinates,
        "seconds": round(memory.seconds, 1),
        "peak_at": memory.peak_at,
        "at_peak": memory.at_peak,
        "by_module": memory.by_module,
        "terms": {
            name: {"dry_run": dry, "planner": plan_, "planner_over_dry_run": plan_ / dry}
            for name, (dry, plan_) in terms.items()
            if dry
        },
    }


def describe(result: dict, memory: RankMemory) -> str:
    """One rank's comparison as a person reads it."""
    cp = f"cp {result['cp']}, " if "cp" in result else ""
    lines = [
        f"rank {result['rank']} (pp {result['pp']}, dp {result['dp']}, {cp}tp {result['tp']}), "
        f"{result['seconds']} s; peak at {result['peak_at'] or 'the step'}",
        f"  {'term':22} {'dry run':>10} {'planner':>10} {'planner/dry':>12}",
    ]
    for name, term in result["terms"].items():
        lines.append(
            f"  {name:22} {term['dry_run'] / GIB:8.2f} G {term['planner'] / GIB:8.2f} G "
            f"{term['planner_over_dry_run']:12.3f}"
        )
    parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in memory.at_peak.items())
    lines.append(f"  at the peak, GiB: {parts}")
    largest = sorted(memory.by_module.items(), key=lambda item: -item[1])[:6]
    made = ", ".join(f"{name} {nbytes / GIB:.2f}" for name, nbytes in largest)
    lines.append(f"  made in the step and live at the peak, GiB: {made}")
    return "\n".join(lines)
