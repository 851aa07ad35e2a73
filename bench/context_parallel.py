"""Context parallelism on one long block: per-rank memory and tokens/s at cp 1, 2 and 4,
each beside the planner's estimate, measured side by side in one invocation.

The 27M-parameter Llama (bench/shapes.py `27m`) on blocks of `--block` tokens, one block
per step (global batch 1), every side meshtrain's own worker in its own spawned group.
Per side: the step's peak of live tensors on the busiest rank and the planner's estimate
of it; what of that peak the step made (the peak less the tensors that existed before
it: the model states), the activations that context parallelism divides; the run's
peak RSS; tokens/s. `cp1-again` is cp1 once more, the A/A control. Then the ratios to
cp1. With `--cap-gib`, the planner plans for a CPU of that much memory per rank: a side
it cannot fit is refused before any worker starts, and the table shows it refused.

    .venv/bin/python bench/context_parallel.py                     # block 8,192
    .venv/bin/python bench/context_parallel.py --block 2048 --steps 3   # the quick one
    .venv/bin/python bench/context_parallel.py --cap-gib 3 --sides cp1,cp4
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench_runs import MIB, SHAPE_27M, planned_side, run_side, token_blocks

from meshtrain.config_parsing import Refused

VOCAB = 4096


def side(
    blocks, root: Path, name: str, cp: int, steps: int, block: int, cap_gib: float | None
) -> tuple[dict, object] | str:
    """(rank 0's summary, the plan) of one side, or the planner's refusal."""
    planner = {"device": "cpu"}
    if cap_gib:
        planner["device_profiles"] = {"cpu": {"memory_gib": cap_gib}}
    try:
        spec, plan = planned_side(
            blocks,
            root,
            name,
            world=cp,
            parallel={
                "data_parallel_size": 1,
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "context_parallel_size": cp,
                "zero_1": False,
            },
            training={"per_device_train_batch_size": 1, "max_steps": steps},
            shape={**SHAPE_27M, "max_position_embeddings": block},
            vocab=VOCAB,
            block=block,
            planner=planner,
        )
    except Refused as refusal:
        return " ".join(line.strip(" -") for line in str(refusal).splitlines()[1:3])
    return run_side(spec, cp, root, name), plan


def row(name: str, summary: dict, plan) -> tuple[float, float, float]:
    """Print one side's line; returns (step peak, step-made, tokens/s)."""
    measured = summary["measured_peak_memory"]
    worst = measured["peak_rank"]
    peak = measured["peak_bytes"]
    made = peak - measured["at_peak_per_rank"][worst].get("existing", 0)
    predicted = plan.memory_estimate_per_rank["total"]
    rss = max(summary["peak_rss_mb_per_rank"])
    speed = summary["mean_tokens_per_s"] or float("nan")
    print(
        f"{name:<12}{peak / MIB:>11,.0f}{predicted / MIB:>10,.0f}{predicted / peak:>9.3f}"
        f"{made / MIB:>12,.0f}{rss:>10,.0f}{speed:>10,.0f}{summary['final_loss']:>10.4f}"
    )
    return peak, made, speed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=4, help="the memory probe takes step 2")
    parser.add_argument("--sides", default="cp1,cp2,cp4,cp1-again")
    parser.add_argument("--cap-gib", type=float, help="plan for a CPU of this much memory")
    args = parser.parse_args()
    results: dict[str, tuple | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        blocks = token_blocks(root / "blocks", args.steps + 6, VOCAB, args.block, learnable=False)
        for name in args.sides.split(","):
            cp = int(name.removesuffix("-again").removeprefix("cp"))
            results[name] = side(blocks, root, name, cp, args.steps, args.block, args.cap_gib)
    print(f"\n27M, one block of {args.block:,} tokens a step; MiB per rank (the busiest)")
    print(
        f"{'side':<12}{'step peak':>11}{'planner':>10}{'pl/peak':>9}{'step-made':>12}"
        f"{'RSS':>10}{'tokens/s':>10}{'loss':>10}"
    )
    table = {}
    for name, result in results.items():
        if isinstance(result, str):
            print(f"{name:<12}refused by the planner: {result}")
        else:
            table[name] = row(name, *result)
    base = table.get("cp1")
    if base is None:
        return
    for name, (peak, made, speed) in table.items():
        if name != "cp1":
            print(
                f"{name} / cp1: step peak {peak / base[0]:.3f}, step-made {made / base[1]:.3f}, "
                f"tokens/s {speed / base[2]:.3f}"
            )


if __name__ == "__main__":
    main()
