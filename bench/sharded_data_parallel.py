"""Sharded data parallelism (FSDP2) against ZeRO-1 and plain data parallelism.

The 27M-parameter Llama of the speed issue (hidden 512, intermediate 1344, 8 layers,
8 heads, 4 KV heads, vocab 4096, blocks of 256), fp32, each side its own spawned group,
in turn, in one invocation:

* memory at dp4 (per-device batch 2): plain dp, ZeRO-1, hybrid sharding over groups of
  2 (sdp2) and full sharding (sdp4). Per side: the model states one rank holds
  (parameters, gradients, AdamW moments, counted from the tensors) and the planner's
  figure for them, the step's measured peak of live tensors and the planner's predicted
  peak, every rank's peak resident set (VmHWM);
* speed: sharded against ZeRO-1 at dp2 (per-device batch 4) and dp4, tokens/s in steady
  state, with ZeRO-1 at dp2 run first and again last as the A/A control.

    .venv/bin/python bench/sharded_data_parallel.py [--steps 8]

Prints a table and the ratios; asserts nothing. About 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench_runs import SHAPE_27M, planned_side, print_side_table, run_side, token_blocks

VOCAB, BLOCK = 4096, 256
SDP = "sharded_data_parallel_degree"
# name: (world, parallel, per-device batch)
SIDES = {
    "dp2-zero1": (2, {"data_parallel_size": 2, "zero_1": True}, 4),
    "dp4-plain": (4, {"data_parallel_size": 4, "zero_1": False}, 2),
    "dp4-zero1": (4, {"data_parallel_size": 4, "zero_1": True}, 2),
    "dp4-sdp2": (4, {"data_parallel_size": 4, SDP: 2}, 2),
    "dp4-sdp4": (4, {"data_parallel_size": 4, SDP: 4}, 2),
    "dp2-sdp2": (2, {"data_parallel_size": 2, SDP: 2}, 4),
    "dp2-zero1-again": (2, {"data_parallel_size": 2, "zero_1": True}, 4),
    # Sharding under a pipeline (kept gathered through the step), for the memory model.
    "dp2-pp2-sdp2": (
        4,
        {"data_parallel_size": 2, "pipeline_parallel_size": 2, SDP: 2},
        4,
    ),
}
DEFAULT_SIDES = [name for name in SIDES if name != "dp2-pp2-sdp2"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sides", default=",".join(DEFAULT_SIDES), help=",".join(SIDES))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        blocks = token_blocks(root / "blocks", 8 * args.steps + 8, VOCAB, BLOCK)
        for name in args.sides.split(","):
            world, parallel, per_device = SIDES[name]
            spec, plan = planned_side(
                blocks,
                root,
                name,
                world=world,
                parallel=parallel,
                training={"per_device_train_batch_size": per_device, "max_steps": args.steps},
                shape=SHAPE_27M,
                vocab=VOCAB,
                block=BLOCK,
            )
            rows.append((name, run_side(spec, world, root, name), plan))
    report(rows)


def report(rows: list) -> None:
    states, speed = print_side_table(rows)
    if "dp2-zero1" in speed and "dp2-zero1-again" in speed:
        control = speed["dp2-zero1-again"] / speed["dp2-zero1"]
        print(f"A/A control, dp2 ZeRO-1 tokens/s last / first: {control:.3f}")
    for sharded, against in (("dp4-sdp4", "dp4-zero1"), ("dp4-sdp4", "dp4-plain")):
        if sharded in states and against in states:
            print(f"model states {sharded} / {against}: {states[sharded] / states[against]:.3f}")
    for sharded, against in (("dp2-sdp2", "dp2-zero1"), ("dp4-sdp4", "dp4-zero1")):
        if sharded in speed and against in speed:
            print(f"tokens/s {sharded} / {against}: {speed[sharded] / speed[against]:.3f}")


if __name__ == "__main__":
    main()
