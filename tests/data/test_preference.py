"""Preference pairs: TRL's tokens for each of its formats, whole pairs in every block, and
the refusals of pairs that cannot be trained on.

The oracle is TRL 1.16's own preparation (`DPOTrainer._prepare_dataset`, run on CPU with
no model): its prompt, chosen and rejected ids per pair.
"""

from __future__ import annotations

import types

import datasets
import pytest
import torch

from meshtrain.config_parsing import ConfigError
from meshtrain.data.batch import next_token_labels
from meshtrain.data.builtin import builtin_preferences
from meshtrain.data.corpus import load_corpus
from meshtrain.data.example_sources import ExamplesError, load_examples
from meshtrain.data.preference import (
    check_pairs,
    pack_pairs,
    tokenize_pair,
    tokenize_pairs,
    with_explicit_prompts,
)
from meshtrain.data.tokenizer import train_tokenizer
from meshtrain.models.preference_loss import count_pairs, pair_index

USER = {"role": "user", "content": "What is a list?"}
SYSTEM = {"role": "system", "content": "Answer briefly."}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(load_corpus("builtin", builtin_max_chars=100_000), 600)


def conversational_pairs() -> list[dict]:
    return builtin_preferences(40_000).to_list()


def implicit(rows: list[dict]) -> list[dict]:
    """The same pairs as whole conversations sharing their first turns."""
    return [
        {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]}
        for row in rows
    ]


def as_strings(rows: list[dict]) -> list[dict]:
    return [
        {
            "prompt": "Q: " + row["prompt"][-1]["content"] + "\nA:",
            "chosen": " " + row["chosen"][0]["content"][:80],
            "rejected": " " + row["rejected"][0]["content"][:60],
        }
        for row in rows
    ]


def trl_ids(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int], int]]:
    from trl import DPOConfig, DPOTrainer  # noqa: PLC0415

    args = DPOConfig(output_dir="unused", max_length=None, use_cpu=True, report_to=[])
    trainer = types.SimpleNamespace(_tokenizer=tokenizer)
    prepared = DPOTrainer._prepare_dataset(
        trainer, datasets.Dataset.from_list(rows), tokenizer, args, "train"
    )
    return [
        (
            r["prompt_ids"] + r["chosen_ids"],
            r["prompt_ids"] + r["rejected_ids"],
            len(r["prompt_ids"]),
        )
        for r in prepared
    ]


@pytest.mark.parametrize("shape", ["explicit", "implicit", "explicit-strings", "implicit-strings"])
def test_pairs_are_tokenized_as_trl_tokenizes_them(tokenizer, shape):
    rows = conversational_pairs()
    if "strings" in shape:
        rows = as_strings(rows)
        if shape.startswith("implicit"):
            rows = [
                {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                for r in rows
            ]
    elif shape == "implicit":
        rows = implicit(rows)
    expected = trl_ids(tokenizer, rows)
    ours = with_explicit_prompts(datasets.Dataset.from_list(rows))
    assert len(expected) == len(ours) >= 20
    for number, (row, want) in enumerate(zip(ours, expected, strict=True)):
        assert tokenize_pair(row, tokenizer) == want, (shape, number)


def test_blocks_hold_whole_pairs_chosen_first(tokenizer):
    rows = datasets.Dataset.from_list(as_strings(conversational_pairs()))
    pairs = tokenize_pairs(rows, tokenizer, None)
    blocks, report = pack_pairs(pairs, block_size=256, truncation="drop", pad_token_id=0, seed=1)
    assert report.examples + report.dropped_long == len(rows)
    want = {(tuple(p["chosen_ids"]), tuple(p["rejected_ids"])) for p in pairs}
    found = 0
    for block in blocks:
        ids, positions = torch.tensor([block["input_ids"]]), torch.tensor([block["position_ids"]])
        starts = (positions[0] == 0).nonzero().flatten().tolist() + [256]
        sequences = [tuple(ids[0, a:b].tolist()) for a, b in zip(starts, starts[1:], strict=False)]
        real = [s for s in sequences if (s[0], s[-1]) != (0, 0)]  # the padding tail is zeros
        assert len(real) % 2 == 0
        assert all((real[k], real[k + 1]) in want for k in range(0, len(real), 2))
        labels = next_token_labels(ids, positions, torch.tensor([block["loss_mask"]]))
        assert count_pairs(positions, labels) == len(real) // 2
        slots, _ = pair_index(positions)
        assert slots.max() < 2 * (len(real) // 2 + 1)
        found += len(real) // 2
    assert found == report.examples


def test_identical_pairs_are_counted_and_skipped(capsys):
    rows = datasets.Dataset.from_list(
        [
            {"prompt": "Q:", "chosen": " a", "rejected": " b"},
            {"prompt": "Q:", "chosen": " same", "rejected": " same"},
        ]
    ).add_column("_origin", ["f row 1", "f row 2"])
    kept, skipped = check_pairs(rows, explicit=True)
    assert (len(kept), skipped) == (1, 1)
    assert "1 pair(s) with the same chosen and rejected skipped" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"prompt": "Q:", "chosen": " a", "rejected": None}, "rejected: is missing"),
        ({"prompt": "Q:", "chosen": " a", "rejected": " "}, "rejected: is empty"),
        ({"prompt": "Q: hi", "chosen": "Q: hi there", "rejected": " b"}, "chosen: starts with"),
        (
            {
                "prompt": [USER],
                "chosen": [USER, {"role": "assistant", "content": "x"}],
                "rejected": [{"role": "assistant", "content": "y"}],
            },
            "chosen: starts with the row's prompt",
        ),
    ],
)
def test_bad_pairs_are_refused_naming_the_row(row, says):
    rows = datasets.Dataset.from_list([row]).add_column("_origin", ["pairs.jsonl row 1"])
    with pytest.raises(ExamplesError, match="pairs.jsonl row 1") as refused:
        check_pairs(rows, explicit=True)
    assert says in str(refused.value)


def test_a_pair_longer_than_a_block_is_refused_dropped_or_cut(tokenizer):
    rows = datasets.Dataset.from_list(
        [
            {"prompt": "Q:", "chosen": " long" * 40, "rejected": " no"},
            {"prompt": "Q:", "chosen": " a", "rejected": " b"},
        ]
    )
    pairs = tokenize_pairs(rows, tokenizer, None)
    with pytest.raises(ConfigError, match="data.truncation is off"):
        pack_pairs(pairs, block_size=32, truncation="off", pad_token_id=0, seed=1)
    _, dropped = pack_pairs(pairs, block_size=32, truncation="drop", pad_token_id=0, seed=1)
    assert (dropped.examples, dropped.dropped_long) == (1, 1)
    _, cut = pack_pairs(pairs, block_size=32, truncation="truncate", pad_token_id=0, seed=1)
    assert (cut.examples, cut.truncated) == (2, 1)


def test_builtin_preferences_load_offline_as_conversations():
    rows = load_examples("builtin_preferences", builtin_max_chars=20_000)
    assert {"prompt", "chosen", "rejected"} <= set(rows.column_names)
    row = rows[0]
    assert row["chosen"][0]["role"] == row["rejected"][0]["role"] == "assistant"
    assert row["chosen"] != row["rejected"]


def test_pairs_from_files_with_their_own_column_names(tmp_path):
    from meshtrain.config import DataConfig  # noqa: PLC0415
    from meshtrain.data.prepare import load_corpus_or_examples  # noqa: PLC0415

    path = tmp_path / "pairs.jsonl"
    lines = [
        '{"question": "Q: 1+1?", "good": " 2", "bad": " 3"}',
        '{"question": "Q: 2+2?", "good": " 4", "bad": " 4"}',
        '{"question": "Q: 3+3?", "good": " 6", "bad": " 7"}',
    ]
    path.write_text("\n".join(lines) + "\n")
    data = DataConfig(
        source="files",
        data_files=[str(path)],
        columns={"prompt": "question", "chosen": "good", "rejected": "bad"},
    )
    pairs = load_corpus_or_examples(data)
    assert pairs.to_list() == [
        {"prompt": "Q: 1+1?", "chosen": " 2", "rejected": " 3"},
        {"prompt": "Q: 3+3?", "chosen": " 6", "rejected": " 7"},
    ]
