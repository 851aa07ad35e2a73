"""Fine-tuning examples to packed blocks: split, tokenize, bin-pack.

Examples (TRL's formats: text, prompt/completion, conversational) are split into train
and validation whole, tokenized through the chat template with the mask of the tokens
`data.loss_on` trains, and best-fit into blocks where each keeps its own positions and
attention (`data/bfd.py`). What was skipped, dropped or truncated is counted and said.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import datasets

from meshtrain.config import LOSS_ON_BY_FORMAT
from meshtrain.config_parsing import ConfigError
from meshtrain.data.bfd import PackingReport, pack_examples
from meshtrain.data.chat_tokens import tokenize_examples
from meshtrain.data.packing import split_documents


def resolve_loss_on(loss_on: str, fmt: str) -> str:
    """`auto` as the format implies; a mask the format cannot have is refused."""
    if loss_on == "auto":
        return LOSS_ON_BY_FORMAT[fmt]
    if loss_on not in ("all", LOSS_ON_BY_FORMAT[fmt]):
        needs = next(f for f, on in LOSS_ON_BY_FORMAT.items() if on == loss_on)
        raise ConfigError(
            f"`data.loss_on={loss_on}` needs {needs.replace('_', '/')} data but the examples "
            f"are {fmt.replace('_', '/')}: use data.loss_on={LOSS_ON_BY_FORMAT[fmt]} or all."
        )
    return loss_on


def resolve_packing(packing: str, fmt: str) -> str:
    """`auto`: a text corpus streams (pretraining), examples are packed whole."""
    if packing == "auto":
        return "stream" if fmt == "text" else "bfd"
    if packing == "stream" and fmt != "text":
        raise ConfigError(
            f"`data.packing=stream` concatenates text documents, but the examples are "
            f"{fmt.replace('_', '/')}: use data.packing=bfd (or auto)."
        )
    return packing


def pack_fine_tuning(
    examples: datasets.Dataset,
    tokenizer: Any,
    *,
    fmt: str,
    loss_on: str,
    block_size: int,
    truncation: str,
    validation_fraction: float,
    seed: int,
    num_proc: int | None = None,
) -> tuple[datasets.DatasetDict, dict[str, PackingReport]]:
    """`train` / `validation` packed blocks (input_ids, position_ids, loss_mask,
    num_tokens) and each split's packing report."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def pack(split: datasets.Dataset) -> tuple[datasets.Dataset, PackingReport, str]:
        tokens, untrained = tokenize_examples(
            split, tokenizer, fmt=fmt, loss_on=loss_on, num_proc=num_proc
        )
        packed, report = pack_examples(
            tokens, block_size=block_size, truncation=truncation, pad_token_id=pad, seed=seed
        )
        return packed, report, f"{untrained} example(s) with nothing to train skipped"

    return pack_each_split(examples, pack, validation_fraction, seed, block_size, "example")


def pack_each_split(
    examples: datasets.Dataset,
    pack: Callable[[datasets.Dataset], tuple[datasets.Dataset, PackingReport, str]],
    validation_fraction: float,
    seed: int,
    block_size: int,
    item: str,
) -> tuple[datasets.DatasetDict, dict[str, PackingReport]]:
    """`pack` (blocks, report, what else it skipped) on the train and validation splits
    of `examples`, each reported; a split left with no block is refused (`item`: what
    the examples are, as the refusal names them)."""
    blocks, reports = {}, {}
    for name, split in split_documents(examples, validation_fraction, seed).items():
        packed, report, skipped = pack(split)
        if len(packed) == 0:
            raise ConfigError(
                f"the {name} split has no {item} that fits a block of data.block_size="
                f"{block_size} ({report.dropped_long} longer; {skipped}): raise "
                "data.block_size, or data.truncation=truncate"
            )
        line = report.line().replace("examples", f"{item}s", 1)
        print(f"{name}: {line}" + (f"; {skipped}" if skipped else ""))
        blocks[name], reports[name] = packed, report
    return datasets.DatasetDict(blocks), reports
