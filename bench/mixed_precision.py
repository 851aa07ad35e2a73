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

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import torch  # noqa: E402

from meshtrain.config import LaunchConfig, RunConfig  # noqa: E402
from meshtrain.data.blocks import arrow_files  # noqa: E402
from meshtrain.launch.elastic import run_workers  # noqa: E402
from meshtrain.launch.job import make_worker_spec  # noqa: E402
from meshtrain.launch.worker import worker_main_sequence  # noqa: E402
from meshtrain.models import build_model_config  # noqa: E402
from meshtrain.planner import plan_run  # noqa: E402

SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1344,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}
VOCAB, BLOCK, WORLD, PER_DEVICE = 4096, 256, 2, 4
MIB = 2**20


def _blocks(out: Path, count: int):
    import datasets  # noqa: PLC0415

    # Learnable sequences (arithmetic mod the vocabulary), so the losses move.
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (count, 1), generator=generator)
    stride = torch.randint(1, 8, (count, 1), generator=generator)
    ids = ((start + stride * torch.arange(BLOCK)) % VOCAB).int()
    blocks = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"input_ids": ids[:-4].tolist()}),
            "validation": datasets.Dataset.from_dict({"input_ids": ids[-4:].tolist()}),
        }
    )
    blocks.save_to_disk(str(out))
    return datasets.load_from_disk(str(out))


def _spec(blocks, root: Path, name: str, steps: int, precision: str):
    run = RunConfig.from_params(
        parallel={"data_parallel_size": WORLD, "zero_1": True},
        training={
            "per_device_train_batch_size": PER_DEVICE,
            "max_steps": steps,
            "warmup_steps": 1,
            "learning_rate": 1e-3,
            "eval_batches": 0,
            "checkpoint_every": 10_000,
            "keep_last": 1,
            "mixed_precision": precision,
            "output_dir": str(root / "runs"),
            "run_name": name,
        },
        launch={"nproc_per_node": WORLD},
        model={"architecture": "llama", "config": SHAPE},
        data={"block_size": BLOCK},
    )
    config = build_model_config("llama", SHAPE, vocab_size=VOCAB)
    plan = plan_run(
        run,
        config,
        num_train_blocks=len(blocks["train"]),
        num_validation_blocks=len(blocks["validation"]),
        cuda_available=False,
    )
    spec = make_worker_spec(
        run, plan, train_files=arrow_files(blocks["train"]), validation_files=[], tokenizer_dir=None
    )
    return spec, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sides", default="no,bf16,bf16_master,no")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        blocks = _blocks(root / "blocks", WORLD * PER_DEVICE * args.steps + 8)
        for i, precision in enumerate(args.sides.split(",")):
            name = f"{i}-{precision}"
            spec, plan = _spec(blocks, root, name, args.steps, precision)
            print(f"== {name}", flush=True)
            (summary,) = run_workers(
                worker_main_sequence,
                ([spec],),
                LaunchConfig(nproc_per_node=WORLD),
                log_dir=root / "logs" / name,
                run_id=name,
            )[0]
            rows.append((name, summary, plan))
    _report(rows)


def _report(rows: list[tuple[str, dict, Any]]) -> None:
    print(
        f"\n{'side':<16}{'model states MiB':>18}{'planner':>9}{'step peak MiB':>15}"
        f"{'planner':>9}{'RSS MiB':>9}{'tokens/s':>10}{'last loss':>11}"
    )
    speed, states = {}, {}
    for name, summary, plan in rows:
        memory = plan.memory_estimate_per_rank
        predicted_states = memory["parameters"] + memory["gradients"] + memory["optimizer_states"]
        measured = summary["measured_peak_memory"]
        speed[name] = summary["mean_tokens_per_s"]
        states[name] = summary["model_states_bytes_rank0"]
        print(
            f"{name:<16}{states[name] / MIB:>18,.1f}{predicted_states / MIB:>9,.1f}"
            f"{measured['peak_bytes'] / MIB:>15,.1f}{measured['predicted_peak_bytes'] / MIB:>9,.1f}"
            f"{max(summary['peak_rss_mb_per_rank']):>9,.0f}{speed[name]:>10,.0f}"
            f"{summary['final_loss']:>11.4f}"
        )
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
