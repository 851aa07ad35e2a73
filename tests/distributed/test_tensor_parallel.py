"""Tensor and sequence parallelism reproduce one process, for each Llama-family architecture.

Two spawned gloo groups (4 and 2 ranks) run every case in turn. The tiny
model has 4 query heads and 2 KV heads, so tp=4 also exercises KV-head
replication; the Qwen2 case has tied embeddings and q/k/v biases; the Qwen3
case has per-head q/k norms. Gradient clipping is active in every run, so the
global gradient norm across split and replicated parameters is checked too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshtrain.checkpoint.manifest import read_manifest
from meshtrain.models.llama.parameter_names import tensor_parallel_dim
from tests.conftest import TINY_MODEL
from tests.distributed.reference import (
    References,
    assert_matches_reference,
    assert_memory_model_holds,
    make_spec,
    run_group,
)

QWEN2_TIED = {**TINY_MODEL, "tie_word_embeddings": True}
QWEN3 = {**TINY_MODEL, "head_dim": 16}
ONE_MICROBATCH = {"per_device_train_batch_size": 8}

# name: (parallel, training, architecture, model fields)
WORLD_4 = {
    "tp4-sp-kv-replicated": ({"tensor_parallel_size": 4}, ONE_MICROBATCH, "llama", TINY_MODEL),
    "tp4-no-sp": (
        {"tensor_parallel_size": 4, "sequence_parallel": False},
        ONE_MICROBATCH,
        "llama",
        TINY_MODEL,
    ),
    "dp2-tp2-zero1-sp": (
        {"tensor_parallel_size": 2, "data_parallel_size": 2, "zero_1": True},
        {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
        "llama",
        TINY_MODEL,
    ),
    "qwen2-tied-tp4-sp": ({"tensor_parallel_size": 4}, ONE_MICROBATCH, "qwen2", QWEN2_TIED),
    # Per-head norms: their gradients are summed over tp after the backward, so their
    # bucket waits for that while the others are reduced over dp during it.
    "qwen3-dp2-tp2-zero1-sp-small-buckets": (
        {"tensor_parallel_size": 2, "data_parallel_size": 2, "zero_1": True},
        {"per_device_train_batch_size": 4, "grad_bucket_mb": 0.01},
        "qwen3",
        QWEN3,
    ),
}
WORLD_2 = {
    "tp2-sp": ({"tensor_parallel_size": 2}, ONE_MICROBATCH, "llama", TINY_MODEL),
    "tp2-no-sp": (
        {"tensor_parallel_size": 2, "sequence_parallel": False},
        ONE_MICROBATCH,
        "llama",
        TINY_MODEL,
    ),
    "qwen3-tp2-sp": ({"tensor_parallel_size": 2}, ONE_MICROBATCH, "qwen3", QWEN3),
    "mistral-tp2-sp-checkpointing": (
        {"tensor_parallel_size": 2, "activation_checkpointing": "full"},
        ONE_MICROBATCH,
        "mistral",
        TINY_MODEL,
    ),
    # Selective recomputation keeps the collectives' results: nothing runs twice over tp.
    "tp2-sp-selective": (
        {"tensor_parallel_size": 2, "activation_checkpointing": "selective"},
        ONE_MICROBATCH,
        "llama",
        TINY_MODEL,
    ),
}


def _run_group(cases: dict, world: int, blocks, out: Path) -> None:
    specs = [
        make_spec(
            blocks,
            out,
            name,
            world=world,
            parallel=parallel,
            training=training,
            architecture=architecture,
            fields=fields,
        )
        for name, (parallel, training, architecture, fields) in cases.items()
    ]
    results = run_group(specs, world, out, f"t-tp{world}")
    references = References(blocks)
    for name, summary in zip(cases, results, strict=True):
        _, _, architecture, fields = cases[name]
        losses, weights = references(architecture, fields)
        assert_matches_reference(name, summary, losses, weights, out / f"{name}-hf")
        assert_memory_model_holds(name, summary)
        assert_planner_counts_the_real_shards(name, summary)
        if name.endswith("small-buckets"):
            buckets = summary["gradient_buckets"]
            # The per-head norms' buckets wait for the tp sum; the rest overlap the backward.
            assert 0 < buckets["started_in_backward"] < buckets["count"], buckets


def assert_planner_counts_the_real_shards(name: str, summary: dict) -> None:
    """The split table the planner counts shards by says what DTensor really split: every
    tensor's split dimension as the checkpoint manifest recorded it from the placements."""
    manifest = read_manifest(Path(summary["final_checkpoint"]), verify=False)
    for tensor, entry in manifest["tensors"].items():
        assert entry["tp_dim"] == tensor_parallel_dim(tensor), (name, tensor, entry["tp_dim"])


@pytest.mark.slow
def test_tensor_parallel_on_four_ranks_matches_one_process(tiny_blocks, tmp_path: Path):
    _run_group(WORLD_4, 4, tiny_blocks, tmp_path)


@pytest.mark.slow
def test_tensor_parallel_on_two_ranks_matches_one_process(tiny_blocks, tmp_path: Path):
    _run_group(WORLD_2, 2, tiny_blocks, tmp_path)
