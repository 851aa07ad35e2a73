"""Fine-tuning: packing efficiency, and real tokens/s of meshtrain against TRL's SFTTrainer.

One invocation, side by side, nothing asserted:

1. the builtin instruction set tokenized with a tokenizer trained on the default builtin
   corpus (vocab 4096, what `kedro run` makes) and best-fit into 512-token blocks:
   meshtrain's packing report;
2. the same conversations, the same 27M-parameter Llama (bench/shapes.py's `27m`, random
   init, fp32, sdpa), global batch 8 x 512 tokens, AdamW at the same rate, trained by
   meshtrain's real Trainer (dp 2 on the 2 cores, and one process) and by TRL's SFTTrainer
   in its recommended configuration for this (`packing=True, packing_strategy="bfd"`,
   padding-free rows with position_ids, `assistant_only_loss=True`, one process with all
   the cores; and once with its default gradient checkpointing off). Real tokens only (no
   padding) per second over the steps after warm-up;
   meshtrain dp 2 runs twice, first and last, as the A/A control.

    .venv/bin/python bench/fine_tuning.py --steps 6    # ~8 min on 2 cores
    .venv/bin/python bench/fine_tuning.py --layout-probe  # the two row layouts, ~1 min
"""

from __future__ import annotations

import os

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import datasets  # noqa: E402
import torch  # noqa: E402
from bench_runs import planned_side, run_side, work_root  # noqa: E402
from shapes import SHAPES, hf_fields  # noqa: E402

from meshtrain.data.bfd import pack_examples  # noqa: E402
from meshtrain.data.builtin import builtin_instructions  # noqa: E402
from meshtrain.data.chat_tokens import tokenize_examples  # noqa: E402
from meshtrain.data.corpus import load_corpus  # noqa: E402
from meshtrain.data.tokenizer import train_tokenizer  # noqa: E402
from meshtrain.models import build_model, build_model_config  # noqa: E402

BLOCK, BATCH, VOCAB, LR = 512, 8, 4096, 1e-3
SHAPE = {**hf_fields(SHAPES["27m"]), "max_position_embeddings": BLOCK}


def packed_blocks(tokenizer, root: Path) -> datasets.DatasetDict:
    """The builtin conversations, best-fit into blocks (a few for validation, unused)."""
    conversations = builtin_instructions()
    tokens, untrained = tokenize_examples(
        conversations, tokenizer, fmt="conversational", loss_on="assistant", num_proc=2
    )
    blocks, report = pack_examples(
        tokens, block_size=BLOCK, truncation="drop", pad_token_id=tokenizer.pad_token_id, seed=0
    )
    print(f"packing at {BLOCK}: {report.line()}; {untrained} with nothing to train")
    split = datasets.DatasetDict(
        {"train": blocks.select(range(len(blocks) - 4)), "validation": blocks.select(range(4))}
    )
    split.save_to_disk(str(root / "blocks"))
    return datasets.load_from_disk(str(root / "blocks"))


def meshtrain_side(blocks, root: Path, name: str, world: int, steps: int) -> float:
    """Real tokens/s of the real Trainer (its throughput leaves out the first step)."""
    spec, _ = planned_side(
        blocks,
        root,
        name,
        world=world,
        parallel={"data_parallel_size": world, "zero_1": False},
        training={
            "max_steps": steps,
            "per_device_train_batch_size": BATCH // world,
            "learning_rate": LR,
            "weight_decay": 0.0,
            "cpu_matmul": "auto",
        },
        shape=SHAPE,
        vocab=VOCAB,
        block=BLOCK,
    )
    return run_side(spec, world, root, name)["mean_tokens_per_s"]


class _StepClock:
    """A TrainerCallback timing each optimizer step (TRL's side)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback  # noqa: PLC0415

        clock = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                clock.seconds.append(time.perf_counter() - clock.started)

        self.callback, self.seconds, self.started = Callback(), [], 0.0


def trl_side(tokenizer, root: Path, steps: int, checkpointing: bool = True) -> tuple[float, float]:
    """Real tokens/s of TRL's SFTTrainer (steps after the first), and its trained share.
    `checkpointing`: SFTConfig's default (on); off shows what it costs."""
    from trl import SFTConfig, SFTTrainer  # noqa: PLC0415

    torch.set_num_threads(os.cpu_count() or 1)
    config = build_model_config("llama", SHAPE, vocab_size=len(tokenizer))
    model = build_model(config, seed=42)
    args = SFTConfig(
        output_dir=str(root / "trl"),
        packing=True,
        packing_strategy="bfd",
        max_length=BLOCK,
        per_device_train_batch_size=BATCH,
        assistant_only_loss=True,
        learning_rate=LR,
        max_steps=steps,
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        dataset_num_proc=None,
        gradient_checkpointing=checkpointing,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=builtin_instructions(),
        processing_class=tokenizer,
    )
    counts: list[tuple[int, int]] = []
    collate = trainer.data_collator

    def counting(features):
        batch = collate(features)
        real = int(batch["input_ids"].numel())
        trained = int((batch["labels"] != -100).sum())
        counts.append((real, trained))
        return batch

    trainer.data_collator = counting
    clock = _StepClock()
    trainer.add_callback(clock.callback)
    trainer.train()
    real = [r for r, _ in counts[1 : len(clock.seconds)]]
    trained = sum(t for _, t in counts) / sum(r for r, _ in counts)
    return sum(real) / sum(clock.seconds[1:]), trained


def layout_probe(repeats: int = 2) -> None:
    """One forward and backward of the same 4,096 tokens as meshtrain lays them out (8
    blocks of 512, block-diagonal mask) and as TRL's padding-free collator does (one row
    of 4,096, positions only), and as 8 causal blocks (what the mask costs): min seconds
    of `repeats`."""
    from meshtrain.models.packed_attention import packed_causal_mask  # noqa: PLC0415

    torch.set_num_threads(os.cpu_count() or 1)
    model = build_model(build_model_config("llama", SHAPE, vocab_size=VOCAB), seed=0)
    positions = torch.cat([torch.arange(n) for n in (100, 150, 200, 62)])[None]
    ids = torch.randint(0, VOCAB, (8, BLOCK), generator=torch.Generator().manual_seed(0))
    rows = positions.repeat(8, 1)
    layouts = {
        "8 blocks of 512, packed mask": dict(
            position_ids=rows, attention_mask=packed_causal_mask(rows)
        ),
        "8 blocks of 512, causal (no mask)": {},
        "1 row of 4,096 (padding-free)": dict(position_ids=positions.repeat(1, 8)),
    }
    for name, extra in layouts.items():
        tokens = ids if "blocks" in name else ids.reshape(1, -1)
        seconds = []
        for _ in range(repeats + 1):
            began = time.perf_counter()
            model(input_ids=tokens, labels=tokens, **extra).loss.backward()
            seconds.append(time.perf_counter() - began)
        print(f"{name:<34}{min(seconds[1:]):>8.2f} s forward+backward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument(
        "--layout-probe", action="store_true", help="only time meshtrain's and TRL's row layouts"
    )
    args = parser.parse_args()
    if args.layout_probe:
        layout_probe()
        return
    datasets.disable_progress_bars()
    with contextlib.ExitStack() as stack:
        root = work_root(stack, args.work_dir, "meshtrain-sft-bench-")
        began = time.perf_counter()
        tokenizer = train_tokenizer(load_corpus("builtin"), VOCAB)
        blocks = packed_blocks(tokenizer, root)
        real = sum(blocks["train"]["num_tokens"]) / (len(blocks["train"]) * BLOCK)
        rates = {"meshtrain dp2 (A)": meshtrain_side(blocks, root, "a", 2, args.steps)}
        rates["TRL SFTTrainer"], trl_trained = trl_side(tokenizer, root, args.steps)
        rates["TRL, no checkpointing"], _ = trl_side(tokenizer, root, args.steps, False)
        rates["meshtrain 1 process"] = meshtrain_side(blocks, root, "one", 1, args.steps)
        rates["meshtrain dp2 (A again)"] = meshtrain_side(blocks, root, "a2", 2, args.steps)
        print(f"\n{'side':<26}{'real tokens/s':>14}{'x TRL':>8}")
        for name, rate in rates.items():
            print(f"{name:<26}{rate:>14,.0f}{rate / rates['TRL SFTTrainer']:>8.2f}")
        a, again = rates["meshtrain dp2 (A)"], rates["meshtrain dp2 (A again)"]
        print(
            f"A/A: {max(a, again) / min(a, again):.2f}x; meshtrain dp2 (mean of A) / TRL: "
            f"{statistics.mean([a, again]) / rates['TRL SFTTrainer']:.2f}x"
        )
        print(
            f"real tokens per block token: meshtrain {real:.3f}; trained per real token: "
            f"TRL {trl_trained:.3f}"
        )
        print(f"({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
