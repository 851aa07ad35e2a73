"""LoRA on every layout equals PEFT in one process: same base, same initial adapters,
fp32, losses per step to 1e-5 relative and the adapters after (read from the PEFT folder
consolidation writes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL
from tests.distributed.lora import peft_reference_run
from tests.distributed.reference import make_spec, run_group

STEPS = 12
# GQA with one KV head for four query heads: at tp 2 the KV head is replicated.
GQA = {**TINY_MODEL, "num_hidden_layers": 4, "num_key_value_heads": 1}
LORA = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": "all-linear",
    "allow_random_base": True,
}
PIPELINE = {
    "pipeline_parallel_size": 2,
    "pipeline_parallel_num_microbatches": 2,
    "pipeline_schedule": "1f1b",
}
TWO_RANKS = {
    "lora-dp2-zero1": ({"data_parallel_size": 2, "zero_1": True}, {"per_device_train_batch_size": 4}),
    "lora-dp2-sdp2": (
        {"data_parallel_size": 2, "sharded_data_parallel_degree": 2},
        {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
    ),
    "lora-tp2-sp-kv": ({"tensor_parallel_size": 2}, {"per_device_train_batch_size": 8}),
    "lora-pp2-1f1b": (PIPELINE, {"per_device_train_batch_size": 8}),
}


def _spec(blocks, out: Path, name: str, parallel: dict, training: dict, world: int):
    return make_spec(
        blocks,
        out,
        name,
        world=world,
        parallel=parallel,
        training={**training, "max_steps": STEPS},
        architecture="llama",
        fields=GQA,
        lora=LORA,
    )


def assert_matches_peft(name: str, summary: dict, losses: list[float]) -> None:
    got = [loss for _, loss in summary["losses"]]
    assert len(got) == STEPS, name
    for step, (a, b) in enumerate(zip(got, losses, strict=True)):
        assert abs(a - b) / abs(b) <= 1e-5, f"{name} step {step}: {a} vs {b}"


@pytest.mark.slow
def test_lora_on_two_ranks_matches_peft(tiny_blocks, tmp_path: Path):
    specs = [_spec(tiny_blocks, tmp_path, n, *case, world=2) for n, case in TWO_RANKS.items()]
    summaries = run_group(specs, 2, tmp_path, "t-lora2")
    losses, adapters, _ = peft_reference_run(tiny_blocks, GQA, LORA, STEPS)
    for name, summary in zip(TWO_RANKS, summaries, strict=True):
        assert_matches_peft(name, summary, losses)

