"""Sharded data parallelism (FSDP2: ZeRO-3 and hybrid) reproduces one process (fp32).

Every case cuts the reference's global batch of 8 over its data-parallel
ranks and accumulation microbatches; clipping is active, so the global norm
over shards (and tp copies, and pp stages) is checked too. One spawned gloo
group per world size runs all of its cases in turn.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL
from tests.distributed.reference import (
    References,
    assert_matches_reference,
    make_spec,
    run_group,
)

# name: (parallel, training)
WORLD_2 = {
    "dp2-sdp2": (
        {"data_parallel_size": 2, "sharded_data_parallel_degree": 2},
        {"per_device_train_batch_size": 4},
    ),
    "dp2-sdp2-accum2-ac-full": (
        {
            "data_parallel_size": 2,
            "sharded_data_parallel_degree": 2,
            "activation_checkpointing": "full",
        },
        {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
    ),
    "dp2-sdp2-accum2-ac-selective": (
        {
            "data_parallel_size": 2,
            "sharded_data_parallel_degree": 2,
            "activation_checkpointing": "selective",
        },
        {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
    ),
}


def _specs(tiny_blocks, tmp_path: Path, cases: dict, world: int) -> list:
    return [
        make_spec(
            tiny_blocks,
            tmp_path,
            name,
            world=world,
            parallel=parallel,
            training=training,
            architecture="llama",
            fields=TINY_MODEL,
        )
        for name, (parallel, training) in cases.items()
    ]


@pytest.mark.slow
def test_sharded_data_parallel_on_two_ranks_matches_one_process(tiny_blocks, tmp_path: Path):
    results = run_group(_specs(tiny_blocks, tmp_path, WORLD_2, 2), 2, tmp_path, "t-sdp2")
    references = References(tiny_blocks)
    expected_losses, expected_weights = references("llama", TINY_MODEL)
    for name, summary in zip(WORLD_2, results, strict=True):
        assert summary["layout_name"].endswith("sdp2") or "sdp2" in summary["layout_name"]
        assert_matches_reference(
            name, summary, expected_losses, expected_weights, tmp_path / f"{name}-hf"
        )
