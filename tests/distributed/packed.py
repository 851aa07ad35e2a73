"""Fine-tuning blocks for the equivalence tests, and the one-process reference that runs
every packed example alone.

The blocks hold whole examples side by side (positions restarting at each), a padded
tail, and a loss mask that trains only each example's completion, so blocks carry unequal
numbers of trained tokens. The reference never packs: it runs each example through a
plain Hugging Face model by itself and divides the summed token losses of the global
batch by its trained tokens, so a layout that let examples attend to each other, or
averaged per-microbatch means, would not match it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

from meshtrain.data.batch import IGNORE_INDEX, TokenBatch, next_token_labels
from meshtrain.data.blocks import BlockStore, arrow_files
from meshtrain.data.sampler import GlobalBatchSampler
from meshtrain.models import build_model, build_model_config
from meshtrain.trainer import Trainer, WorkerSpec, train
from tests.conftest import TINY_BLOCK, TINY_VOCAB
from tests.distributed.reference import (
    GLOBAL_BATCH,
    STEPS,
    TRAINING,
    reference_optimizer,
    reference_step,
)


def build_packed_blocks(path: Path, *, train_blocks: int = 48, seed: int = 0):
    """Learnable examples (arithmetic sequences) of 4-20 tokens, a prompt of 1-3 tokens
    each, packed first-fit into TINY_BLOCK blocks; saved and loaded back memory-mapped."""
    rng = np.random.default_rng(seed)
    rows: list[dict[str, list[int]]] = []
    current: dict[str, list[int]] = {"input_ids": [], "position_ids": [], "loss_mask": []}
    while len(rows) < train_blocks + 12:
        length = int(rng.integers(4, 21))
        start, stride = int(rng.integers(0, TINY_VOCAB)), int(rng.integers(1, 4))
        ids = [(start + stride * i) % TINY_VOCAB for i in range(length)]
        prompt = int(rng.integers(1, 4))
        if len(current["input_ids"]) + length > TINY_BLOCK:
            rows.append(_padded(current))
            current = {"input_ids": [], "position_ids": [], "loss_mask": []}
        current["input_ids"] += ids
        current["position_ids"] += list(range(length))
        current["loss_mask"] += [0] * prompt + [1] * (length - prompt)
    columns = {key: [row[key] for row in rows] for key in rows[0]}
    split = {
        name: datasets.Dataset.from_dict({k: v[part] for k, v in columns.items()})
        for name, part in (
            ("train", slice(0, train_blocks)),
            ("validation", slice(train_blocks, None)),
        )
    }
    blocks = datasets.DatasetDict(split)
    blocks.save_to_disk(str(path))
    return datasets.load_from_disk(str(path))


def _padded(row: dict[str, list[int]]) -> dict[str, Any]:
    """The block's padding tail: pad ids, positions of its own, nothing trained."""
    real = len(row["input_ids"])
    pad = TINY_BLOCK - real
    return {
        "input_ids": row["input_ids"] + [0] * pad,
        "position_ids": row["position_ids"] + list(range(pad)),
        "loss_mask": row["loss_mask"] + [0] * pad,
        "num_tokens": real,
    }


def examples_of(block: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A block's examples as (ids, loss mask), cut where positions restart."""
    starts = (block["position_ids"] == 0).nonzero().flatten().tolist() + [TINY_BLOCK]
    return [
        (block["input_ids"][a:b], block["loss_mask"][a:b])
        for a, b in zip(starts, starts[1:], strict=False)
    ]


def example_loss_sum(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor):
    """Summed loss of one example run alone, and its trained tokens."""
    logits = model(input_ids=ids[None]).logits[0]
    keep = mask[1:].bool()
    if not keep.any():
        return logits.sum() * 0, 0
    loss = F.cross_entropy(logits[:-1][keep].float(), ids[1:][keep], reduction="sum")
    return loss, int(keep.sum())


def _block_rows(blocks: datasets.Dataset, indices: list[int]) -> list[dict[str, torch.Tensor]]:
    rows = blocks.select(indices).with_format("torch")
    return [rows[i] for i in range(len(indices))]


def packed_reference_run(
    blocks: datasets.DatasetDict,
    fields: dict[str, Any],
    steps: int = STEPS,
    architecture: str = "llama",
):
    """One process, every example alone: the losses per step and the final weights."""
    config = build_model_config(architecture, fields, vocab_size=TINY_VOCAB)
    model = build_model(config, seed=TRAINING["seed"])
    optimizer, schedule = reference_optimizer(model, steps)
    sampler = GlobalBatchSampler(len(blocks["train"]), GLOBAL_BATCH, TRAINING["seed"])
    losses = []
    for step in range(steps):
        total, count = torch.zeros(()), 0
        for block in _block_rows(blocks["train"], sampler.global_indices(step)):
            for ids, mask in examples_of(block):
                loss, trained = example_loss_sum(model, ids.long(), mask)
                total, count = total + loss, count + trained
        loss = total / count
        reference_step(model, loss, optimizer, schedule)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def alone_example_losses(blocks: datasets.DatasetDict, fields: dict[str, Any]) -> list[float]:
    """The untrained model's summed loss of each example of the first validation block,
    each run alone."""
    config = build_model_config("llama", fields, vocab_size=TINY_VOCAB)
    model = build_model(config, seed=TRAINING["seed"])
    (block,) = _block_rows(blocks["validation"], [0])
    with torch.no_grad():
        return [example_loss_sum(model, ids.long(), m)[0].item() for ids, m in examples_of(block)]


def packed_example_losses(trainer: Trainer) -> list[float]:
    """The first validation block through this rank's parallel model, once per example with
    the labels of that example only: the packed per-example losses. Collective."""
    store = BlockStore(trainer.spec.validation_files)
    # Two blocks, so a pipeline schedule can cut two microbatches; only the first is scored.
    whole = store.tokens([0, 1])
    example = torch.cumsum(whole.position_ids == 0, dim=1)
    example[1] = 0
    sums = []
    for number in range(1, int(example[0].max()) + 1):
        labels = whole.labels.masked_fill(example != number, IGNORE_INDEX)
        batch = TokenBatch(whole.input_ids, labels, whole.position_ids).to(trainer.device)
        trainer.pm.set_training(False)
        value = trainer.pm.eval_batch(batch).reshape(1).clone()
        if trainer.dims.pp > 1:
            dist.all_reduce(value, group=trainer.dims.pp_group)
        sums.append(value.item())
    return sums


@record
def train_and_probe(
    specs: list[WorkerSpec], probes: list[WorkerSpec]
) -> tuple[list[Any], list[list[float]]]:
    """Train `specs` in turn, then score the packed examples of each of `probes`, in one
    process group (start-up costs more than these runs)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        summaries = [train(spec) for spec in specs]
        return summaries, [packed_example_losses(Trainer(spec)) for spec in probes]
    finally:
        dist.destroy_process_group()


def labels_by_hand(block: dict[str, torch.Tensor]) -> list[int]:
    """Next-token labels written out position by position (the test of
    `next_token_labels`)."""
    ids, pos, mask = block["input_ids"], block["position_ids"], block["loss_mask"]
    labels = []
    for t in range(len(ids)):
        trained = t + 1 < len(ids) and pos[t + 1] != 0 and mask[t + 1] == 1
        labels.append(int(ids[t + 1]) if trained else IGNORE_INDEX)
    return labels


def check_labels(blocks: datasets.DatasetDict) -> None:
    store = BlockStore(arrow_files(blocks["train"]))
    for index, block in enumerate(_block_rows(blocks["train"], list(range(8)))):
        got = store.tokens([index]).labels[0].tolist()
        assert (
            got
            == labels_by_hand(block)
            == next_token_labels(
                block["input_ids"][None].long(),
                block["position_ids"][None],
                block["loss_mask"][None],
            )[0].tolist()
        )
