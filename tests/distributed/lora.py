"""The one-process oracle of the LoRA tests: the `peft` library on the same base, starting
from the same adapter values, trained by the plain loop of `reference.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from meshtrain.checkpoint.consolidate.peft_layout import is_adapter, peft_tensors
from meshtrain.config import LoraSettings
from meshtrain.data.blocks import BlockStore, arrow_files
from meshtrain.data.sampler import GlobalBatchSampler
from meshtrain.models import build_model, build_model_config
from meshtrain.models.lora import AdapterInit
from meshtrain.models.shapes import lora_adapter_shapes
from meshtrain.trainer import WorkerSpec
from tests.conftest import TINY_MODEL, TINY_VOCAB
from tests.distributed.reference import (
    GLOBAL_BATCH,
    TRAINING,
    make_spec,
    reference_optimizer,
    reference_step,
)

# GQA with one KV head for four query heads: at tp 2 the KV head is replicated.
GQA = {**TINY_MODEL, "num_hidden_layers": 4, "num_key_value_heads": 1}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
STEPS, SAVE_AT = 12, 6  # a LoRA run's steps, and its checkpoint to resume from


def save_base(folder: Path, fields: dict[str, Any] = GQA, architecture: str = "llama") -> Path:
    """The pretrained base: the seeded model of `fields`, saved as Hugging Face does."""
    config = build_model_config(architecture, fields, vocab_size=TINY_VOCAB)
    build_model(config, seed=TRAINING["seed"]).save_pretrained(folder)
    return folder


def lora_spec(
    blocks: datasets.DatasetDict,
    out: Path,
    name: str,
    parallel: dict[str, Any],
    training: dict[str, Any],
    base: Path,
    *,
    lora: dict[str, Any] = LORA,
    fields: dict[str, Any] = GQA,
    architecture: str = "llama",
) -> WorkerSpec:
    """A 2-rank LoRA run from the base folder `base`, of `STEPS` steps with a checkpoint
    at `SAVE_AT`."""
    return make_spec(
        blocks,
        out,
        name,
        world=2,
        parallel=parallel,
        training={**training, "max_steps": STEPS, "checkpoint_every": SAVE_AT},
        architecture=architecture,
        fields=fields,
        model={"lora": lora, "init_from": str(base)},
    )


def assert_matches_peft(name: str, summary: dict, losses: list[float], first_step: int = 0):
    got = [loss for _, loss in summary["losses"]]
    assert len(got) == len(losses) - first_step, name
    for step, (a, b) in enumerate(zip(got, losses[first_step:], strict=True), first_step):
        assert abs(a - b) / abs(b) <= 1e-5, f"{name} step {step}: {a} vs {b}"


def peft_model(
    fields: dict[str, Any],
    lora: dict[str, Any],
    architecture: str = "llama",
    base: torch.nn.Module | None = None,
) -> torch.nn.Module:
    """PEFT's LoRA model on `base` (default: the seeded base), its adapters set to
    meshtrain's initial values (drawn under meshtrain's names, laid out as PEFT's)."""
    if base is None:
        config = build_model_config(architecture, fields, vocab_size=TINY_VOCAB)
        base = build_model(config, seed=TRAINING["seed"])
    settings = {k: v for k, v in lora.items() if k != "allow_random_base"}
    shapes = lora_adapter_shapes(base.config, LoraSettings(**settings))
    model = get_peft_model(base, LoraConfig(**settings))
    initial = AdapterInit(base=None, shapes=shapes, seed=TRAINING["seed"])
    values = peft_tensors({name: initial.full(name) for name in shapes if is_adapter(name)})
    # The modules trained whole start as the base, in PEFT as in meshtrain.
    trained = {
        n: p for n, p in model.named_parameters() if p.requires_grad and "modules_to_save" not in n
    }
    assert {peft_key(name) for name in trained} == values.keys()
    with torch.no_grad():
        for name, parameter in trained.items():
            parameter.copy_(values[peft_key(name)])
    return model


def peft_key(name: str) -> str:
    """PEFT's in-memory parameter name -> its file's key (no adapter name; an embedding's
    adapters end with it)."""
    return name.replace(".default.", ".").removesuffix(".default")


def peft_reference_run(
    blocks: datasets.DatasetDict,
    fields: dict[str, Any],
    lora: dict[str, Any],
    steps: int,
    architecture: str = "llama",
    base: torch.nn.Module | None = None,
) -> tuple[list[float], dict[str, torch.Tensor], torch.nn.Module]:
    """Losses per step, PEFT's saved adapter tensors (its file's keys) after, the model."""
    model = peft_model(fields, lora, architecture, base)
    optimizer, schedule = reference_optimizer(model, steps)
    store = BlockStore(arrow_files(blocks["train"]))
    sampler = GlobalBatchSampler(len(store), GLOBAL_BATCH, TRAINING["seed"])
    losses = []
    for step in range(steps):
        ids = store.batch(sampler.global_indices(step))
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, TINY_VOCAB), ids[:, 1:].reshape(-1))
        reference_step(model, loss, optimizer, schedule)
        losses.append(loss.item())
    # Without the frozen embedding PEFT adds when one is adapted ("auto"): meshtrain never
    # resizes it, so its adapter folder leaves the base out.
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    saved = {k: v.detach().clone() for k, v in state.items()}
    return losses, saved, model
