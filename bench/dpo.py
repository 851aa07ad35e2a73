"""DPO: preference pairs per second of meshtrain against TRL's DPOTrainer.

One invocation, side by side, nothing asserted: the builtin preference pairs
(`data.source=builtin_preferences`) tokenized with a tokenizer trained on the default
builtin corpus (vocab 4096, what `kedro run` makes), the same 27M-parameter Llama
(bench/shapes.py's `27m`, random init saved as the starting folder, fp32, sdpa), AdamW
at the same rate, trained

- by meshtrain's real Trainer: pairs packed whole into 1,024-token blocks, global batch
  4 blocks, dp 2 on the 2 cores with a reference model (twice, first and last: the A/A
  control), with precomputed references, and with LoRA (reference = adapters off);
- by TRL's DPOTrainer with the same number of pairs a step, one process with all the
  cores, in fp32 as meshtrain (its `bf16` default off: on a CPU that is autocast, about
  9x slower than fp32 on this machine's AVX2): with a reference model (its other
  defaults: padded batches, gradient checkpointing), with
  `precompute_ref_log_probs`, and with LoRA (`peft_config`, the adapters off as the
  reference).

Pairs per second over the steps after the first (meshtrain: its real tokens/s times the
split's pairs per real token; TRL: the step's pairs over the step's seconds).

    .venv/bin/python bench/dpo.py     # about 25 min here (docs/preference.md)
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
from fine_tuning import _StepClock  # noqa: E402
from shapes import SHAPES, hf_fields  # noqa: E402

from meshtrain.data.builtin import builtin_preferences  # noqa: E402
from meshtrain.data.corpus import load_corpus  # noqa: E402
from meshtrain.data.preference import pack_preferences  # noqa: E402
from meshtrain.data.tokenizer import train_tokenizer  # noqa: E402
from meshtrain.models import build_model, build_model_config  # noqa: E402

BLOCK, BATCH, VOCAB, LR = 1024, 4, 4096, 1e-4
SHAPE = {**hf_fields(SHAPES["27m"]), "max_position_embeddings": BLOCK}
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}


def pair_blocks(tokenizer, root: Path) -> tuple[datasets.DatasetDict, float, int]:
    """The builtin pairs in blocks; the pairs per real token of the training split, and
    the pairs a step holds on average (TRL's batch)."""
    blocks, reports = pack_preferences(
        builtin_preferences(),
        tokenizer,
        block_size=BLOCK,
        truncation="drop",
        validation_fraction=0.02,
        seed=0,
    )
    blocks.save_to_disk(str(root / "blocks"))
    blocks = datasets.load_from_disk(str(root / "blocks"))
    report = reports["train"]
    per_token = report.examples / report.real_tokens
    return blocks, per_token, round(BATCH * report.examples / report.blocks)


def meshtrain_side(blocks, root, name, world, steps, base, **options) -> float:
    """Real tokens/s of the real Trainer (its throughput leaves out the first step)."""
    lora = options.pop("lora", None)
    spec, _ = planned_side(
        blocks,
        root,
        name,
        world=world,
        parallel={"data_parallel_size": world, "zero_1": False},
        training={
            "objective": "dpo",
            "dpo": options,
            "max_steps": steps,
            "per_device_train_batch_size": BATCH // world,
            "learning_rate": LR,
            "weight_decay": 0.0,
            "cpu_matmul": "auto",
        },
        shape=SHAPE,
        vocab=VOCAB,
        block=BLOCK,
        init_from=str(base),
        lora=lora,
    )
    return run_side(spec, world, root, name)["mean_tokens_per_s"]


def trl_side(tokenizer, base: Path, root: Path, steps: int, pairs: int, **options) -> float:
    """Pairs/s of TRL's DPOTrainer over the steps after the first."""
    from peft import LoraConfig  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    from trl import DPOConfig, DPOTrainer  # noqa: PLC0415

    torch.set_num_threads(os.cpu_count() or 1)
    lora = options.pop("lora", False)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    reference = None if lora else AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    args = DPOConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=pairs,
        learning_rate=LR,
        max_steps=steps,
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=BLOCK,
        dataloader_num_workers=0,
        dataset_num_proc=None,
        **options,
    )
    trainer = DPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        # The pairs its steps take (tokenizing all of them is not what is timed).
        train_dataset=builtin_preferences().select(range(2 * steps * pairs)),
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA, task_type="CAUSAL_LM") if lora else None,
    )
    clock = _StepClock()
    trainer.add_callback(clock.callback)
    trainer.train()
    return pairs * (len(clock.seconds) - 1) / sum(clock.seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    with contextlib.ExitStack() as stack:
        root = work_root(stack, args.work_dir, "meshtrain-dpo-bench-")
        began = time.perf_counter()
        tokenizer = train_tokenizer(load_corpus("builtin"), VOCAB)
        blocks, per_token, pairs = pair_blocks(tokenizer, root)
        base = root / "base"
        build_model(
            build_model_config("llama", SHAPE, vocab_size=len(tokenizer)), seed=0
        ).save_pretrained(base)
        tokenizer.save_pretrained(base)
        steps = args.steps

        def ours(name: str, world: int, **options) -> float:
            return meshtrain_side(blocks, root, name, world, steps, base, **options) * per_token

        rates: dict[str, float] = {}

        def side(name: str, rate: float) -> None:
            rates[name] = rate
            print(f"-> {name}: {rate:.3f} pairs/s", flush=True)

        side("meshtrain dp2, model (A)", ours("a", 2, reference="model"))
        side("TRL, model", trl_side(tokenizer, base, root, steps, pairs))
        side("meshtrain dp2, model (A again)", ours("a2", 2, reference="model"))
        side("meshtrain dp2, precompute", ours("pre", 2, reference="precompute"))
        side(
            "TRL, precompute",
            trl_side(tokenizer, base, root, steps, pairs, precompute_ref_log_probs=True),
        )
        side("meshtrain dp2, LoRA", ours("lora", 2, reference="base", lora=LORA))
        side("TRL, LoRA", trl_side(tokenizer, base, root, steps, pairs, lora=True))
        trl = rates["TRL, model"]
        print(f"\n{pairs} pairs a step (meshtrain: {BATCH} blocks of {BLOCK}, on average)")
        print(f"{'side':<34}{'pairs/s':>9}{'x TRL, model':>14}")
        for name, rate in rates.items():
            print(f"{name:<34}{rate:>9.2f}{rate / trl:>14.2f}")
        a, again = rates["meshtrain dp2, model (A)"], rates["meshtrain dp2, model (A again)"]
        print(
            f"A/A: {max(a, again) / min(a, again):.2f}x; dp2 model (mean of A) / TRL model: "
            f"{statistics.mean([a, again]) / trl:.2f}x; precompute: "
            f"{rates['meshtrain dp2, precompute'] / rates['TRL, precompute']:.2f}x; LoRA: "
            f"{rates['meshtrain dp2, LoRA'] / rates['TRL, LoRA']:.2f}x"
        )
        print(f"({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
