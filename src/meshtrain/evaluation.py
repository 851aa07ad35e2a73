"""Evaluate a consolidated model with plain `transformers`, as its users will load it.

Nothing here touches meshtrain's training code: the model comes from
`AutoModelForCausalLM.from_pretrained`, so a good score also proves the
consolidated folder is a working Hugging Face model.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer


@torch.no_grad()
def evaluate_model(
    model_dir: str | Path,
    validation: datasets.Dataset,
    *,
    batch_size: int,
    max_batches: int | None,
    prompt: str,
    max_new_tokens: int,
) -> dict[str, Any]:
    """Validation loss and perplexity over packed blocks, and a greedy sample from `prompt`."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model.eval()

    blocks = validation.select_columns(["input_ids"]).with_format("torch")
    count = len(blocks) if max_batches is None else min(len(blocks), max_batches * batch_size)
    if count == 0:
        raise ValueError("the validation split is empty; raise data.validation_fraction")
    loss_sum, tokens = 0.0, 0
    started = time.perf_counter()
    for start in range(0, count, batch_size):
        input_ids = blocks[start : min(count, start + batch_size)]["input_ids"].long()
        logits = model(input_ids=input_ids).logits
        vocab = logits.shape[-1]
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, vocab).float(),
            input_ids[:, 1:].reshape(-1),
            reduction="sum",
        )
        loss_sum += loss.item()
        tokens += input_ids[:, 1:].numel()
    eval_seconds = time.perf_counter() - started
    val_loss = loss_sum / tokens

    encoded = tokenizer(prompt, return_tensors="pt")
    generated = model.generate(
        **encoded,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    sample = tokenizer.decode(generated[0], skip_special_tokens=True)
    return {
        "val_loss": val_loss,
        "val_perplexity": math.exp(val_loss),
        "val_tokens": tokens,
        "val_blocks": count,
        "eval_tokens_per_s": tokens / eval_seconds if eval_seconds > 0 else None,
        "prompt": prompt,
        "sample": sample,
    }
