"""Preference pairs (TRL's DPO formats) to packed blocks that keep each pair whole.

TRL's two preference formats: explicit prompt (`prompt`, `chosen`, `rejected`, strings or
message lists) and implicit prompt (`chosen` and `rejected` conversations, or strings,
whose shared beginning is the prompt, `trl.extract_prompt`'s rule). Each pair becomes two
sequences tokenized as TRL's `DPOTrainer` does: the prompt and each completion through
the chat template (an eos after a string completion), the completion starting where the
prompt's tokens and the whole sequence's part. The chosen sequence and then the rejected
one go side by side into a block, each with its own positions, so a pair is never split
over blocks or microbatches; blocks are best-fit as fine-tuning examples are
(`data/bfd.py`), a pair counting as one item of both sequences' length.
"""

from __future__ import annotations

from typing import Any

import datasets
import numpy as np

from meshtrain.config_parsing import ConfigError
from meshtrain.data.bfd import PackingReport, best_fit_decreasing, blocks_dataset, fill_blocks
from meshtrain.data.chat_tokens import common_prefix, render_chat, require_chat_template
from meshtrain.data.example_sources import ORIGIN, ExamplesError, bad_row, check_part
from meshtrain.data.fine_tuning import pack_each_split

PREFERENCE_COLUMNS = ("chosen", "rejected")
PREFERENCE_BLOCKS = "meshtrain preference pairs: chosen then rejected, positions restarting"
"""The description saved with blocks of pairs (their columns are those of any packed
blocks): what tells the planning node the data is pairs."""


def blocks_format(split: datasets.Dataset) -> str:
    """`preference` for blocks of pairs, else `examples` (packed or streamed)."""
    return "preference" if split.info.description == PREFERENCE_BLOCKS else "examples"


def with_explicit_prompts(ds: datasets.Dataset) -> datasets.Dataset:
    """Implicit-prompt pairs split into prompt, chosen and rejected (TRL's
    `extract_prompt`: the longest shared beginning, turns or characters); explicit ones
    as they are."""
    if "prompt" in ds.column_names:
        return ds

    def split(row: dict[str, Any]) -> dict[str, Any]:
        chosen, rejected = row["chosen"], row["rejected"]
        shared = 0
        for a, b in zip(chosen, rejected, strict=False):
            if a != b:
                break
            shared += 1
        if isinstance(chosen, str) and 0 < shared < len(chosen) and chosen[shared - 1] == " ":
            shared -= 1  # the space before the completion goes with it, as TRL keeps it
        return {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}

    return ds.map(split, desc="Extract the shared prompts")


def check_pairs(ds: datasets.Dataset, *, explicit: bool) -> tuple[datasets.Dataset, int]:
    """Refuse a malformed pair, naming file, row and column; skip (and count) the pairs
    whose chosen and rejected are the same (nothing to prefer). `explicit`: the rows came
    with their prompts. Returns the pairs to train on, without origins."""
    keep = []
    for index, row in enumerate(ds):
        check_part(row, "prompt", allow_empty=True)
        for column in PREFERENCE_COLUMNS:
            if row[column] is None:
                raise bad_row(row, column, "is missing: a pair needs both a chosen and a rejected")
            check_part(row, column, allow_empty=False)
            if explicit:
                _refuse_repeated_prompt(row, column)
        if row["chosen"] != row["rejected"]:
            keep.append(index)
    if not keep:
        raise ExamplesError(
            f"all {len(ds)} pairs have the same chosen and rejected: nothing to prefer"
        )
    skipped = len(ds) - len(keep)
    if skipped:
        print(f"{skipped} pair(s) with the same chosen and rejected skipped (nothing to prefer)")
    return (ds.select(keep) if skipped else ds).remove_columns(ORIGIN), skipped


def _refuse_repeated_prompt(row: dict, column: str) -> None:
    """An explicit prompt repeated at the start of a completion would be trained on (and
    seen twice): the row holds implicit-prompt completions under an explicit prompt."""
    prompt, completion = row["prompt"], row[column]
    if not prompt or type(prompt) is not type(completion):
        return
    if completion[: len(prompt)] == prompt:
        raise bad_row(
            row,
            column,
            "starts with the row's prompt: with a prompt column, chosen and rejected hold "
            "the completions alone (drop the prompt column to have it found in them)",
        )


def tokenize_pair(row: dict, tokenizer: Any) -> tuple[list[int], list[int], int]:
    """(prompt + chosen ids, prompt + rejected ids, the prompt's length), as TRL's
    `DPOTrainer` tokenizes a pair."""
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if isinstance(chosen, list):
        head = _tokens(tokenizer, render_chat(tokenizer, prompt, generation_prompt=True))
        with_chosen = _tokens(tokenizer, render_chat(tokenizer, prompt + chosen))
        with_rejected = _tokens(tokenizer, render_chat(tokenizer, prompt + rejected))
    else:
        eos = tokenizer.eos_token
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        head = tokenizer(prompt)["input_ids"]
        with_chosen = tokenizer(prompt + chosen)["input_ids"]
        with_rejected = tokenizer(prompt + rejected)["input_ids"]
    start = min(common_prefix(head, with_chosen), common_prefix(head, with_rejected))
    return head[:start] + with_chosen[start:], head[:start] + with_rejected[start:], start


def _tokens(tokenizer: Any, text: str) -> list[int]:
    """A rendered conversation's ids, as `apply_chat_template(tokenize=True)` makes them."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_pairs(ds: datasets.Dataset, tokenizer: Any, num_proc: int | None) -> datasets.Dataset:
    """`chosen_ids`, `rejected_ids` and `prompt_length` per pair; the same for any
    `num_proc`."""
    if len(ds) and isinstance(ds[0]["chosen"], list):
        require_chat_template(tokenizer)

    def encode(row: dict) -> dict:
        chosen, rejected, start = tokenize_pair(row, tokenizer)
        return {"chosen_ids": chosen, "rejected_ids": rejected, "prompt_length": start}

    return ds.map(
        encode,
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        remove_columns=ds.column_names,
        features=datasets.Features(
            {
                "chosen_ids": datasets.List(datasets.Value("int32")),
                "rejected_ids": datasets.List(datasets.Value("int32")),
                "prompt_length": datasets.Value("int32"),
            }
        ),
        desc="Tokenize pairs",
    )


def pack_pairs(
    pairs: datasets.Dataset, *, block_size: int, truncation: str, pad_token_id: int, seed: int
) -> tuple[datasets.Dataset, PackingReport]:
    """Blocks of whole pairs (chosen, then rejected), the columns `data/bfd.py` writes."""
    sequences, trained, dropped, truncated = _fit_pairs(pairs, block_size, truncation)
    lengths = [
        len(sequences[2 * p]) + len(sequences[2 * p + 1]) for p in range(len(sequences) // 2)
    ]
    blocks = best_fit_decreasing(lengths, block_size)
    blocks = [blocks[i] for i in np.random.default_rng(seed).permutation(len(blocks))]
    members = [[s for p in block for s in (2 * p, 2 * p + 1)] for block in blocks]
    arrays = fill_blocks(members, sequences, trained, block_size, pad_token_id)
    report = PackingReport.of(arrays, len(lengths), dropped=dropped, truncated=truncated)
    return blocks_dataset(arrays, block_size, PREFERENCE_BLOCKS), report


def _fit_pairs(
    pairs: datasets.Dataset, block_size: int, truncation: str
) -> tuple[list[list[int]], list[list[int]], int, int]:
    """Each kept pair's two sequences and trained masks, in order (chosen, rejected), with
    the pairs dropped and truncated. A pair fits when both sequences fit one block;
    `truncate` cuts each sequence to half a block, keeping its start (TRL's keep_start)."""
    long = [
        i
        for i, (c, r) in enumerate(zip(pairs["chosen_ids"], pairs["rejected_ids"], strict=True))
        if len(c) + len(r) > block_size
    ]
    if long and truncation == "off":
        raise ConfigError(
            f"{len(long)} pair(s) are longer than data.block_size={block_size} tokens (chosen "
            "and rejected share a block) and data.truncation is off: raise data.block_size, or "
            "set data.truncation=drop (leave them out, counted) or truncate."
        )
    sequences, trained, dropped, truncated = [], [], 0, 0
    long_set = set(long)
    for i, row in enumerate(pairs):
        start = row["prompt_length"]
        pair = [row["chosen_ids"], row["rejected_ids"]]
        masks = [[0] * start + [1] * (len(ids) - start) for ids in pair]
        if i in long_set:
            if truncation == "drop":
                dropped += 1
                continue
            pair, masks = (
                [ids[: block_size // 2] for ids in pair],
                [m[: block_size // 2] for m in masks],
            )
            if not all(any(m[1:]) for m in masks):
                dropped += 1
                continue
            truncated += 1
        for ids, mask in zip(pair, masks, strict=True):
            mask[0] = 0  # nothing precedes a sequence's first token
            sequences.append(ids)
            trained.append(mask)
    return sequences, trained, dropped, truncated


def pack_preferences(
    examples: datasets.Dataset,
    tokenizer: Any,
    *,
    block_size: int,
    truncation: str,
    validation_fraction: float,
    seed: int,
    num_proc: int | None = None,
) -> tuple[datasets.DatasetDict, dict[str, PackingReport]]:
    """`train` / `validation` blocks of whole pairs and each split's packing report."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def pack(split: datasets.Dataset) -> tuple[datasets.Dataset, PackingReport, str]:
        tokens = tokenize_pairs(split, tokenizer, num_proc)
        packed, report = pack_pairs(
            tokens, block_size=block_size, truncation=truncation, pad_token_id=pad, seed=seed
        )
        return packed, report, ""

    return pack_each_split(examples, pack, validation_fraction, seed, block_size, "pair")
