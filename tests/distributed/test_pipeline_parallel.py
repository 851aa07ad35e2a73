"""Pipeline parallelism, alone and composed with tensor and data parallelism,
reproduces one process (fp32, same data and seed), for every schedule."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL
from tests.distributed.reference import (
    assert_matches_reference,
    assert_memory_model_holds,
    make_spec,
    reference_run,
    run_group,
)

FOUR_LAYERS = {**TINY_MODEL, "num_hidden_layers": 4}
BATCH_8 = {"per_device_train_batch_size": 8}


def _pp(size: int, schedule: str, microbatches: int, **extra) -> dict:
    return {
        "pipeline_parallel_size": size,
        "pipeline_schedule": schedule,
        "pipeline_parallel_num_microbatches": microbatches,
        **extra,
    }


# name: (parallel, training)
WORLD_2 = {
    "pp2-gpipe": (_pp(2, "gpipe", 2), BATCH_8),
    "pp2-1f1b": (_pp(2, "1f1b", 4), BATCH_8),
    "pp2-interleaved": (_pp(2, "interleaved_1f1b", 4), BATCH_8),
    "pp2-1f1b-accum2-checkpointing": (
        _pp(2, "1f1b", 2, activation_checkpointing="full"),
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    ),
}
WORLD_4 = {
    "pp4-gpipe": (_pp(4, "gpipe", 4), BATCH_8),
    "pp4-1f1b": (_pp(4, "1f1b", 4), BATCH_8),
    "pp4-interleaved-v1": (
        _pp(4, "interleaved_1f1b", 4, pipeline_parallel_virtual_stages=1),
        BATCH_8,
    ),
    "pp2-tp2-sp": (_pp(2, "1f1b", 2, tensor_parallel_size=2), BATCH_8),
    "pp2-tp2-no-sp": (_pp(2, "1f1b", 2, tensor_parallel_size=2, sequence_parallel=False), BATCH_8),
}
WORLD_8 = {
    "dp2-pp2-tp2-zero1-sp": (
        _pp(2, "1f1b", 2, tensor_parallel_size=2, data_parallel_size=2, zero_1=True),
        {"per_device_train_batch_size": 4, "grad_bucket_mb": 0.01},
    ),
}


def _run(cases: dict, world: int, blocks, out: Path) -> None:
    specs = [
        make_spec(
            blocks,
            out,
            name,
            world=world,
            parallel=parallel,
            training=training,
            architecture="llama",
            fields=FOUR_LAYERS,
        )
        for name, (parallel, training) in cases.items()
    ]
    results = run_group(specs, world, out, f"t-pp{world}")
    losses, weights = reference_run(blocks, "llama", FOUR_LAYERS)
    for (name, (parallel, _)), summary in zip(cases.items(), results, strict=True):
        assert_matches_reference(name, summary, losses, weights, out / f"{name}-hf")
        assert_memory_model_holds(name, summary)
        if parallel.get("data_parallel_size", 1) > 1:
            # The schedule's last backward of each microbatch finishes the gradients: the
            # data-parallel reductions overlap the pipeline's backward.
            buckets = summary["gradient_buckets"]
            assert buckets["started_in_backward"] == buckets["count"] > 2, buckets


@pytest.mark.slow
def test_pipeline_on_two_ranks_matches_one_process(tiny_blocks, tmp_path: Path):
    _run(WORLD_2, 2, tiny_blocks, tmp_path)


@pytest.mark.slow
def test_pipeline_on_four_ranks_matches_one_process(tiny_blocks, tmp_path: Path):
    _run(WORLD_4, 4, tiny_blocks, tmp_path)


@pytest.mark.slow
def test_three_dimensional_layout_on_eight_ranks_matches_one_process(tiny_blocks, tmp_path: Path):
    _run(WORLD_8, 8, tiny_blocks, tmp_path)
