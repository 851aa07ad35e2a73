"""Data parallelism and ZeRO-1 reproduce one process (fp32, same data and seed).

The distributed runs cut the reference's global batch over 2 ranks and
accumulation microbatches, all in one spawned gloo group.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshtrain.models.cpu_linear import onednn_available
from tests.conftest import TINY_MODEL
from tests.distributed.reference import (
    assert_matches_reference,
    assert_memory_model_holds,
    make_spec,
    reference_run,
    run_group,
)

CASES = {
    # per-device batch x accumulation x dp = 8 in every case
    "dp2-zero1": ({"zero_1": True}, {"per_device_train_batch_size": 4}),
    # Buckets of a few parameters each, started during the backward of the second
    # microbatch only (a reduction after the first would lose the second's gradients).
    "dp2-zero1-accum2": (
        {"zero_1": True},
        {
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "grad_bucket_mb": 0.02,
        },
    ),
    "dp2-no-zero": (
        {"zero_1": False},
        {"per_device_train_batch_size": 4, "grad_bucket_mb": 0.02},
    ),
    # The Linear layers on torch.mm, as nn.Linear has them (every other case: oneDNN).
    "dp2-no-zero-blas": (
        {"zero_1": False},
        {"per_device_train_batch_size": 4, "cpu_matmul": "blas"},
    ),
    # torch.compile'd decoder layers: the same arithmetic to 1e-5.
    "dp2-zero1-compile": ({"zero_1": True}, {"per_device_train_batch_size": 4, "compile": True}),
    # Nothing overlapped: gradients averaged after the backward, parameters gathered in one
    # all-gather right after the update.
    "dp2-zero1-after-backward": (
        {"zero_1": True},
        {
            "per_device_train_batch_size": 4,
            "overlap_grad_reduce": False,
            "overlap_param_gather": False,
        },
    ),
    "dp2-zero1-checkpointing": (
        {"zero_1": True, "activation_checkpointing": "full"},
        {"per_device_train_batch_size": 4},
    ),
    # Selective recomputation, and offloading (a no-op on CPU that must change nothing).
    "dp2-selective-offload": (
        {"activation_checkpointing": "selective", "activation_offloading": True},
        {"per_device_train_batch_size": 4},
    ),
}
BF16 = ({"zero_1": True}, {"per_device_train_batch_size": 4, "mixed_precision": "bf16"})


@pytest.mark.slow
def test_dp2_with_and_without_zero1_match_one_process(tiny_blocks, tmp_path: Path):
    specs = [
        make_spec(
            tiny_blocks,
            tmp_path,
            name,
            world=2,
            parallel={"data_parallel_size": 2, **parallel},
            training=training,
            architecture="llama",
            fields=TINY_MODEL,
        )
        for name, (parallel, training) in [*CASES.items(), ("dp2-zero1-bf16", BF16)]
    ]
    *results, bf16_result = run_group(specs, 2, tmp_path, "t-dp")

    expected_losses, expected_weights = reference_run(tiny_blocks, "llama", TINY_MODEL)
    assert expected_losses[-1] < expected_losses[0]
    for (name, (parallel, training)), summary in zip(CASES.items(), results, strict=True):
        assert_matches_reference(
            name, summary, expected_losses, expected_weights, tmp_path / f"{name}-hf"
        )
        assert summary["initial_val_loss"] > summary["final_val_loss"]
        # The oneDNN converter ran where the run asked for it and this torch has oneDNN.
        on_onednn = training.get("cpu_matmul", "onednn") == "onednn" and onednn_available()
        assert summary["converters"] == (["onednn_linear"] if on_onednn else []), name
        assert_memory_model_holds(name, summary)
        buckets = summary["gradient_buckets"]
        if training.get("grad_bucket_mb"):
            # Every bucket was started by the backward (of the last microbatch).
            assert buckets["count"] > 2, buckets
            assert buckets["started_in_backward"] == buckets["count"], buckets
        elif training.get("overlap_grad_reduce") is False:
            assert buckets["started_in_backward"] == 0, buckets
        # ZeRO-1's gather overlapped: after every update but the last (whose checkpoint
        # waits for it) each bucket reached its rank when a module of the forward asked.
        overlapped = parallel.get("zero_1") and training.get("overlap_param_gather", True)
        if overlapped and not training.get("compile"):
            assert buckets["gather_rounds_in_forward"] == buckets["gather_rounds"] - 1, buckets
        else:
            assert "gather_rounds" not in buckets, buckets

    # bf16 autocast is not fp32 arithmetic, so it only has to track the fp32 run closely.
    bf16_losses = [loss for _, loss in bf16_result["losses"]]
    for got, want in zip(bf16_losses, expected_losses, strict=True):
        assert abs(got - want) / want < 0.02
