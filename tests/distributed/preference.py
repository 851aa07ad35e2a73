"""The one-process oracle of the DPO tests: TRL's `DPOTrainer` on the same base, the same
pairs in the same optimizer steps, fp32, with the run's learning-rate schedule.

The pairs are strings (prompt, chosen, rejected) over a byte-level tokenizer fitted on
them; meshtrain packs them into blocks (`data/preference.py`) and its sampler picks the
blocks of each step, and TRL is handed, step by step, the pairs those blocks hold.
"""

from __future__ import annotations

import contextlib
import random
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import AutoModelForCausalLM

from meshtrain.components.lr_schedule import warmup_cosine
from meshtrain.config_dpo import DpoSettings
from meshtrain.data.blocks import BlockStore, arrow_files
from meshtrain.data.preference import pack_preferences, tokenize_pair
from meshtrain.data.sampler import GlobalBatchSampler
from meshtrain.data.tokenizer import train_tokenizer
from meshtrain.models import build_model, build_model_config
from meshtrain.models.preference_loss import METRICS, PairSums, preference_terms
from tests.conftest import TINY_MODEL
from tests.distributed.reference import TRAINING

BLOCK = 192
FIELDS = {**TINY_MODEL, "max_position_embeddings": BLOCK}
PAIRS_PER_STEP_BLOCKS = 4  # the global batch, in blocks
STEPS = 12
DPO_TRAINING = {
    **TRAINING,
    "objective": "dpo",
    "per_device_train_batch_size": PAIRS_PER_STEP_BLOCKS,
    "max_steps": STEPS,
    "learning_rate": 5e-3,
    "warmup_steps": 2,
    "max_grad_norm": 1.0,
    "eval_batches": 0,
    "eval_every": 100,
}
WORDS = [
    *("alpha", "beta", "gamma", "delta", "apple", "river"),
    *("stone", "cloud", "green", "quiet", "swift", "bright"),
]


def preference_rows(count: int = 160, seed: int = 0) -> datasets.Dataset:
    """Explicit-prompt string pairs of varied lengths: a question, a right and a wrong
    answer."""
    rng = random.Random(seed)
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(count):
        topic = " ".join(rng.choices(WORDS, k=rng.randint(1, 4)))
        rows["prompt"].append(f"Q: what follows {topic}?\nA:")
        rows["chosen"].append(" " + " ".join(rng.choices(WORDS[:6], k=rng.randint(2, 9))))
        rows["rejected"].append(" " + " ".join(rng.choices(WORDS[6:], k=rng.randint(1, 9))))
    return datasets.Dataset.from_dict(rows)


def preference_tokenizer(rows: datasets.Dataset):
    text = [
        p + c + r for p, c, r in zip(rows["prompt"], rows["chosen"], rows["rejected"], strict=True)
    ]
    return train_tokenizer(datasets.Dataset.from_dict({"text": text}), 300)


def preference_blocks(rows: datasets.Dataset, tokenizer, folder: Path) -> datasets.DatasetDict:
    """The pairs packed as the data pipeline packs them, saved and memory-mapped."""
    blocks, _ = pack_preferences(
        rows, tokenizer, block_size=BLOCK, truncation="off", validation_fraction=0.1, seed=3
    )
    blocks.save_to_disk(str(folder))
    return datasets.load_from_disk(str(folder))


def save_base(folder: Path, vocab: int, fields: dict[str, Any] = FIELDS) -> Path:
    """The starting model (DPO needs one): the seeded model of `fields`, saved."""
    config = build_model_config("llama", fields, vocab_size=vocab)
    build_model(config, seed=TRAINING["seed"]).save_pretrained(folder)
    return folder


def step_pairs(blocks: datasets.DatasetDict, rows: datasets.Dataset, tokenizer) -> list[list[int]]:
    """Per optimizer step, the rows (indices into `rows`) of the pairs meshtrain's blocks
    of that step hold, in block order."""
    by_ids = {}
    for index, row in enumerate(rows):
        chosen, rejected, _ = tokenize_pair(row, tokenizer)
        by_ids[(tuple(chosen), tuple(rejected))] = index
    store = BlockStore(arrow_files(blocks["train"]))
    sampler = GlobalBatchSampler(len(store), PAIRS_PER_STEP_BLOCKS, TRAINING["seed"])
    steps = []
    for step in range(STEPS):
        batch = store.tokens(sampler.global_indices(step))
        found = []
        for row, positions in zip(batch.input_ids, batch.position_ids, strict=True):
            starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
            sequences = [row[a:b].tolist() for a, b in zip(starts, starts[1:], strict=False)]
            for k in range(0, len(sequences) - 1, 2):
                key = (tuple(sequences[k]), tuple(sequences[k + 1]))
                if key in by_ids:
                    found.append(by_ids[key])
        steps.append(found)
    return steps


def trl_run(
    base: Path,
    tokenizer,
    rows: datasets.Dataset,
    steps: list[list[int]],
    out: Path,
    *,
    dpo: dict[str, Any],
    lora: dict[str, Any] | None = None,
) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """TRL's per-step losses and rewards metrics, and the trained tensors (PEFT's adapter
    keys under `lora`, where TRL's reference is the base with the adapters off), in fp32.

    TRL's trainer makes the data (its tokenization, collator, precomputed references
    under `dpo["reference"] == "precompute"`), the loss and the metrics
    (`compute_loss`) and the optimizer (`create_optimizer`); this loop feeds it
    meshtrain's pairs of each step, clips, steps and schedules as the run does. TRL's
    `bf16` default is turned off: on a CPU it runs the reference model under bf16
    autocast."""
    from peft import get_peft_model_state_dict  # noqa: PLC0415
    from trl import DPOConfig, DPOTrainer  # noqa: PLC0415

    from tests.distributed.lora import peft_model  # noqa: PLC0415

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    reference = None
    if lora is None:
        reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    else:
        model = peft_model(FIELDS, lora, base=model)
    args = DPOConfig(
        output_dir=str(out),
        beta=dpo.get("beta", 0.1),
        loss_type=[dpo.get("loss_type", "sigmoid")],
        label_smoothing=dpo.get("label_smoothing", 0.0),
        learning_rate=DPO_TRAINING["learning_rate"],
        weight_decay=DPO_TRAINING["weight_decay"],
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=DPO_TRAINING["adam_epsilon"],
        max_length=None,
        precompute_ref_log_probs=dpo.get("reference") == "precompute",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=TRAINING["seed"],
    )
    trainer = DPOTrainer(
        model=model, ref_model=reference, args=args, train_dataset=rows, processing_class=tokenizer
    )
    optimizer = trainer.create_optimizer()
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        partial(
            warmup_cosine, warmup_steps=DPO_TRAINING["warmup_steps"], max_steps=STEPS, min_ratio=0.1
        ),
    )
    model.train()
    logs = []
    for pairs in steps:
        batch = trainer.data_collator([trainer.train_dataset[i] for i in pairs])
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), DPO_TRAINING["max_grad_norm"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
        logs.append({"loss": loss.item(), **metrics})
    if lora is not None:
        state = get_peft_model_state_dict(model, save_embedding_layers=False)
        return logs, {k: v.detach().clone() for k, v in state.items()}
    return logs, {n: p.detach().clone() for n, p in model.named_parameters()}


def exact_run(
    base: Path,
    tokenizer,
    rows: datasets.Dataset,
    steps: list[list[int]],
    dpo: dict[str, Any],
    lora: dict[str, Any] | None = None,
) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """DPO in float64 by a plain loop (each sequence alone, whole log-softmax, TRL's
    formulas, torch AdamW): the loss and metrics per step and the trained tensors (PEFT's
    adapter keys under `lora`, whose reference is the base with the adapters off)."""
    from peft import get_peft_model_state_dict  # noqa: PLC0415

    from tests.distributed.lora import peft_model  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    if lora is None:
        reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    else:
        model = reference = peft_model(FIELDS, lora, base=model)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in trained if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=DPO_TRAINING["learning_rate"],
        betas=(0.9, 0.95),
        eps=DPO_TRAINING["adam_epsilon"],
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        partial(
            warmup_cosine, warmup_steps=DPO_TRAINING["warmup_steps"], max_steps=STEPS, min_ratio=0.1
        ),
    )
    logs = []
    for pairs in steps:
        with torch.no_grad(), model.disable_adapter() if lora else contextlib.nullcontext():
            fixed = _sequence_sums(reference, tokenizer, rows, pairs)
        policy = _sequence_sums(model, tokenizer, rows, pairs)
        terms = preference_terms(DpoSettings(**dpo), policy, fixed) / len(pairs)
        terms[0].backward()
        torch.nn.utils.clip_grad_norm_(trained, DPO_TRAINING["max_grad_norm"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        logs.append(dict(zip(METRICS, terms.tolist(), strict=True)))
    if lora is not None:
        state = get_peft_model_state_dict(model, save_embedding_layers=False)
        return logs, {k: v.detach().clone() for k, v in state.items()}
    return logs, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sequence_sums(
    net: torch.nn.Module, tokenizer, rows: datasets.Dataset, pairs: list[int]
) -> PairSums:
    """Each pair's completion log-probabilities, every sequence scored alone."""
    values, counts = [], []
    for i in pairs:
        chosen, rejected, start = tokenize_pair(rows[i], tokenizer)
        for ids in (chosen, rejected):
            x = torch.tensor([ids])
            logps = torch.log_softmax(net(input_ids=x).logits[0, :-1], -1)
            logps = logps.gather(-1, x[0, 1:, None]).squeeze(-1)[start - 1 :]
            values.append(logps.sum())
            counts.append(float(len(logps)))
    v = torch.stack(values).view(-1, 2)
    n = torch.tensor(counts, dtype=torch.float64).view(-1, 2)
    return PairSums(v[:, 0], v[:, 1], n[:, 0], n[:, 1])
