"""A training run for the stop tests, as its own process: `python -m tests.distributed.stop_run
BLOCKS OUT MAX_STEPS [learning_rate [checkpoint_every]]` (OUT: a folder or a URL). It
trains through `launch.job.run_training` (the `kedro run` path below the node), prints the
TrainingStopped or refusal line it ends with, and exits 3 for a stop, 4 for a refusal."""

from __future__ import annotations

import sys
from pathlib import Path

import datasets

from meshtrain.config import Refused, RunConfig
from meshtrain.data.blocks import arrow_files
from meshtrain.launch.job import TrainingStopped, make_worker_spec, run_training
from meshtrain.models import build_model_config
from meshtrain.planner import Plan, plan_run
from meshtrain.trainer import WorkerSpec
from tests.conftest import TINY_BLOCK, TINY_MODEL, TINY_VOCAB
from tests.distributed.reference import TRAINING

# A constant learning rate: the stopped, resumed and uninterrupted runs then do not
# depend on max_steps (the cosine schedule would).
CONSTANT_LR = {"warmup_steps": 0, "min_learning_rate_ratio": 1.0, "learning_rate": 3e-3}


def stop_run_config(out: Path | str, max_steps: int, **training) -> RunConfig:
    return RunConfig.from_params(
        parallel={"data_parallel_size": 2, "zero_1": True},
        training={
            **TRAINING,
            **CONSTANT_LR,
            "per_device_train_batch_size": 4,
            "max_steps": max_steps,
            "checkpoint_every": 1000,
            "keep_last": 0,
            "eval_batches": 0,
            "output_dir": str(out),
            "run_name": "stopped",
            **training,
        },
        launch={"nproc_per_node": 2, "shutdown_grace_s": 60},
        model={"architecture": "llama", "config": TINY_MODEL},
        data={"block_size": TINY_BLOCK},
    )


def plan_for(run: RunConfig, blocks: datasets.DatasetDict) -> Plan:
    return plan_run(
        run,
        build_model_config("llama", TINY_MODEL, vocab_size=TINY_VOCAB),
        num_train_blocks=len(blocks["train"]),
        num_validation_blocks=len(blocks["validation"]),
        cuda_available=False,
    )


def spec_for(run: RunConfig, blocks: datasets.DatasetDict) -> WorkerSpec:
    """The worker spec the launcher makes of `run` (no validation split)."""
    return make_worker_spec(
        run,
        plan_for(run, blocks),
        train_files=arrow_files(blocks["train"]),
        validation_files=[],
        tokenizer_dir=None,
    )


def main() -> int:
    blocks = datasets.load_from_disk(sys.argv[1])
    training = {"learning_rate": float(sys.argv[4])} if len(sys.argv) > 4 else {}
    if len(sys.argv) > 5:
        training["checkpoint_every"] = int(sys.argv[5])
    run = stop_run_config(sys.argv[2], int(sys.argv[3]), **training)
    plan = plan_for(run, blocks)
    try:
        run_training(
            run,
            plan,
            train_files=arrow_files(blocks["train"]),
            validation_files=arrow_files(blocks["validation"]),
            tokenizer=None,
        )
    except TrainingStopped as stop:
        print(f"STOPPED: {stop}", flush=True)
        return 3
    except Refused as refusal:
        print(f"REFUSED: {type(refusal).__name__}: {refusal}", flush=True)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
