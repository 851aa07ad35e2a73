"""Evaluate a consolidated model with plain `transformers`, as its users will load it.

Nothing here touches meshtrain's training code: the model comes from
`AutoModelForCausalLM.from_pretrained`, so a good score also proves the
consolidated folder is a working Hugging Face model. It is scored where it
trained (a GPU and bf16 for an nccl bf16 run, `evaluation.device` / `dtype`),
and the samples are seeded, so a rerun reads the same text.
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

from meshtrain.config import ConfigError, EvaluationConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Room left on a GPU beside the weights (activations, the KV cache of the samples).
_HEADROOM = 1.25


def resolve_device(device: str, backend: str | None) -> str:
    """`auto`: a GPU when the model trained on NCCL and one is visible, else the CPU."""
    if device == "auto":
        return "cuda" if backend == "nccl" and torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"`evaluation.device` is {device!r} but no CUDA device is visible here; use auto "
            "or cpu."
        )
    return device


def resolve_dtype(dtype: str, mixed_precision: str | None, device: str) -> torch.dtype:
    """`auto`: bf16 for a model trained in bf16 and scored on a GPU, else fp32."""
    if dtype != "auto":
        return DTYPES[dtype]
    bf16 = mixed_precision in ("bf16", "bf16_master") and device.startswith("cuda")
    return torch.bfloat16 if bf16 else torch.float32


def _weights_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """The weights' size in `dtype`, from the files (fp32 files count at their size)."""
    on_disk = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return on_disk * torch.finfo(dtype).bits // 32


def load_model(model_dir: str | Path, device: str, dtype: torch.dtype):
    """The model on `device`; on a GPU too small for it, spread over the visible GPUs
    (and the CPU) by accelerate's `device_map="auto"` instead of refused."""
    model_dir = Path(model_dir)
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        free, _ = torch.cuda.mem_get_info(index)
        if _weights_bytes(model_dir, dtype) * _HEADROOM > free:
            model = AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=dtype, device_map="auto"
            )
            return model.eval()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.to(device).eval()


def input_device(model) -> torch.device:
    """Where the token ids go: the embedding's device (the first of a spread model)."""
    return model.get_input_embeddings().weight.device


@torch.no_grad()
def validation_loss(
    model, validation: datasets.Dataset, batch_size: int, max_batches: int | None
) -> dict[str, Any]:
    """Mean next-token loss and perplexity over the packed validation blocks."""
    blocks = validation.select_columns(["input_ids"]).with_format("torch")
    count = len(blocks) if max_batches is None else min(len(blocks), max_batches * batch_size)
    if count == 0:
        raise ValueError("the validation split is empty; raise data.validation_fraction")
    loss_sum, tokens = 0.0, 0
    started = time.perf_counter()
    for start in range(0, count, batch_size):
        input_ids = blocks[start : min(count, start + batch_size)]["input_ids"].long()
        input_ids = input_ids.to(input_device(model))
        logits = model(input_ids=input_ids).logits
        vocab = logits.shape[-1]
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, vocab).float(),
            input_ids[:, 1:].reshape(-1).to(logits.device),
            reduction="sum",
        )
        loss_sum += loss.item()
        tokens += input_ids[:, 1:].numel()
    eval_seconds = time.perf_counter() - started
    val_loss = loss_sum / tokens
    return {
        "val_loss": val_loss,
        "val_perplexity": math.exp(val_loss),
        "val_tokens": tokens,
        "val_blocks": count,
        "eval_tokens_per_s": tokens / eval_seconds if eval_seconds > 0 else None,
    }


def validation_prompts(
    validation: datasets.Dataset, tokenizer, count: int, prompt_tokens: int
) -> list[str]:
    """`count` prompts from blocks spread evenly over the validation split: each the text
    of about a block's first `prompt_tokens` tokens, in whole words (a block may start
    and the cut may end inside one)."""
    blocks = validation.select_columns(["input_ids"])
    picks = sorted({round(i * (len(blocks) - 1) / max(count - 1, 1)) for i in range(count)})
    prompts = []
    for index in picks:
        text = tokenizer.decode(blocks[index]["input_ids"][: prompt_tokens + 2])
        words = text.split(" ")
        whole = " ".join(words[1:-1]).strip() if len(words) > 3 else text.strip()
        prompts.append(whole or text)
    return prompts


@torch.no_grad()
def generate_samples(model, tokenizer, prompts: list[str], cfg: EvaluationConfig) -> list[dict]:
    """A continuation of each prompt: seeded sampling (temperature, top-p, repetition
    penalty), or greedy with `do_sample=false`."""
    knobs: dict[str, Any] = {
        "do_sample": cfg.do_sample,
        "repetition_penalty": cfg.repetition_penalty,
    }
    if cfg.do_sample:
        knobs |= {"temperature": cfg.temperature, "top_p": cfg.top_p}
    samples = []
    for offset, prompt in enumerate(prompts):
        torch.manual_seed(cfg.seed + offset)  # seeds the CUDA generators too
        encoded = tokenizer(prompt, return_tensors="pt").to(input_device(model))
        generated = model.generate(
            **encoded,
            max_new_tokens=cfg.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            **knobs,
        )
        new = generated[0, encoded["input_ids"].shape[1] :]
        continuation = tokenizer.decode(new, skip_special_tokens=True)
        samples.append({"prompt": prompt, "continuation": continuation})
    return samples


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
    prompts = cfg.prompts or validation_prompts(
        validation, tokenizer, cfg.num_samples, cfg.prompt_tokens
    )
    samples = generate_samples(model, tokenizer, prompts, cfg)
    metrics |= {
        "eval_device": str(input_device(model)),
        "eval_dtype": str(dtype).removeprefix("torch."),
        "samples": samples,
        # The first sample as one text, as before `samples` (and the eval.sample tag).
        "prompt": samples[0]["prompt"],
        "sample": samples[0]["prompt"] + samples[0]["continuation"],
    }
    return metrics, model, tokenizer
