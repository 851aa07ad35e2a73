"""Evaluating a fine-tuned model: the loss of packed examples equals each example's alone,
samples are chat turns (prompt, reference, response) ending at the end-of-turn token,
lm-evaluation-harness asks in the chat template, and the MLflow dataset inputs say how
the fine-tuning blocks were made."""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import jinja2
import mlflow
import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient
from transformers import LlamaConfig, LlamaForCausalLM

from meshtrain.benchmarks import run_lm_eval
from meshtrain.config import EvaluationConfig
from meshtrain.data.tokenizer import train_tokenizer
from meshtrain.evaluation import (
    generate,
    model_samples,
    spread,
    stop_token_ids,
    validation_loss,
)
from meshtrain.pipelines.evaluation.nodes import evaluate
from meshtrain.tracking import mlflow_run as tracking
from meshtrain.tracking.datasets import log_packed_blocks
from tests.conftest import TINY_VOCAB
from tests.distributed.packed import example_loss_sum, examples_of

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["print", "len", "sorted", "zip", "open", "range", "repr", "sum", "map", "iter"]
CHAT_BLOCK = 96


def tiny_llama(vocab_size: int, tokenizer=None) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if tokenizer is not None:
        config.eos_token_id = config.bos_token_id = config.pad_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def chat_tokenizer():
    """meshtrain's byte-level BPE (with ChatML's turn tokens) and a ChatML template."""
    texts = [f"What does {w} do? {w} is a builtin of Python." for w in WORDS]
    tokenizer = train_tokenizer(datasets.Dataset.from_dict({"text": texts * 20}), 320)
    tokenizer.chat_template = CHATML
    return tokenizer


def conversations() -> list[tuple[str, str]]:
    return [(f"What does {w} do?", f"{w} is a builtin.") for w in WORDS]


def chat_blocks(tokenizer, *, num_tokens: bool = True) -> datasets.Dataset:
    """The conversations rendered with the template and packed in order into blocks:
    the prompt untrained, the answer and its <|im_end|> trained, a padded tail."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows: list[dict[str, list[int]]] = []
    row: dict[str, list[int]] = {"input_ids": [], "position_ids": [], "loss_mask": []}
    for question, answer in conversations():
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [im_end]
        newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
        ids = prompt_ids + answer_ids + newline
        if len(row["input_ids"]) + len(ids) > CHAT_BLOCK:
            rows.append(row)
            row = {"input_ids": [], "position_ids": [], "loss_mask": []}
        row["input_ids"] += ids
        row["position_ids"] += list(range(len(ids)))
        row["loss_mask"] += [0] * len(prompt_ids) + [1] * len(answer_ids) + [0] * len(newline)
    rows.append(row)
    for row in rows:
        real, pad = len(row["input_ids"]), CHAT_BLOCK - len(row["input_ids"])
        row["input_ids"] += [tokenizer.eos_token_id] * pad
        row["position_ids"] += list(range(pad))
        row["loss_mask"] += [0] * pad
        if num_tokens:
            row["num_tokens"] = real
    return datasets.Dataset.from_dict({key: [r[key] for r in rows] for key in rows[0]})


def test_a_packed_blocks_loss_is_its_examples_alone(packed_blocks):
    model = tiny_llama(TINY_VOCAB)
    validation = packed_blocks["validation"]
    got = validation_loss(model, validation, batch_size=4, max_batches=None)
    total, trained = 0.0, 0
    with torch.no_grad():
        for block in validation.with_format("torch"):
            for ids, mask in examples_of(block):  # the padding tail trains nothing
                loss, count = example_loss_sum(model, ids.long(), mask)
                total, trained = total + loss.item(), trained + count
    assert got["val_tokens"] == trained
    assert got["val_loss"] == pytest.approx(total / trained, rel=1e-5)
    assert got["val_perplexity"] == pytest.approx(math.exp(total / trained), rel=1e-5)
    # Other ids in the padding tails: the same loss, the same tokens.
    repadded = validation.map(
        lambda row: {"input_ids": row["input_ids"][: row["num_tokens"]] + [7] * 32}
    ).map(lambda row: {"input_ids": row["input_ids"][:32]})
    again = validation_loss(model, repadded, batch_size=4, max_batches=None)
    assert again["val_tokens"] == trained
    assert again["val_loss"] == pytest.approx(got["val_loss"], rel=1e-6)
    # The same ids scored as pretraining blocks: every next token counts.
    plain = validation_loss(model, validation.select_columns(["input_ids"]), 4, None)
    assert plain["val_tokens"] == len(validation) * 31 > trained


def test_pretraining_blocks_score_every_next_token(tiny_blocks):
    model = tiny_llama(TINY_VOCAB)
    got = validation_loss(model, tiny_blocks["validation"], batch_size=8, max_batches=1)
    ids = torch.tensor(tiny_blocks["validation"]["input_ids"][:8]).long()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, TINY_VOCAB), ids[:, 1:].reshape(-1))
    assert got["val_tokens"] == 8 * 31 and got["val_blocks"] == 8
    assert got["val_loss"] == pytest.approx(expected.item(), rel=1e-5)
    # Scored in chunks of 40 tokens (the last one short), as a large vocabulary would be.
    chunked = validation_loss(model, tiny_blocks["validation"], 8, 1, chunk_tokens=40)
    assert chunked["val_loss"] == pytest.approx(expected.item(), rel=1e-5)


def test_chat_samples_are_prompt_reference_and_response(chat_tokenizer):
    blocks = chat_blocks(chat_tokenizer)
    model = tiny_llama(len(chat_tokenizer), chat_tokenizer)
    cfg = EvaluationConfig(num_samples=3, max_new_tokens=6)
    samples = model_samples(model, chat_tokenizer, blocks, cfg)
    picked = [conversations()[i] for i in spread(len(WORDS), 3)]  # first, middle, last
    assert [list(s) for s in samples] == [["prompt", "reference", "response"]] * 3
    for sample, (question, answer) in zip(samples, picked, strict=True):
        assert (
            sample["prompt"] == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert sample["reference"] == answer
        assert "<|im_end|>" not in sample["response"]
    assert model_samples(model, chat_tokenizer, blocks, cfg) == samples  # seeded
    # Text prompts given by name keep the continuation samples.
    named = model_samples(model, chat_tokenizer, blocks, EvaluationConfig(prompts=["zip"]))
    assert list(named[0]) == ["prompt", "continuation"]


def test_a_response_ends_at_the_end_of_turn_token(chat_tokenizer):
    """A prompt/completion example (no <|im_end|> in its prompt) and a model that says
    `z`, then (`z` penalised for repeating) <|im_end|>, then `z` again: the response is
    `z`, where the eos alone would let it go on."""
    tok = chat_tokenizer
    eos, im_end, z = tok.eos_token_id, *tok.convert_tokens_to_ids(["<|im_end|>", "z"])
    assert stop_token_ids(tok) == [eos, im_end]  # <|eot_id|>, <end_of_turn>: not in it
    model = tiny_llama(len(tok), tok)
    head = torch.nn.Linear(32, len(tok), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[z], head.bias[im_end] = 10.0, 9.0
    model.lm_head = head
    cfg = EvaluationConfig(num_samples=1, max_new_tokens=8, do_sample=False)
    prompt = tok("Say hi:", add_special_tokens=False)["input_ids"]
    answer = tok(" hi", add_special_tokens=False)["input_ids"] + [im_end]
    assert generate(model, tok, prompt, cfg, 0, [eos]).tolist()[:3] == [z, im_end, z]
    assert generate(model, tok, prompt, cfg, 0, stop_token_ids(tok)).tolist() == [z, im_end]
    block = {
        "input_ids": [prompt + answer],
        "position_ids": [list(range(len(prompt + answer)))],
        "loss_mask": [[0] * len(prompt) + [1] * len(answer)],
    }
    (sample,) = model_samples(model, tok, datasets.Dataset.from_dict(block), cfg)
    assert sample == {"prompt": "Say hi:", "reference": " hi", "response": "z"}


def test_fine_tuned_models_are_asked_in_their_chat_template(chat_tokenizer, tmp_path: Path):
    """The node on a consolidated folder: chat samples, and the offline lm-eval task
    scored in the ChatML template. A template that refuses shows where it is applied:
    on fine-tuning blocks, not on pretraining ones nor by a tokenizer without one."""
    folder = tmp_path / "consolidated"
    tiny_llama(len(chat_tokenizer), chat_tokenizer).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    validation = chat_blocks(chat_tokenizer)
    evaluation = {
        "num_samples": 2,
        "max_new_tokens": 4,
        "lm_eval_tasks": ["meshtrain_python_basics"],
        "lm_eval_limit": 4,
        "lm_eval_batch_size": 4,
    }
    fine_tuned = datasets.DatasetDict({"validation": validation})
    metrics = evaluate({"output_dir": str(folder)}, fine_tuned, {}, evaluation)
    assert 0 <= metrics["lm_eval"]["meshtrain_python_basics/acc"] <= 1
    assert list(metrics["samples"][0]) == ["prompt", "reference", "response"]
    assert metrics["sample"].startswith(metrics["prompt"])
    assert math.isfinite(metrics["val_loss"])

    refusing = chat_tokenizer.__class__.from_pretrained(folder)
    refusing.chat_template = "{{ raise_exception('the template was applied') }}"
    refusing.save_pretrained(folder)
    with pytest.raises(jinja2.TemplateError, match="the template was applied"):
        evaluate({"output_dir": str(folder)}, fine_tuned, {}, evaluation)
    pretrained = datasets.DatasetDict({"validation": validation.select_columns(["input_ids"])})
    metrics = evaluate({"output_dir": str(folder)}, pretrained, {}, evaluation)
    assert "meshtrain_python_basics/acc" in metrics["lm_eval"]
    assert list(metrics["samples"][0]) == ["prompt", "continuation"]
    refusing.chat_template = None
    model = tiny_llama(len(refusing), refusing)
    tasks = ["meshtrain_python_basics"]
    scores = run_lm_eval(model, refusing, tasks, limit=2, batch_size=2, chat_template=True)
    assert "meshtrain_python_basics/acc" in scores


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("sft-evaluation")
    yield uri
    if mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(previous)


def _logged(store: str, blocks: datasets.DatasetDict, data: dict) -> dict[str, object]:
    with mlflow.start_run() as run:
        log_packed_blocks(blocks, data)
    inputs = MlflowClient(tracking_uri=store).get_run(run.info.run_id).inputs.dataset_inputs
    return {i.tags[0].value: i.dataset for i in inputs}


def test_fine_tuning_inputs_say_format_loss_packing_and_efficiency(store, chat_tokenizer):
    blocks = chat_blocks(chat_tokenizer)
    split = datasets.DatasetDict({"train": blocks, "validation": blocks})
    data = {
        "source": "builtin_instructions",
        "format": "conversational",
        "loss_on": "auto",
        "packing": "bfd",
        "columns": {"messages": "conversations"},
        "block_size": CHAT_BLOCK,
    }
    logged = _logged(store, split, data)
    train = logged["training"]
    assert train.name == "builtin_instructions-conversational-train-b96"
    profile = json.loads(train.profile)
    real = sum(blocks["num_tokens"])
    trained = sum(sum(mask[1:]) for mask in blocks["loss_mask"])  # no block starts trained
    assert profile == {
        "num_rows": len(blocks),
        "num_tokens": len(blocks) * CHAT_BLOCK,
        "format": "conversational",
        "columns": {"messages": "conversations"},
        "loss_on": "assistant",
        "packing": "bfd",
        "packing_efficiency": round(real / (len(blocks) * CHAT_BLOCK), 4),
        "real_tokens": real,
        "trained_tokens": trained,
    }
    tags = json.loads(train.source)["tags"]
    assert (tags["format"], tags["loss_on"], tags["packing"]) == (
        "conversational",
        "assistant",
        "bfd",
    )
    # Without num_tokens the padding tails are found from positions and the loss mask.
    bare = chat_blocks(chat_tokenizer, num_tokens=False)
    files = {"source": "files", "data_files": ["chats/a.jsonl"], "format": "prompt_completion"}
    validation = _logged(store, datasets.DatasetDict({"train": bare, "validation": bare}), files)
    bare_profile = json.loads(validation["validation"].profile)
    assert validation["validation"].name == "files-prompt_completion-validation"
    assert bare_profile["real_tokens"] == real and bare_profile["loss_on"] == "completion"
    source = json.loads(validation["validation"].source)
    assert (source["path"], source["data_files"]) == ("json", ["chats/a.jsonl"])


def test_chat_samples_are_a_table_of_prompt_reference_and_response(store, tmp_path: Path):
    samples = [{"prompt": "<|im_start|>user\nhi", "reference": "hello", "response": "hey"}]
    with mlflow.start_run() as run:
        tracking.log_samples(samples)
    client = MlflowClient(tracking_uri=store)
    table = json.loads(
        Path(client.download_artifacts(run.info.run_id, "samples.json", str(tmp_path))).read_text()
    )
    assert table["columns"] == ["prompt", "reference", "response"]
    assert table["data"] == [["<|im_start|>user\nhi", "hello", "hey"]]
