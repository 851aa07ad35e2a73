"""What a checkpoint costs the training: a checkpointing step and the four after it (so a
background writer that slows the next steps counts) against the same steps of a run that
never checkpoints; synchronous against asynchronous saves (`training.checkpoint_async`),
and a second run without checkpoints as the A/A control. Each side is the real Trainer on
2 ranks (dp2, ZeRO-1) in its own spawned group, checkpointing every 5 steps to this disk.

    PYTHONPATH=bench .venv/bin/python bench/checkpoints.py     # the 110M shape, ~12 min
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from bench_runs import planned_side, step_and_log, token_blocks, trainer_group, work_root
from shapes import SHAPES, hf_fields
from torch.distributed.elastic.multiprocessing.errors import record

from meshtrain.config import LaunchConfig
from meshtrain.launch.elastic import run_workers
from meshtrain.trainer import Trainer

EVERY = 5
SIDES = {"none": None, "sync": False, "async": True, "none-aa": None}  # checkpoint_async


@record
def entry(spec: Any) -> list[float] | None:
    """Rank 0's wall seconds of every step, its checkpoint (if it makes one) included."""
    with trainer_group(spec):
        rank, trainer, seconds = dist.get_rank(), Trainer(spec), []
        for step in range(trainer.cfg.max_steps):
            began = time.perf_counter()
            step_and_log(trainer, step)
            if (step + 1) % trainer.cfg.checkpoint_every == 0:
                trainer.checkpoint(step + 1)
            trainer.checkpointer.check()
            seconds.append(time.perf_counter() - began)
        trainer.checkpointer.wait()
    return seconds if rank == 0 else None


def run(args: argparse.Namespace, root: Path, blocks, side: str) -> list[float]:
    shape = SHAPES[args.shape]
    spec, _ = planned_side(
        blocks,
        root,
        side,
        world=2,
        parallel={"data_parallel_size": 2, "zero_1": True},
        training={
            "per_device_train_batch_size": shape["batch"],
            "max_steps": args.steps,
            "log_every": 1000,
            "checkpoint_every": EVERY if SIDES[side] is not None else 10_000,
            "checkpoint_async": bool(SIDES[side]),
        },
        shape=hf_fields(shape),
        vocab=shape["vocab"],
        block=shape["block"],
    )
    launch = LaunchConfig(nproc_per_node=2)
    return run_workers(entry, (spec,), launch, log_dir=root / "logs" / side, run_id=side)[0]


def windows(seconds: list[float]) -> float:
    """Every whole window of a checkpointing step and the four after it, from step 10
    (the first steps warm up)."""
    starts = range(2 * EVERY - 1, len(seconds) - EVERY + 1, EVERY)
    return sum(sum(seconds[start : start + EVERY]) for start in starts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="110m", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=20, help="steps per side")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        root = work_root(stack, args.work_dir, "meshtrain-bench-checkpoints-")
        shape = SHAPES[args.shape]
        blocks = token_blocks(root / "blocks", 64, shape["vocab"], shape["block"])
        measured = {}
        for side in SIDES:
            seconds = run(args, root, blocks, side)
            measured[side] = windows(seconds)
            steps = " ".join(f"{s:.2f}" for s in seconds)
            print(f"  {side:<8} {measured[side]:7.2f} s in the windows; steps: {steps}")
        for side in ("sync", "async", "none-aa"):
            print(f"{side:<8} {measured[side] / measured['none']:.2f}x a run without checkpoints")


if __name__ == "__main__":
    main()
