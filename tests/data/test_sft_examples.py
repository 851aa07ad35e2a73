"""Fine-tuning examples: the formats users already have load, and bad data is refused
before any tokenizing, in a few lines naming file, row and column."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pandas as pd
import pytest

from meshtrain.config import Refused
from meshtrain.data.example_sources import check_examples, detect_format, load_examples
from meshtrain.pipelines.data_processing.nodes import build_corpus

MAX_LINES = 15
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _node(files: list[str], **data) -> datasets.Dataset:
    """The data pipeline's first node, as `kedro run` calls it."""
    return build_corpus({"source": "files", "data_files": files, **data}, None)


def test_the_four_file_formats_and_a_column_mapping_load(tmp_path: Path):
    rows = [{"question": f"Q{i}?", "answer": f"A{i}."} for i in range(4)]
    pd.DataFrame(rows).to_parquet(tmp_path / "a.parquet")
    pd.DataFrame(rows).to_csv(tmp_path / "b.csv", index=False)
    (tmp_path / "c.json").write_text(json.dumps(rows))
    _jsonl(tmp_path / "d.jsonl", rows)
    loaded = _node([str(tmp_path / "*.*")], columns={"prompt": "question", "completion": "answer"})
    assert loaded.column_names == ["prompt", "completion"] and len(loaded) == 16
    assert detect_format(loaded.column_names) == "prompt_completion"


def test_catalog_datasets_load_as_dataframes_records_and_datasets():
    records = [{"messages": CHAT}, {"messages": CHAT}]
    for loaded in (records, pd.DataFrame(records), datasets.Dataset.from_list(records)):
        examples, skipped = check_examples(
            load_examples("catalog", in_memory=loaded), "conversational"
        )
        assert len(examples) == 2 and skipped == 0 and examples.column_names == ["messages"]


def test_kedro_datasets_feed_the_catalog_source(tmp_path: Path):
    """What a project's `raw_examples` entry loads (kedro-datasets' JSON and Parquet
    datasets) goes through the data node as it is."""
    from kedro_datasets.json import JSONDataset
    from kedro_datasets.pandas import ParquetDataset

    records = [{"messages": CHAT}] * 3
    (tmp_path / "chats.json").write_text(json.dumps(records))
    pd.DataFrame([{"question": "Q?", "answer": "A."}] * 3).to_parquet(tmp_path / "qa.parquet")
    chats = build_corpus(
        {"source": "catalog"}, JSONDataset(filepath=str(tmp_path / "chats.json")).load()
    )
    qa = build_corpus(
        {"source": "catalog", "columns": {"prompt": "question", "completion": "answer"}},
        ParquetDataset(filepath=str(tmp_path / "qa.parquet")).load(),
    )
    assert (chats.column_names, len(chats)) == (["messages"], 3)
    assert (qa.column_names, len(qa)) == (["prompt", "completion"], 3)


def test_a_hub_dataset_with_other_column_names_loads(tmp_path: Path):
    """`load_dataset` reads a hub id or a local dataset folder alike (offline here)."""
    folder = tmp_path / "hub_like"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", [{"conversations": CHAT, "id": i} for i in range(3)])
    loaded = build_corpus(
        {"source": "hub", "hub_dataset": str(folder), "columns": {"messages": "conversations"}}
    )
    assert (loaded.column_names, len(loaded)) == (["messages"], 3)


def test_conversations_without_an_assistant_turn_are_skipped_and_counted(tmp_path: Path):
    lonely = [{"role": "user", "content": "anyone?"}]
    path = _jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}, {"messages": lonely}] * 2)
    examples, skipped = check_examples(load_examples("files", data_files=[path]), "conversational")
    assert (len(examples), skipped) == (2, 2)


BAD = {
    "unknown-role": (
        {"messages": [{"role": "bot", "content": "hi"}]},
        "row 2, column messages[0]",
        "'bot'",
    ),
    "no-content": (
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]},
        "row 2, column messages[0]",
        "no content",
    ),
    "empty-completion": ({"prompt": "Q?", "completion": " "}, "row 2, column completion", "empty"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_row_is_refused_naming_file_row_and_column(case: str, tmp_path: Path):
    row, where, what = BAD[case]
    good = {"messages": CHAT} if "messages" in row else {"prompt": "Q?", "completion": "A."}
    path = _jsonl(tmp_path / "data.jsonl", [good, row])
    _refused(lambda: _node([path]), f"{path} {where}", what)


def test_a_missing_column_is_refused_naming_the_columns(tmp_path: Path):
    path = _jsonl(tmp_path / "data.jsonl", [{"question": "Q?", "answer": "A."}])
    _refused(lambda: _node([path]), "['question', 'answer']", "data.columns")
    _refused(lambda: _node([path], format="conversational"), "messages", "data.columns")


def test_files_that_cannot_be_examples_are_refused(tmp_path: Path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "notes.txt").write_text("hello")
    _refused(lambda: _node([str(tmp_path / "empty.jsonl")]), "empty.jsonl", "empty")
    _refused(
        lambda: _node([str(tmp_path / "notes.txt")]), "notes.txt", "JSON, JSONL, Parquet or CSV"
    )
    _refused(lambda: _node([str(tmp_path / "none*.jsonl")]), "no file matches", "none*.jsonl")
    lonely = [{"messages": [{"role": "user", "content": "anyone?"}]}] * 3
    path = _jsonl(tmp_path / "lonely.jsonl", lonely)
    _refused(lambda: _node([path]), "none of the 3 conversations", "nothing to learn")


def test_the_catalog_source_without_a_declared_dataset_is_refused():
    _refused(lambda: build_corpus({"source": "catalog"}, None), "raw_examples", "catalog.yml")


def _refused(call, *named: str) -> None:
    with pytest.raises(Refused) as refused:
        call()
    message = f"{type(refused.value).__name__}: {refused.value}\n\n(hint)"
    for part in named:
        assert part in message, message
    assert len(message.splitlines()) <= MAX_LINES and "Traceback" not in message
