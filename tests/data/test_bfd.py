"""Best-fit-decreasing packing: every example whole in one block, positions restarting,
the loss mask following it, the block's tail padding; dense on the builtin instructions."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from meshtrain.config_parsing import ConfigError
from meshtrain.data.bfd import best_fit_decreasing, pack_examples
from meshtrain.data.builtin import builtin_instructions
from meshtrain.data.chat_tokens import tokenize_examples
from meshtrain.data.corpus import load_corpus
from meshtrain.data.tokenizer import train_tokenizer


def _examples(lengths: list[int]) -> datasets.Dataset:
    """Example i is tokens 1000*i + position; its first half untrained."""
    ids = [[1000 * i + t for t in range(n)] for i, n in enumerate(lengths)]
    trained = [[int(t >= n // 2) for t in range(n)] for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids, "trained": trained})


def test_each_example_whole_in_one_block_with_its_positions_and_mask():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 40, size=200).tolist()
    blocks, report = pack_examples(
        _examples(lengths), block_size=48, truncation="drop", pad_token_id=-1, seed=3
    )
    seen = {}
    for row in blocks:
        ids, pos, mask = (np.array(row[k]) for k in ("input_ids", "position_ids", "loss_mask"))
        starts = list(np.flatnonzero(pos == 0)) + [48]
        assert row["num_tokens"] == (ids != -1).sum()
        for a, b in zip(starts, starts[1:], strict=False):
            if a >= row["num_tokens"]:
                assert (mask[a:] == 0).all()  # the padding tail trains nothing
                break
            example = int(ids[a]) // 1000
            assert example not in seen
            seen[example] = b - a
            assert (ids[a:b] == 1000 * example + np.arange(b - a)).all()
            assert (mask[a:b] == (np.arange(b - a) >= (b - a) // 2)).all()
    assert seen == dict(enumerate(lengths))
    assert report.real_tokens == sum(lengths) and report.blocks == len(blocks)


def test_best_fit_puts_each_example_where_least_room_is_left():
    # 6 opens a block (room 4), 5 another (room 5); 4 goes where least room is left (the
    # first, exactly full), then 3 and 2 into the second.
    assert best_fit_decreasing([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]
    assert best_fit_decreasing([5, 4, 4, 3], 8) == [[0, 3], [1, 2]]


def test_packing_is_deterministic_and_the_seed_orders_blocks():
    one = pack_examples(
        _examples([5, 9, 3, 7] * 10), block_size=16, truncation="drop", pad_token_id=0, seed=1
    )[0]
    two = pack_examples(
        _examples([5, 9, 3, 7] * 10), block_size=16, truncation="drop", pad_token_id=0, seed=1
    )[0]
    other = pack_examples(
        _examples([5, 9, 3, 7] * 10), block_size=16, truncation="drop", pad_token_id=0, seed=2
    )[0]
    assert one["input_ids"] == two["input_ids"] != other["input_ids"]
    assert sorted(map(tuple, one["input_ids"])) == sorted(map(tuple, other["input_ids"]))


def test_examples_longer_than_a_block_are_dropped_truncated_or_refused():
    examples = _examples([4, 30, 6])
    _, dropped = pack_examples(examples, block_size=10, truncation="drop", pad_token_id=0, seed=0)
    assert (dropped.examples, dropped.dropped_long) == (2, 1)
    # Cut to 10 tokens, the long one keeps none of its trained tokens (from token 15 on):
    # nothing to learn, so it is dropped.
    _, cut = pack_examples(examples, block_size=10, truncation="truncate", pad_token_id=0, seed=0)
    assert (cut.examples, cut.dropped_long, cut.truncated) == (2, 1, 0)
    _, cut = pack_examples(examples, block_size=20, truncation="truncate", pad_token_id=0, seed=0)
    assert (cut.examples, cut.truncated) == (3, 1)
    with pytest.raises(ConfigError, match=r"1 example.*data.block_size=10.*longest 30"):
        pack_examples(examples, block_size=10, truncation="off", pad_token_id=0, seed=0)


def test_the_builtin_instructions_pack_at_least_95_percent_dense_at_block_512():
    tokenizer = train_tokenizer(load_corpus("builtin", builtin_max_chars=600_000), 4096)
    tokens, _ = tokenize_examples(
        builtin_instructions(max_chars=600_000),
        tokenizer,
        fmt="conversational",
        loss_on="assistant",
    )
    _, report = pack_examples(tokens, block_size=512, truncation="drop", pad_token_id=0, seed=0)
    assert report.efficiency >= 0.95, report.line()
    assert report.dropped_long < 0.05 * (report.examples + report.dropped_long), report.line()
