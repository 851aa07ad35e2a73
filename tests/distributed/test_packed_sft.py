"""Packed fine-tuning blocks reproduce every example run alone, on every layout, and
resume exactly (same layout) and onto another.

Blocks of several examples, a padded tail and completion-only loss masks (so ranks,
microbatches and accumulation steps hold unequal numbers of trained tokens) are trained
on 2 ranks and compared, step by step and in the final weights, with one process that
runs each example by itself and takes the mean over the global batch's trained tokens.
The same group then scores a packed block at tp2 + SP and at pp2, one example at a time,
against each example alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshtrain.config import LaunchConfig
from meshtrain.launch.elastic import run_workers
from tests.conftest import TINY_MODEL
from tests.distributed.packed import (
    alone_example_losses,
    check_labels,
    packed_reference_run,
    train_and_probe,
)
from tests.distributed.reference import assert_matches_reference, make_spec

FOUR_LAYERS = {**TINY_MODEL, "num_hidden_layers": 4}
SAVE_AT = 3
PIPELINE = {"pipeline_parallel_size": 2, "pipeline_parallel_num_microbatches": 2}
CASES = {
    # Unequal trained tokens per rank and per accumulation step.
    "sft-dp2-accum2": (
        {"data_parallel_size": 2, "zero_1": False},
        {
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "checkpoint_every": SAVE_AT,
            "keep_last": 0,
        },
    ),
    "sft-dp2-zero1-checkpointing": (
        {"data_parallel_size": 2, "zero_1": True, "activation_checkpointing": "full"},
        {"per_device_train_batch_size": 4},
    ),
    "sft-dp2-sdp2": (
        {"data_parallel_size": 2, "sharded_data_parallel_degree": 2},
        {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
    ),
    "sft-tp2-sp": ({"tensor_parallel_size": 2}, {"per_device_train_batch_size": 8}),
    # Positions travel with the pipeline's microbatches to both stages.
    "sft-pp2": (PIPELINE, {"per_device_train_batch_size": 8}),
}
PROBES = {
    "probe-tp2-sp": {"tensor_parallel_size": 2},
    "probe-pp2": PIPELINE,
}


def test_labels_train_only_the_next_token_of_the_same_example(packed_blocks):
    check_labels(packed_blocks)


def _spec(blocks, out: Path, name: str, parallel: dict, training: dict):
    return make_spec(
        blocks,
        out,
        name,
        world=2,
        parallel=parallel,
        training={**training, "max_steps": 6 if not name.startswith("probe") else 1},
        architecture="llama",
        fields=FOUR_LAYERS,
    )


@pytest.mark.slow
def test_packed_examples_on_two_ranks_match_each_example_alone(packed_blocks, tmp_path: Path):
    specs = [_spec(packed_blocks, tmp_path, n, *case) for n, case in CASES.items()]
    # Resumed from dp 2's checkpoint at step 3: on its own layout (bitwise) and on pp 2.
    saved = str(tmp_path / "sft-dp2-accum2" / f"checkpoint-{SAVE_AT}")
    for name, case in (("sft-dp2-accum2", CASES["sft-dp2-accum2"]), ("sft-pp2", CASES["sft-pp2"])):
        resumed = _spec(packed_blocks, tmp_path, f"{name}-resumed", *case)
        specs.append(dataclasses.replace(resumed, resume_from=saved))
    probes = [
        _spec(packed_blocks, tmp_path, n, p, {"per_device_train_batch_size": 8})
        for n, p in PROBES.items()
    ]
    summaries, scores = run_workers(
        train_and_probe,
        (specs, probes),
        LaunchConfig(nproc_per_node=2),
        log_dir=tmp_path / "logs",
        run_id="t-sft2",
    )[0]
    losses, weights = packed_reference_run(packed_blocks, FOUR_LAYERS)
    for name, summary in zip(CASES, summaries, strict=False):
        assert_matches_reference(name, summary, losses, weights, tmp_path / f"{name}-hf")
    same, other = summaries[len(CASES) :]
    assert same["losses"] == summaries[0]["losses"][SAVE_AT:]
    assert [step for step, _ in other["losses"]] == list(range(SAVE_AT + 1, 7))
    padded = {**other, "losses": [(0, x) for x in losses[:SAVE_AT]] + other["losses"]}
    assert_matches_reference("sft-pp2-resumed", padded, losses, weights, tmp_path / "resumed-hf")
    alone = alone_example_losses(packed_blocks, FOUR_LAYERS)
    assert len(alone) >= 3
    for name, packed in zip(PROBES, scores, strict=True):
        assert len(packed) == len(alone), name
        for i, (got, want) in enumerate(zip(packed, alone, strict=True)):
            assert abs(got - want) <= 1e-5 * max(abs(want), 1e-3), f"{name} example {i}"
