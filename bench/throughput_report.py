"""The tables and ratios `bench/throughput.py` prints (no pass/fail: the A/A ratio beside
each ratio says what the noise was). Not a benchmark itself."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

Runs = dict[str, dict[str, list]]  # side -> tokens_per_s / median_tokens_per_s / layout
Limits = dict[tuple[int, int], dict[str, Any]]  # (processes, threads) -> a gemm_rate


def report(
    args: argparse.Namespace,
    runs: dict[int, Runs],
    limits: list[Limits],
    arrangements: dict[int, tuple[int, int]],
    flops_per_token: int,
    labels: dict[str, str],
) -> list[str]:
    """The machine limit, then each world's table and ratios. `limits`: the
    GEMM readings in the order taken (start, before each repeat, end); an arrangement's
    MFU base is the mean of its readings."""
    readings: dict[tuple[int, int], list[float]] = {}
    for limit in limits:
        for key, rate in limit.items():
            readings.setdefault(key, []).append(rate["gflops"])
    gemm = {key: statistics.fmean(values) for key, values in readings.items()}
    lines = [
        "",
        "machine limit: fp32 GEMM GFLOP/s (the faster of torch.mm and oneDNN), summed over "
        "concurrent processes",
    ]
    for (processes, threads), rate in gemm.items():
        taken = ", ".join(f"{value:,.1f}" for value in readings[processes, threads])
        lines.append(
            f"  {processes} process(es) x {threads} thread(s): {taken} (start, before each "
            f"repeat, end); mean {rate:,.1f} (the MFU base)"
        )
    for world, sides in runs.items():
        rate = gemm[arrangements[world]]
        lines += world_table(args, world, sides, arrangements[world], rate, flops_per_token, labels)
        lines += ratio_lines(sides, labels)
    return lines


def _mean(sides: Runs, key: str = "tokens_per_s") -> dict[str, float]:
    return {side: statistics.fmean(values[key]) for side, values in sides.items()}


def world_table(
    args: argparse.Namespace,
    world: int,
    sides: Runs,
    arrangement: tuple[int, int],
    gemm: float,
    flops_per_token: int,
    labels: dict[str, str],
) -> list[str]:
    """One row per side: its layout, tokens/s per repeat and mean, at the median step,
    model GFLOP/s and that over the GEMM rate of the same processes x threads."""
    mean, median = _mean(sides), _mean(sides, "median_tokens_per_s")
    processes, threads = arrangement
    reps = " | ".join(f"rep {r + 1}" for r in range(args.repeats))
    lines = [
        "",
        f"{world} process(es): global batch {args.batch * world} x {args.block} tokens, "
        f"{args.steps} timed steps after {args.warmup} warm-up, {threads} thread(s) per "
        f"process; tokens/s; model GFLOP/s = mean tokens/s x {flops_per_token:,} FLOPs; "
        f"MFU vs the {processes}x{threads} GEMM rate, {gemm:,.1f} GFLOP/s",
        f"| side | layout | {reps} | mean | at the median step (mean) | model GFLOP/s | "
        "MFU vs GEMM |",
        "|---|---|" + "---:|" * (args.repeats + 4),
    ]
    for side, values in sides.items():
        cells = " | ".join(f"{v:,.0f}" for v in values["tokens_per_s"])
        achieved = mean[side] * flops_per_token / 1e9
        lines.append(
            f"| {labels[side]} | {', '.join(sorted(set(values['layout'])))} | {cells} | "
            f"{mean[side]:,.0f} | {median[side]:,.0f} | {achieved:,.1f} | {achieved / gemm:.3f} |"
        )
    return lines


def reference_side(sides: Runs) -> str:
    """The side the others are divided by: `meshtrain`, or the first one run (`--sides`)."""
    return "meshtrain" if "meshtrain" in sides else next(iter(sides))


def control(sides: Runs) -> str:
    """The A/A ratio, the reference side run again over itself (this invocation's noise)."""
    ours = reference_side(sides)
    if f"{ours}_again" not in sides:
        return "A/A not measured (--control)"
    mean = _mean(sides)
    again, first = sides[f"{ours}_again"]["tokens_per_s"], sides[ours]["tokens_per_s"]
    per_repeat = ", ".join(f"{a / m:.3f}" for a, m in zip(again, first, strict=True))
    return f"A/A {mean[f'{ours}_again'] / mean[ours]:.3f}x (per repeat: {per_repeat})"


def ratio_lines(sides: Runs, labels: dict[str, str]) -> list[str]:
    """The reference side over every other side: of the means, per repeat, at the median
    step."""
    mean, median = _mean(sides), _mean(sides, "median_tokens_per_s")
    name = reference_side(sides)
    ours = sides[name]["tokens_per_s"]
    lines = []
    for other in sides:
        if other in (name, f"{name}_again"):
            continue
        paired = [m / o for m, o in zip(ours, sides[other]["tokens_per_s"], strict=True)]
        lines.append(
            f"{labels[name]} / {labels[other]}: {mean[name] / mean[other]:.3f}x "
            f"(per repeat: {', '.join(f'{r:.3f}' for r in paired)}; at the median step "
            f"time: {median[name] / median[other]:.3f}x); {control(sides)}"
        )
    return lines
