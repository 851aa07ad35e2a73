"""Evaluate a consolidated model with plain `transformers`, as its users will load it.

Nothing here touches meshtrain's training code: the model comes from
`AutoModelForCausalLM.from_pretrained`, so a good score also proves the
consolidated folder is a working Hugging Face model. It is scored where it
trained (a GPU and bf16 for an nccl bf16 run, `evaluation.device` / `dtype`),
and the samples are seeded, so a rerun reads the same text.

Fine-tuning blocks (packed examples with a loss mask) are scored as training scores
them: only the trained tokens, each example attending only to itself. Their samples
are chat turns: the example's own rendered prompt, the answer it trained on, and the
model's response.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshtrain.checkpoint.consolidate.lora import adapter_base, is_adapter_folder
from meshtrain.config import ConfigError, EvaluationConfig
from meshtrain.data.batch import TokenBatch, next_token_labels
from meshtrain.data.blocks import PACKED_COLUMNS, is_packed
from meshtrain.device import evaluation_device, free_bytes, is_accelerator
from meshtrain.models.head_loss import linear_cross_entropy_sum
from meshtrain.models.packed_attention import packed_causal_mask
from meshtrain.planner.loss_memory import auto_loss_chunk_tokens

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Room left on a GPU beside the weights (activations, the KV cache of the samples).
_HEADROOM = 1.25
# Chat templates' end-of-turn tokens (ChatML, Llama 3, Gemma): a response ends at one.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")


def resolve_device(device: str, backend: str | None) -> str:
    """`auto`: the accelerator when the model trained on one and one is here, else the
    CPU."""
    try:
        return evaluation_device(device, backend)
    except ValueError as error:
        raise ConfigError(
            f"`evaluation.device` is {device!r} but {error}; use auto or cpu."
        ) from None


def resolve_dtype(dtype: str, mixed_precision: str | None, device: str) -> torch.dtype:
    """`auto`: bf16 for a model trained in bf16 and scored on an accelerator, else fp32."""
    if dtype != "auto":
        return DTYPES[dtype]
    bf16 = mixed_precision in ("bf16", "bf16_master") and is_accelerator(device)
    return torch.bfloat16 if bf16 else torch.float32


def _weights_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """The weights' size in `dtype`, from the files (fp32 files count at their size)."""
    on_disk = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return on_disk * torch.finfo(dtype).bits // 32


def load_model(model_dir: str | Path, device: str, dtype: torch.dtype):
    """The model on `device`; on a GPU too small for it, spread over the visible GPUs
    (and the CPU) by accelerate's `device_map="auto"` instead of refused. A PEFT adapter
    folder (a LoRA run's) is its base with the adapters, as PEFT loads them."""
    model_dir = Path(model_dir)
    if is_adapter_folder(model_dir):
        from peft import PeftModel  # noqa: PLC0415

        base = load_model(adapter_base(model_dir), device, dtype)
        return PeftModel.from_pretrained(base, str(model_dir)).eval()
    if is_accelerator(device) and _weights_bytes(model_dir, dtype) * _HEADROOM > free_bytes(device):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, device_map="auto")
        return model.eval()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.to(device).eval()


def input_device(model) -> torch.device:
    """Where the token ids go: the embedding's device (the first of a spread model)."""
    return model.get_input_embeddings().weight.device


def token_batches(
    validation: datasets.Dataset, batch_size: int, count: int
) -> Iterator[TokenBatch]:
    """The first `count` blocks as `TokenBatch`es: every next token of a pretraining
    block is a target, only the trained ones of a fine-tuning block."""
    packed = is_packed(validation)
    columns = ["input_ids", *PACKED_COLUMNS] if packed else ["input_ids"]
    rows = validation.select_columns(columns).with_format("torch")
    for start in range(0, count, batch_size):
        batch = rows[start : min(count, start + batch_size)]
        input_ids = batch["input_ids"].long()
        if not packed:
            yield TokenBatch.of_ids(input_ids)
            continue
        positions = batch["position_ids"].long()
        labels = next_token_labels(input_ids, positions, batch["loss_mask"])
        yield TokenBatch(input_ids, labels, positions)


def summed_loss(model, batch: TokenBatch, chunk_tokens: int | None = None) -> float:
    """The summed cross-entropy of the batch's targets. Packed examples attend only
    inside themselves, with their own positions, so each scores as it would alone.

    The LM head and the loss run chunk by chunk (`models.head_loss`), as in training:
    a long block's logits over a large vocabulary are never held whole (`chunk_tokens`:
    None for the planner's `auto` choice)."""
    batch = batch.to(input_device(model))
    inputs: dict[str, torch.Tensor] = {"input_ids": batch.input_ids}
    if batch.position_ids is not None:
        inputs["position_ids"] = batch.position_ids
        inputs["attention_mask"] = packed_causal_mask(batch.position_ids)
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    head = model.get_output_embeddings().weight
    chunk = chunk_tokens or auto_loss_chunk_tokens(head.shape[0], 1, batch.input_ids.numel())
    loss = linear_cross_entropy_sum(hidden, head, batch.labels.to(hidden.device), chunk)
    return loss.item()


@torch.no_grad()
def validation_loss(
    model,
    validation: datasets.Dataset,
    batch_size: int,
    max_batches: int | None,
    chunk_tokens: int | None = None,
) -> dict[str, Any]:
    """Mean loss per trained token, and perplexity, over the validation blocks (of
    fine-tuning blocks only the tokens `data.loss_on` trains count, as in training).
    `val_tokens` is the number of tokens scored."""
    count = (
        len(validation) if max_batches is None else min(len(validation), max_batches * batch_size)
    )
    if count == 0:
        raise ValueError("the validation split is empty; raise data.validation_fraction")
    loss_sum, tokens = 0.0, 0
    started = time.perf_counter()
    for batch in token_batches(validation, batch_size, count):
        loss_sum += summed_loss(model, batch, chunk_tokens)
        tokens += batch.trained_tokens
    eval_seconds = time.perf_counter() - started
    if tokens == 0:
        raise ValueError("the validation blocks train no token (their loss_mask is all 0)")
    val_loss = loss_sum / tokens
    return {
        "val_loss": val_loss,
        "val_perplexity": math.exp(val_loss),
        "val_tokens": tokens,
        "val_blocks": count,
        "eval_tokens_per_s": tokens / eval_seconds if eval_seconds > 0 else None,
    }


def spread(total: int, count: int) -> list[int]:
    """Up to `count` indices spread evenly over `range(total)`, first and last included."""
    return sorted({round(i * (total - 1) / max(count - 1, 1)) for i in range(count)})


def validation_prompts(
    validation: datasets.Dataset, tokenizer, count: int, prompt_tokens: int
) -> list[str]:
    """`count` prompts from blocks spread evenly over the validation split: each the text
    of about a block's first `prompt_tokens` tokens, in whole words (a block may start
    and the cut may end inside one)."""
    blocks = validation.select_columns(["input_ids"])
    prompts = []
    for index in spread(len(blocks), count):
        text = tokenizer.decode(blocks[index]["input_ids"][: prompt_tokens + 2])
        words = text.split(" ")
        whole = " ".join(words[1:-1]).strip() if len(words) > 3 else text.strip()
        prompts.append(whole or text)
    return prompts


def generate(
    model,
    tokenizer,
    ids: list[int],
    cfg: EvaluationConfig,
    seed: int,
    stop: list[int] | None = None,
) -> torch.Tensor:
    """The tokens generated after `ids`: seeded sampling (temperature, top-p, repetition
    penalty), or greedy with `do_sample=false`; ending at `stop` ids when given."""
    knobs: dict[str, Any] = {
        "do_sample": cfg.do_sample,
        "repetition_penalty": cfg.repetition_penalty,
    }
    if cfg.do_sample:
        knobs |= {"temperature": cfg.temperature, "top_p": cfg.top_p}
    if stop:
        knobs["eos_token_id"] = stop
    torch.manual_seed(seed)  # seeds the CUDA generators too
    input_ids = torch.tensor([ids], device=input_device(model))
    generated = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=cfg.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        **knobs,
    )
    return generated[0, input_ids.shape[1] :]


@torch.no_grad()
def generate_samples(model, tokenizer, prompts: list[str], cfg: EvaluationConfig) -> list[dict]:
    """A continuation of each text prompt."""
    samples = []
    for offset, prompt in enumerate(prompts):
        new = generate(model, tokenizer, tokenizer(prompt)["input_ids"], cfg, cfg.seed + offset)
        continuation = tokenizer.decode(new, skip_special_tokens=True)
        samples.append({"prompt": prompt, "continuation": continuation})
    return samples


def stop_token_ids(tokenizer) -> list[int]:
    """The eos and, where the tokenizer has one, its chat template's end-of-turn token: a
    response ends at either."""
    found = [tokenizer.eos_token_id]
    for token in END_OF_TURN_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        # An unknown token comes back as the unk id (or None).
        if token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == token:
            found.append(token_id)
    return [token_id for token_id in dict.fromkeys(found) if token_id is not None]


def example_spans(positions: np.ndarray, loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each example of a block that trains a token (the padding tail
    trains none)."""
    starts = [*np.flatnonzero(positions == 0).tolist(), len(positions)]
    return [(a, b) for a, b in zip(starts, starts[1:], strict=False) if loss_mask[a + 1 : b].any()]


def sample_examples(validation: datasets.Dataset, count: int) -> list[tuple[int, int, int]]:
    """`count` examples spread evenly over the split's, as (block, start, end)."""
    rows = validation.select_columns(list(PACKED_COLUMNS)).with_format("numpy")
    spans = []
    for first in range(0, len(rows), 1024):
        batch = rows[first : first + 1024]
        for offset, row in enumerate(zip(batch["position_ids"], batch["loss_mask"], strict=True)):
            spans += [(first + offset, a, b) for a, b in example_spans(*row)]
    if not spans:
        raise ValueError("no validation example trains a token (their loss_mask is all 0)")
    return [spans[i] for i in spread(len(spans), count)]


def prompt_and_reference(ids: list[int], loss_mask: list[int]) -> tuple[list[int], list[int]]:
    """An example's tokens before its first trained one (as rendered for training, so
    ending in the template's generation prompt), and its first run of trained tokens."""
    first = next(i for i in range(1, len(ids)) if loss_mask[i])
    end = next((i for i in range(first, len(ids)) if not loss_mask[i]), len(ids))
    return ids[:first], ids[first:end]


@torch.no_grad()
def chat_samples(
    model, tokenizer, validation: datasets.Dataset, cfg: EvaluationConfig
) -> list[dict[str, str]]:
    """A response to each of `num_samples` validation prompts, beside the reference the
    model trained on; the prompt keeps its special tokens, so the template shows."""
    rows = validation.select_columns(["input_ids", "loss_mask"])
    stop = stop_token_ids(tokenizer)
    samples = []
    for offset, (block, start, end) in enumerate(sample_examples(validation, cfg.num_samples)):
        row = rows[block]
        prompt, reference = prompt_and_reference(
            row["input_ids"][start:end], row["loss_mask"][start:end]
        )
        new = generate(model, tokenizer, prompt, cfg, cfg.seed + offset, stop)
        samples.append(
            {
                "prompt": tokenizer.decode(prompt, skip_special_tokens=False),
                "reference": tokenizer.decode(reference, skip_special_tokens=True),
                "response": tokenizer.decode(new, skip_special_tokens=True),
            }
        )
    return samples


def model_samples(
    model, tokenizer, validation: datasets.Dataset, cfg: EvaluationConfig
) -> list[dict[str, str]]:
    """{prompt, reference, response} on fine-tuning data; {prompt, continuation} of
    `evaluation.prompts` or of the validation text otherwise."""
    if cfg.prompts is None and is_packed(validation):
        return chat_samples(model, tokenizer, validation, cfg)
    prompts = cfg.prompts or validation_prompts(
        validation, tokenizer, cfg.num_samples, cfg.prompt_tokens
    )
    return generate_samples(model, tokenizer, prompts, cfg)


def evaluate_model(
    model_dir: str | Path,
    validation: datasets.Dataset,
    cfg: EvaluationConfig,
    *,
    backend: str | None = None,
    mixed_precision: str | None = None,
) -> tuple[dict[str, Any], Any, Any]:
    """Validation loss and perplexity, and the samples. Returns the metrics, the model and
    its tokenizer (for lm-evaluation-harness, so the model is loaded once)."""
    device = resolve_device(cfg.device, backend)
    dtype = resolve_dtype(cfg.dtype, mixed_precision, device)
    model = load_model(model_dir, device, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    metrics = validation_loss(model, validation, cfg.batch_size, cfg.max_batches)
    samples = model_samples(model, tokenizer, validation, cfg)
    first = samples[0]
    metrics |= {
        "eval_device": str(input_device(model)),
        "eval_dtype": str(dtype).removeprefix("torch."),
        "samples": samples,
        # The first sample as one text, as before `samples` (and the eval.sample tag).
        "prompt": first["prompt"],
        "sample": first["prompt"] + first.get("continuation", first.get("response", "")),
    }
    return metrics, model, tokenizer
