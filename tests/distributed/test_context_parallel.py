"""Context parallelism reproduces one process (fp32, same data and seed), alone and
composed with every other parallelism, and its checkpoints resume onto other cp sizes.

Each rank of a cp group holds two mirrored chunks of every block, so its tokens are not
contiguous: a wrong rotary position, a key missing from the gather, a token attending
across packed examples or a gradient not summed over the cp ranks each move the losses
far beyond 1e-5. Two spawned groups: 4 ranks (cp4 and cp2 composed with dp, ZeRO-1, tp +
SP, pp, FSDP2, and the resumes) and 2 ranks (cp2 alone, with recomputation and
offloading, with bf16, and packed fine-tuning examples).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshtrain.distributed.context_parallel import to_rank_order, to_sequence_order
from tests.conftest import TINY_MODEL
from tests.distributed.packed import packed_reference_run
from tests.distributed.reference import (
    STEPS,
    assert_dry_run_holds,
    assert_matches_reference,
    assert_memory_model_holds,
    make_spec,
    reference_run,
    run_group,
)

FOUR_LAYERS = {**TINY_MODEL, "num_hidden_layers": 4}
SAVE_AT = 3
PIPELINE = {
    "pipeline_parallel_size": 2,
    "pipeline_parallel_num_microbatches": 2,
    "pipeline_schedule": "1f1b",
}
# parallel.*, training.* of each case: per-device batch x accumulation x dp = 8.
WORLD_4 = {
    "dp2-cp2": (
        {"data_parallel_size": 2, "context_parallel_size": 2, "zero_1": True},
        {"per_device_train_batch_size": 4, "checkpoint_every": SAVE_AT, "keep_last": 0},
    ),
    "cp4": ({"context_parallel_size": 4}, {"per_device_train_batch_size": 8}),
    "tp2-cp2-sp": (
        {"tensor_parallel_size": 2, "context_parallel_size": 2, "sequence_parallel": True},
        {"per_device_train_batch_size": 8},
    ),
    "pp2-cp2": ({**PIPELINE, "context_parallel_size": 2}, {"per_device_train_batch_size": 8}),
    # A zero-bubble schedule: cp's collectives in the input pass, the weights' later.
    "pp2-cp2-zbv": (
        {**PIPELINE, "pipeline_schedule": "zbv", "context_parallel_size": 2},
        {"per_device_train_batch_size": 8},
    ),
    "dp2-sdp2-cp2": (
        {"data_parallel_size": 2, "sharded_data_parallel_degree": 2, "context_parallel_size": 2},
        {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
    ),
}
# Resumed from dp2 x cp2's checkpoint at step 3: without cp (dp4) and at cp4.
RESUMED = {
    "dp4-from-cp2": ({"data_parallel_size": 4, "zero_1": True}, {"per_device_train_batch_size": 2}),
    "cp4-from-cp2": WORLD_4["cp4"],
}
WORLD_2 = {
    "cp2": ({"context_parallel_size": 2}, {"per_device_train_batch_size": 8}),
    "cp2-zero1-accum2": (
        {"context_parallel_size": 2, "zero_1": True},
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    ),
    # The all-gather runs again in the recomputed forward; offloading is a no-op on CPU.
    "cp2-checkpointing": (
        {"context_parallel_size": 2, "activation_checkpointing": "full"},
        {"per_device_train_batch_size": 8},
    ),
    "cp2-selective-offload": (
        {
            "context_parallel_size": 2,
            "activation_checkpointing": "selective",
            "activation_offloading": True,
        },
        {"per_device_train_batch_size": 8},
    ),
}
BF16 = ({"context_parallel_size": 2}, {"per_device_train_batch_size": 8, "mixed_precision": "bf16"})


def test_sequence_order_round_trip():
    """The ranks' chunks go back into the sequence's order, and the inverse undoes it."""
    import torch  # noqa: PLC0415

    cp, chunk = 4, 3
    sequence = torch.arange(2 * cp * chunk)[None]
    held = to_rank_order(sequence, cp)
    # Rank r holds chunk r, then chunk 2cp-1-r.
    for r in range(cp):
        want = [*range(r * chunk, (r + 1) * chunk)]
        want += [*range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)]
        assert held[r, 0].tolist() == want
    assert torch.equal(to_sequence_order(held, cp), sequence)


def _specs(blocks, out: Path, cases: dict, world: int, resume_from: str | None = None):
    specs = []
    for name, (parallel, training) in cases.items():
        spec = make_spec(
            blocks,
            out,
            name,
            world=world,
            parallel=parallel,
            training=training,
            architecture="llama",
            fields=FOUR_LAYERS,
        )
        specs.append(dataclasses.replace(spec, resume_from=resume_from))
    return specs


@pytest.mark.slow
def test_context_parallel_on_four_ranks_matches_one_process(tiny_blocks, tmp_path: Path):
    saved = str(tmp_path / "dp2-cp2" / f"checkpoint-{SAVE_AT}")
    specs = _specs(tiny_blocks, tmp_path, WORLD_4, 4)
    specs += _specs(tiny_blocks, tmp_path, RESUMED, 4, resume_from=saved)
    summaries = run_group(specs, 4, tmp_path, "t-cp4")
    results = dict(zip([*WORLD_4, *RESUMED], summaries, strict=True))
    losses, weights = reference_run(tiny_blocks, "llama", FOUR_LAYERS)
    for name in WORLD_4:
        summary = results[name]
        assert "cp" in summary["layout_name"], summary["layout_name"]
        assert_matches_reference(name, summary, losses, weights, tmp_path / f"{name}-hf")
        assert summary["initial_val_loss"] > summary["final_val_loss"], name
        assert_memory_model_holds(name, summary)
    # The dry run (fake tensors, fake process group) runs a cp rank's real step too.
    assert_dry_run_holds("cp4", specs[1], results["cp4"])
    for name in RESUMED:
        summary = results[name]
        assert [step for step, _ in summary["losses"]] == list(range(SAVE_AT + 1, STEPS + 1))
        earlier = [(0, x) for x in losses[:SAVE_AT]]
        padded = {**summary, "losses": earlier + summary["losses"]}
        assert_matches_reference(name, padded, losses, weights, tmp_path / f"{name}-hf")


@pytest.mark.slow
def test_context_parallel_on_two_ranks_matches_one_process(
    tiny_blocks, packed_blocks, tmp_path: Path
):
    specs = _specs(tiny_blocks, tmp_path, {**WORLD_2, "cp2-bf16": BF16}, 2)
    # Packed fine-tuning examples: no token attends across examples, across chunks too.
    packed_case = {"sft-cp2": ({"context_parallel_size": 2}, {"per_device_train_batch_size": 8})}
    specs += _specs(packed_blocks, tmp_path, packed_case, 2)
    *results, bf16, packed = run_group(specs, 2, tmp_path, "t-cp2")
    losses, weights = reference_run(tiny_blocks, "llama", FOUR_LAYERS)
    for name, summary in zip(WORLD_2, results, strict=True):
        assert_matches_reference(name, summary, losses, weights, tmp_path / f"{name}-hf")
        assert_memory_model_holds(name, summary)
    for (_, got), want in zip(bf16["losses"], losses, strict=True):
        assert abs(got - want) / want < 0.02
    sft_losses, sft_weights = packed_reference_run(packed_blocks, FOUR_LAYERS)
    assert_matches_reference("sft-cp2", packed, sft_losses, sft_weights, tmp_path / "sft-hf")
    assert_memory_model_holds("sft-cp2", packed)
