"""What the training benchmarks share: learnable token blocks, a planned worker spec for
one side, and running that side in its own spawned group.

Imported by the scripts beside it (`python bench/<script>.py` puts this folder on the
path); not a benchmark itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import torch  # noqa: E402
from shapes import hf_fields  # noqa: E402  (bench/shapes.py)

from meshtrain.config import LaunchConfig, RunConfig  # noqa: E402
from meshtrain.data.blocks import arrow_files  # noqa: E402
from meshtrain.launch.elastic import run_workers  # noqa: E402
from meshtrain.launch.job import make_worker_spec  # noqa: E402
from meshtrain.launch.worker import worker_main_sequence  # noqa: E402
from meshtrain.models import build_model_config  # noqa: E402
from meshtrain.planner import Plan, plan_run  # noqa: E402
from meshtrain.trainer import WorkerSpec  # noqa: E402

# The 27M-parameter Llama of the speed issue (#19).
SHAPE_27M = hf_fields("27m")
MIB = 2**20


def learnable_blocks(out: Path, count: int, vocab: int, block: int, validation: int = 4):
    """`count` blocks of arithmetic sequences mod the vocabulary (so losses move), the
    last `validation` of them the validation split; saved and memory-mapped back."""
    import datasets  # noqa: PLC0415

    datasets.disable_progress_bars()
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (count, 1), generator=generator)
    stride = torch.randint(1, 8, (count, 1), generator=generator)
    ids = ((start + stride * torch.arange(block)) % vocab).int()
    blocks = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"input_ids": ids[:-validation].tolist()}),
            "validation": datasets.Dataset.from_dict({"input_ids": ids[-validation:].tolist()}),
        }
    )
    blocks.save_to_disk(str(out))
    return datasets.load_from_disk(str(out))


def planned_side(
    blocks,
    root: Path,
    name: str,
    *,
    world: int,
    parallel: dict[str, Any],
    training: dict[str, Any],
    shape: dict[str, Any],
    vocab: int,
    block: int,
) -> tuple[WorkerSpec, Plan]:
    """The worker spec and plan of one side, as `kedro run` would make them (no
    validation, no checkpoint but the last)."""
    run = RunConfig.from_params(
        parallel=parallel,
        training={
            "warmup_steps": 1,
            "learning_rate": 1e-3,
            "eval_batches": 0,
            "checkpoint_every": 10_000,
            "keep_last": 1,
            **training,
            "output_dir": str(root / "runs"),
            "run_name": name,
        },
        launch={"nproc_per_node": world},
        model={"architecture": "llama", "config": shape},
        data={"block_size": block},
    )
    config = build_model_config("llama", shape, vocab_size=vocab)
    plan = plan_on_blocks(run, config, blocks)
    spec = make_worker_spec(
        run, plan, train_files=arrow_files(blocks["train"]), validation_files=[], tokenizer_dir=None
    )
    return spec, plan


def plan_on_blocks(run: RunConfig, config: Any, blocks: Any, cuda: bool = False) -> Plan:
    """The plan of `run` for `config` on these token blocks, for CPU unless `cuda`."""
    return plan_run(
        run,
        config,
        num_train_blocks=len(blocks["train"]),
        num_validation_blocks=len(blocks["validation"]),
        cuda_available=cuda,
    )


def run_side(spec: WorkerSpec, world: int, root: Path, name: str) -> dict[str, Any]:
    """Train one side in its own group of `world` spawned ranks; rank 0's summary."""
    print(f"== {name}", flush=True)
    (summary,) = run_workers(
        worker_main_sequence,
        ([spec],),
        LaunchConfig(nproc_per_node=world),
        log_dir=root / "logs" / name,
        run_id=name,
    )[0]
    return summary


def print_side_table(rows: list[tuple[str, dict[str, Any], Plan]]) -> tuple[dict, dict]:
    """One line per side: model states (counted from the tensors) beside the planner's
    figure, the step's measured peak of live tensors beside the predicted one, the peak
    resident set over the ranks at start-up and over the run, tokens/s, the last loss.
    Returns the model states and tokens/s by side, for the ratios."""
    print(
        f"\n{'side':<18}{'model states MiB':>17}{'planner':>9}{'step peak MiB':>14}"
        f"{'planner':>9}{'start RSS':>10}{'RSS MiB':>9}{'tokens/s':>10}{'last loss':>11}"
    )
    states, speed = {}, {}
    for name, summary, plan in rows:
        memory = plan.memory_estimate_per_rank
        predicted_states = memory["parameters"] + memory["gradients"] + memory["optimizer_states"]
        measured = summary["measured_peak_memory"]
        states[name] = summary["model_states_bytes_rank0"]
        speed[name] = summary["mean_tokens_per_s"]
        print(
            f"{name:<18}{states[name] / MIB:>17,.1f}{predicted_states / MIB:>9,.1f}"
            f"{measured['peak_bytes'] / MIB:>14,.1f}"
            f"{measured['predicted_peak_bytes'] / MIB:>9,.1f}"
            f"{max(summary['startup_peak_rss_mb_per_rank']):>10,.0f}"
            f"{max(summary['peak_rss_mb_per_rank']):>9,.0f}{speed[name]:>10,.0f}"
            f"{summary['final_loss']:>11.4f}"
        )
    print()
    return states, speed
