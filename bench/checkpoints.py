"""What a checkpoint costs the training: the wall time of a checkpointing step and the
four steps after it (so a background writer that slows the next steps on 2 cores is
counted), over the same five steps of a run that never checkpoints, synchronous saves
against asynchronous ones (`training.checkpoint_async`), with an A/A control (a second
run without checkpoints).

    PYTHONPATH=bench .venv/bin/python bench/checkpoints.py            # the 110M shape
    PYTHONPATH=bench .venv/bin/python bench/checkpoints.py --block 128 --steps 15

Each side is the real Trainer on 2 ranks (dp2, ZeRO-1), its own spawned group, the
sides in turn; checkpoints every 5 steps into a temporary folder on this disk.
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
SIDES = {"none": None, "sync": False, "async": True, "none (A/A)": None}


@record
def entry(spec: Any) -> list[float] | None:
    """Every step's wall seconds, the checkpoint (when the step makes one) included;
    rank 0's."""
    with trainer_group(spec):
        rank, trainer = dist.get_rank(), Trainer(spec)
        seconds = []
        for step in range(trainer.cfg.max_steps):
            began = time.perf_counter()
            step_and_log(trainer, step)
            if (step + 1) % trainer.cfg.checkpoint_every == 0:
                trainer.checkpoint(step + 1)
            trainer.checkpointer.check()
            seconds.append(time.perf_counter() - began)
        trainer.checkpointer.wait()
    return seconds if rank == 0 else None


def run(args: argparse.Namespace, root: Path, blocks, name: str, async_save: bool | None):
    shape = {k: v for k, v in SHAPES[args.shape].items() if k in ("vocab", "block", "batch")}
    block, batch = args.block or shape["block"], args.batch or shape["batch"]
    tag = name.split()[0] + ("-aa" if "A/A" in name else "")
    spec, plan = planned_side(
        blocks,
        root,
        tag,
        world=2,
        parallel={"data_parallel_size": 2, "zero_1": True},
        training={
            "per_device_train_batch_size": batch,
            "max_steps": args.steps,
            "log_every": 1000,
            "checkpoint_every": EVERY if async_save is not None else 10_000,
            "checkpoint_async": bool(async_save),
            "keep_last": 1,
        },
        shape=hf_fields(SHAPES[args.shape]),
        vocab=shape["vocab"],
        block=block,
    )
    launch = LaunchConfig(nproc_per_node=2)
    results = run_workers(entry, (spec,), launch, log_dir=root / "logs" / tag, run_id=tag)
    return results[0], plan


def windows(seconds: list[float]) -> float:
    """The seconds of every whole window: a checkpointing step and the four after it,
    from step 10 (the first steps warm up; the first checkpoint, at step 5, is left out)."""
    starts = range(2 * EVERY - 1, len(seconds) - EVERY + 1, EVERY)  # 0-based: steps 10, 15..
    return sum(sum(seconds[start : start + EVERY]) for start in starts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="110m", choices=sorted(SHAPES))
    parser.add_argument("--block", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=20, help="steps per side")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        root = work_root(stack, args.work_dir, "meshtrain-bench-checkpoints-")
        shape = SHAPES[args.shape]
        blocks = token_blocks(root / "blocks", 64, shape["vocab"], args.block or shape["block"])
        measured = {}
        for name, async_save in SIDES.items():
            seconds, plan = run(args, root, blocks, name, async_save)
            measured[name] = windows(seconds)
            steps = " ".join(f"{s:.2f}" for s in seconds)
            print(f"  {name:<11} {measured[name]:7.2f} s in the windows; steps: {steps}")
        print(f"{plan.layout.name}, a checkpoint every {EVERY} steps (windows from step 10)")
        for name in ("sync", "async", "none (A/A)"):
            print(f"{name:<11} {measured[name] / measured['none']:.2f}x a run without checkpoints")


if __name__ == "__main__":
    main()
