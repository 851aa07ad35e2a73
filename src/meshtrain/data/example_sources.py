"""Fine-tuning examples in TRL's formats, from files, the Hub, the Kedro catalog or the
builtin instructions, checked row by row before any tokenizing.

Every row keeps where it came from (`_origin`: a file and its 1-based row, or the source
and row) until `check_examples` has looked at it, so a refusal names file, row and column.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets

from meshtrain.data.builtin import builtin_instructions, builtin_preferences
from meshtrain.data.corpus import CorpusError, expand_patterns, load_hub_split

FORMAT_COLUMNS = {
    "preference": ("chosen", "rejected"),
    "conversational": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
CANONICAL = ("text", "prompt", "completion", "messages", "chosen", "rejected")
ROLES = ("system", "user", "assistant", "tool")
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
ORIGIN = "_origin"


class ExamplesError(CorpusError):
    """Examples that cannot be trained on; the message names file, row and column."""


def load_examples(
    source: str,
    *,
    data_files: list[str] | None = None,
    hub_dataset: str | None = None,
    hub_config: str | None = None,
    hub_split: str = "train",
    columns: dict[str, str] | None = None,
    in_memory: Any = None,
    builtin_max_chars: int | None = None,
) -> datasets.Dataset:
    """The examples of `source`, TRL's column names, and each row's origin."""
    if source == "files":
        parts = [
            _read_file(path, columns)
            for path in expand_patterns(data_files or [], "data.data_files")
        ]
        # Parquet reads strings as large_string, JSON as string: one schema for all.
        return datasets.concatenate_datasets([p.cast(parts[0].features) for p in parts])
    if source == "hub":
        ds = load_hub_split(hub_dataset, hub_config, hub_split)
        return _canonical(ds, columns, f"data.hub_dataset={hub_dataset}")
    if source == "catalog":
        return _canonical(_from_catalog(in_memory), columns, "raw_examples")
    if source == "builtin_instructions":
        return _canonical(builtin_instructions(builtin_max_chars), None, "builtin_instructions")
    if source == "builtin_preferences":
        return _canonical(builtin_preferences(builtin_max_chars), None, "builtin_preferences")
    raise ExamplesError(f"data.source={source!r} holds no fine-tuning examples")


def _read_file(path: str, columns: dict[str, str] | None) -> datasets.Dataset:
    builder = BUILDERS.get(Path(path).suffix.lower())
    if builder is None:
        raise ExamplesError(
            f"data.data_files: {path} is not a JSON, JSONL, Parquet or CSV file (by its "
            f"extension, one of {', '.join(BUILDERS)}): convert it, or leave it out."
        )
    if os.path.getsize(path) == 0:
        raise ExamplesError(f"data.data_files: {path} is empty: add examples, or leave it out.")
    try:
        ds = datasets.load_dataset(builder, data_files=[path], split="train")
    except Exception as error:  # noqa: BLE001 - the reader's own error, named in one line
        reason = " ".join(str(error.__cause__ or error).split())[:300]
        raise ExamplesError(
            f"data.data_files: {path} cannot be read as {builder}: {reason}"
        ) from None
    return _canonical(ds, columns, path)


def _from_catalog(loaded: Any) -> datasets.Dataset:
    if loaded is None:
        raise ExamplesError(
            "data.source=catalog reads the Kedro dataset raw_examples, which no "
            "conf/<env>/catalog.yml declares: add e.g. `raw_examples: {type: "
            "json.JSONDataset, filepath: data/01_raw/examples.json}`."
        )
    if isinstance(loaded, datasets.DatasetDict):
        return loaded["train"]
    if isinstance(loaded, datasets.Dataset):
        return loaded
    if isinstance(loaded, list):
        return datasets.Dataset.from_list(loaded)
    if hasattr(loaded, "to_dict") and hasattr(loaded, "columns"):  # a pandas DataFrame
        return datasets.Dataset.from_pandas(loaded, preserve_index=False)
    raise ExamplesError(
        f"raw_examples loaded a {type(loaded).__name__}; data.source=catalog reads a Hugging "
        "Face Dataset, a pandas DataFrame or a list of records."
    )


def _canonical(ds: datasets.Dataset, columns: dict[str, str] | None, where: str):
    """TRL's column names (`columns` maps them to the dataset's), the others dropped."""
    for canonical, own in (columns or {}).items():
        if own not in ds.column_names:
            raise ExamplesError(
                f"{where}: data.columns maps {canonical} to {own!r}, which is not a column; "
                f"columns are {ds.column_names}"
            )
        if own != canonical:
            ds = ds.rename_column(own, canonical)
    kept = [c for c in CANONICAL if c in ds.column_names]
    if not kept:
        raise ExamplesError(
            f"{where}: the columns are {ds.column_names}, none of TRL's (messages; prompt "
            "and completion; text): map yours with data.columns, e.g. "
            "data.columns={prompt: question, completion: answer}"
        )
    ds = ds.select_columns(kept)
    origins = [f"{where} row {i + 1}" for i in range(len(ds))]
    return ds.add_column(ORIGIN, origins)


def detect_format(column_names: list[str], requested: str = "auto") -> str:
    """TRL's format of these columns: messages, prompt + completion, or text."""
    if requested != "auto":
        missing = [c for c in FORMAT_COLUMNS[requested] if c not in column_names]
        if missing:
            raise ExamplesError(
                f"`data.format={requested}` needs the column(s) {', '.join(missing)}; the "
                f"examples have {_shown(column_names)}: map yours with data.columns, e.g. "
                f"data.columns={{{missing[0]}: <your column>}}"
            )
        return requested
    for fmt, needed in FORMAT_COLUMNS.items():
        if all(c in column_names for c in needed):
            return fmt
    raise ExamplesError(
        f"the examples have {_shown(column_names)}, none of TRL's formats (chosen and "
        "rejected, with or without prompt; messages; prompt and completion; text): map "
        "yours with data.columns, e.g. data.columns={messages: conversations}"
    )


def _shown(column_names: list[str]) -> str:
    return str([c for c in column_names if c != ORIGIN])


def check_examples(ds: datasets.Dataset, fmt: str) -> tuple[datasets.Dataset, int]:
    """Refuse a malformed row, naming file, row and column; skip (and count) the
    conversations with no assistant turn. Returns the rows to train on, without origins."""
    keep, skipped = [], 0
    for index, row in enumerate(ds):
        if fmt == "conversational" and not _check_messages(row["messages"], "messages", row):
            skipped += 1
            continue
        if fmt == "prompt_completion":
            check_part(row, "prompt", allow_empty=True)
            check_part(row, "completion", allow_empty=False)
        if fmt == "text" and not (isinstance(row["text"], str) and row["text"].strip()):
            raise bad_row(row, "text", "is empty")
        keep.append(index)
    if not keep:
        raise ExamplesError(
            f"none of the {len(ds)} conversations has an assistant turn: there is nothing to "
            "learn (the loss falls on the assistant's answers)."
        )
    if skipped:
        ds = ds.select(keep)
    return ds.remove_columns(ORIGIN), skipped


def check_part(row: dict, column: str, *, allow_empty: bool) -> None:
    value = row[column]
    if isinstance(value, list):
        _check_messages(value, column, row)
    elif not isinstance(value, str):
        raise bad_row(row, column, f"is a {type(value).__name__}, not text or a list of messages")
    elif not allow_empty and not value.strip():
        raise bad_row(row, column, "is empty: there is nothing to learn")


def _check_messages(messages: Any, column: str, row: dict) -> bool:
    """Whether the conversation has an assistant turn; a malformed message is refused."""
    if not isinstance(messages, list) or not messages:
        raise bad_row(row, column, "is not a list of messages")
    for number, message in enumerate(messages):
        where = f"{column}[{number}]"
        if not isinstance(message, dict) or "role" not in message:
            raise bad_row(row, where, "is not a {role, content} message")
        if message["role"] not in ROLES:
            raise bad_row(row, where, f"has the role {message['role']!r}; roles are {ROLES}")
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            raise bad_row(row, where, "has no content")
    return any(m["role"] == "assistant" for m in messages)


def bad_row(row: dict, column: str, what: str) -> ExamplesError:
    return ExamplesError(f"{row[ORIGIN]}, column {column}: {what}.")
