"""fp32 against bf16 autocast against bf16 parameters with fp32 master weights, at dp2.

The 27M-parameter Llama of the speed issue (hidden 512, intermediate 1344, 8 layers,
8 heads, 4 KV heads, vocab 4096, blocks of 256, per-device batch 4) on 2 ranks with
ZeRO-1, each precision run in turn in one invocation, fp32 twice (first and last: the
A/A control of this noisy machine). Per side: the model states one rank holds (its flat
parameter and gradient buffers and the optimizer's states, counted from the tensors) and
the planner's figure for them, the step's measured peak of live tensors against the
planner's, every rank's peak resident set (VmHWM), steady-state tokens/s and the last
loss.

    .venv/bin/python bench/mixed_precision.py [--steps 6] [--sides no,bf16,bf16_master,no]

Prints a table and the ratios; asserts nothing. On these CPUs (no bf16 matmul units) both
bf16 precisions are far slower than fp32; what they buy is memory, and on accelerators
speed. About 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from bench_runs import (
    SHAPE_27M,
    planned_side,
    print_side_table,
    run_side,
    token_blocks,
)

VOCAB, BLOCK, WORLD, PER_DEVICE = 4096, 256, 2, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sides", default="no,bf16,bf16_master,no")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        blocks = token_blocks(root / "blocks", WORLD * PER_DEVICE * args.steps + 8, VOCAB, BLOCK)
        for i, precision in enumerate(args.sides.split(",")):
            name = f"{i}-{precision}"
            spec, plan = planned_side(
                blocks,
                root,
                name,
                world=WORLD,
                parallel={"data_parallel_size": WORLD, "zero_1": True},
                training={
                    "per_device_train_batch_size": PER_DEVICE,
                    "max_steps": args.steps,
                    "mixed_precision": precision,
                },
                shape=SHAPE_27M,
                vocab=VOCAB,
                block=BLOCK,
            )
            rows.append((name, run_side(spec, WORLD, root, name), plan))
    _report(rows)


def _report(rows: list[tuple[str, dict, Any]]) -> None:
    states, speed = print_side_table(rows)
    names = list(speed)
    fp32 = [n for n in names if n.endswith("-no")]
    if len(fp32) >= 2:
        print(f"A/A control, fp32 tokens/s last / first: {speed[fp32[-1]] / speed[fp32[0]]:.3f}")
    if fp32:
        for name in names:
            if not name.endswith("-no"):
                print(
                    f"{name} / fp32: tokens/s {speed[name] / speed[fp32[0]]:.3f}, model states "
                    f"{states[name] / states[fp32[0]]:.3f}"
                )


if __name__ == "__main__":
    main()
