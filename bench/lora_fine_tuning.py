"""LoRA against full fine-tuning, and against Hugging Face Trainer + PEFT.

One invocation, side by side, nothing asserted:

1. at the 110M shape (bench/shapes.py's `110m`: hidden 768, 12 layers, vocab 4096),
   block 512, 4 sequences a step, fp32, from one pretrained base folder (a seeded model
   saved with `save_pretrained`): meshtrain's real Trainer at dp 2 (one thread a rank),
   full fine-tuning first and last (the A/A control) and LoRA r 16, alpha 32,
   all-linear between: model states per rank (the frozen base counted), the measured
   step peak of live tensors and the planner's, the process's peak RSS, tokens/s (the
   Trainer's mean after its first step), and the final checkpoint's bytes;
2. Hugging Face Trainer over PEFT's LoRA model (the same base, r, alpha and targets,
   the same blocks and 4 x 512 tokens a step, AdamW at the same rate), one process
   with both cores; its median step time after the first, from its callbacks;
3. a checkpoint's bytes at the 428M shape (bench/memory.py's), LoRA r 16 all-linear
   against full, counted from the meta model: a checkpoint stores each trained
   parameter and its two AdamW moments in fp32, and a full one every parameter;
4. `--planner`: the planner's step peak against the measured one on four more LoRA
   layouts at 110M (dp 2 ZeRO-1, sharded dp 2, tp 2 + SP, pp 2 1F1B), 3 steps each.

    .venv/bin/python bench/lora_fine_tuning.py --steps 4 --planner   # ~25 min on 2 cores
    .venv/bin/python bench/lora_fine_tuning.py --quick               # a smoke run, ~2 min
"""

from __future__ import annotations

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from bench_runs import planned_side, run_side, token_blocks, work_root  # noqa: E402
from memory import STARTUP  # noqa: E402  (bench/memory.py's 428M shape)
from shapes import SHAPES, hf_fields  # noqa: E402

from meshtrain.config import LoraSettings  # noqa: E402
from meshtrain.models import build_model, build_model_config  # noqa: E402
from meshtrain.models.builder import build_meta_model  # noqa: E402
from meshtrain.models.lora import LoraConverter  # noqa: E402

VOCAB, BLOCK, BATCH, LR = 4096, 512, 4, 1e-4
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
PLANNER_LAYOUTS = {
    "lora-zero1": {"data_parallel_size": 2, "zero_1": True},
    "lora-sdp2": {"data_parallel_size": 2, "sharded_data_parallel_degree": 2},
    "lora-tp2": {"tensor_parallel_size": 2},
    "lora-pp2": {
        "pipeline_parallel_size": 2,
        "pipeline_schedule": "1f1b",
        "pipeline_parallel_num_microbatches": 2,
    },
}


def meshtrain_side(
    root: Path, blocks, base: Path, shape: dict, name: str, steps: int, **kw: Any
) -> dict:
    parallel = kw.get("parallel", {"data_parallel_size": 2, "zero_1": False})
    dp = parallel.get("data_parallel_size", 1)
    spec, _ = planned_side(
        blocks,
        root,
        name,
        world=2,
        parallel=parallel,
        training={
            "max_steps": steps,
            "per_device_train_batch_size": BATCH // dp,
            "learning_rate": LR,
            "cpu_matmul": "auto",
        },
        shape=shape,
        vocab=VOCAB,
        block=BLOCK,
        init_from=str(base),
        lora=kw.get("lora"),
    )
    return run_side(spec, 2, root, name)


def hf_peft_side(root: Path, blocks, base: Path, steps: int) -> float:
    """Tokens/s of Hugging Face Trainer over PEFT's LoRA model (steps after the first)."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415
    from transformers import (  # noqa: PLC0415
        AutoModelForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,  # noqa: PLC0415
    )

    torch.set_num_threads(2)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(**LORA, task_type="CAUSAL_LM")
    )
    seconds: list[float] = []
    started = [0.0]

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            started[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds.append(time.perf_counter() - started[0])

    train = blocks["train"].map(lambda row: {"labels": row["input_ids"]})
    args = TrainingArguments(
        output_dir=str(root / "hf"),
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        max_steps=steps,
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
    )
    Trainer(model=model, args=args, train_dataset=train, callbacks=[Clock()]).train()
    return BATCH * BLOCK / statistics.median(seconds[1:])


def checkpoint_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*.safetensors"))


def counted_checkpoint_ratio(shape: dict) -> tuple[int, int]:
    """(all parameters, adapters) of `shape` under LORA, from the meta model."""
    config = build_model_config("llama", shape, vocab_size=VOCAB)
    model = build_meta_model(config)
    everything = sum(p.numel() for p in model.parameters())
    LoraConverter(LoraSettings(**LORA), seed=0).convert(model)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return everything, adapters


def row(name: str, s: dict) -> str:
    peak = s["measured_peak_memory"]
    return (
        f"| {name} | {s['layout_name']} | {s['model_states_bytes_rank0'] / 2**20:,.0f} | "
        f"{peak['peak_bytes'] / 2**20:,.0f} | {peak['predicted_peak_bytes'] / 2**20:,.0f} | "
        f"{s['peak_rss_mb_rank0']:,.0f} | {s['mean_tokens_per_s']:,.0f} | "
        f"{checkpoint_bytes(s['final_checkpoint']) / 2**20:,.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--planner", action="store_true", help="four more LoRA layouts")
    parser.add_argument("--quick", action="store_true", help="a small shape, 3 steps")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    shape = hf_fields(SHAPES["default" if args.quick else "110m"])
    shape["max_position_embeddings"] = BLOCK
    steps = 3 if args.quick else args.steps
    with contextlib.ExitStack() as stack:
        root = work_root(stack, args.work_dir, "lora-bench-")
        blocks = token_blocks(root / "blocks", BATCH * (steps + 2) + 4, VOCAB, BLOCK)
        base = root / "base"
        build_model(build_model_config("llama", shape, vocab_size=VOCAB), seed=0).save_pretrained(
            base
        )
        runs = {
            "full": meshtrain_side(root, blocks, base, shape, "full", steps),
            "lora": meshtrain_side(root, blocks, base, shape, "lora", steps, lora=LORA),
            "full_again": meshtrain_side(root, blocks, base, shape, "full-again", steps),
        }
        hf = hf_peft_side(root, blocks, base, steps)
        extra = {}
        if args.planner:
            for name, parallel in PLANNER_LAYOUTS.items():
                extra[name] = meshtrain_side(
                    root, blocks, base, shape, name, 3, parallel=parallel, lora=LORA
                )
        report(runs, hf, extra, quick=args.quick)  # before the work folder goes


def report(runs: dict, hf: float, extra: dict, *, quick: bool) -> None:
    print(f"\n{'default' if quick else '110m'} shape, block {BLOCK}, {BATCH} sequences a step")
    print(
        "| side | layout | model states MiB/rank | step peak MiB | planner MiB | "
        "peak RSS MiB | tokens/s | checkpoint MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, summary in {**runs, **extra}.items():
        print(row(name, summary))
    print(f"| HF Trainer + PEFT | 1 process, 2 threads | | | | | {hf:,.0f} | |")
    full, lora, again = runs["full"], runs["lora"], runs["full_again"]
    states = lora["model_states_bytes_rank0"] / full["model_states_bytes_rank0"]
    speed = lora["mean_tokens_per_s"] / full["mean_tokens_per_s"]
    control = again["mean_tokens_per_s"] / full["mean_tokens_per_s"]
    ckpt = checkpoint_bytes(lora["final_checkpoint"]) / checkpoint_bytes(full["final_checkpoint"])
    print(
        f"\nLoRA / full: model states {states:.3f}x, tokens/s {speed:.2f}x, checkpoint {ckpt:.3f}x"
    )
    print(f"A/A (full again / full): tokens/s {control:.2f}x")
    print(f"meshtrain LoRA dp2 / HF Trainer + PEFT: tokens/s {lora['mean_tokens_per_s'] / hf:.2f}x")
    everything, adapters = counted_checkpoint_ratio(STARTUP)
    print(
        f"428M shape, r 16 all-linear: {adapters:,} adapter parameters of {everything:,}; "
        f"checkpoint {3 * adapters * 4 / 2**20:,.0f} MiB against "
        f"{3 * everything * 4 / 2**20:,.0f} MiB ({adapters / everything:.3f}x)"
    )
    for summary in extra.values():
        peak = summary["measured_peak_memory"]
        ratio = peak["predicted_peak_bytes"] / peak["peak_bytes"]
        print(f"planner / measured step peak, {summary['layout_name']}: {ratio:.3f}")


if __name__ == "__main__":
    main()
