"""The time model's compute rate by matmul size, and what CPU collectives cannot hide."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from transformers import PretrainedConfig

from meshtrain.config import RunConfig
from meshtrain.models import build_model_config
from meshtrain.planner import Plan, plan_run
from meshtrain.planner.devices import BUILTIN_PROFILES, device_profile

# A 512-wide model, so that tp2's matmuls fall in another width class.
SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
}
TABLE = ((128, 256, 0.02), (128, 1024, 0.04), (512, 256, 0.05), (512, 1024, 0.07))


@pytest.fixture(scope="module")
def model_config() -> PretrainedConfig:
    return build_model_config("llama", dict(SHAPE), vocab_size=4096)


def _plan(model_config: PretrainedConfig, **groups: dict[str, Any]) -> Plan:
    training = {"per_device_train_batch_size": 4, **groups.pop("training", {})}
    run = RunConfig.from_params(data={"block_size": 256}, training=training, **groups)
    return plan_run(
        run, model_config, num_train_blocks=1000, num_validation_blocks=8, cuda_available=False
    )


def test_the_rate_is_read_at_the_measured_sizes_and_interpolated_between() -> None:
    cpu = dataclasses.replace(BUILTIN_PROFILES["cpu"], tflops_fp32_by_shape=TABLE)
    assert cpu.tflops(False, width=512, tokens=1024) == pytest.approx(0.07)
    assert cpu.tflops(False, width=128, tokens=256) == pytest.approx(0.02)
    # Half-way in log2 of the tokens (512 between 256 and 1024), then of the width (256).
    assert cpu.tflops(False, width=128, tokens=512) == pytest.approx(0.03)
    assert cpu.tflops(False, width=256, tokens=512) == pytest.approx((0.03 + 0.06) / 2)
    # Held beyond the sizes measured; bf16 and unknown sizes keep the flat rates.
    assert cpu.tflops(False, width=4096, tokens=8192) == pytest.approx(0.07)
    assert cpu.tflops(False, width=64, tokens=64) == pytest.approx(0.02)
    assert cpu.tflops(True, width=512, tokens=1024) == cpu.tflops_bf16
    assert cpu.tflops(False) == cpu.tflops_fp32


def test_the_table_comes_from_yaml_as_lists() -> None:
    rows = [[128, 256, 0.02], [512, 1024, 0.07]]
    cpu = device_profile("cpu", {"cpu": {"tflops_fp32_by_shape": rows}})
    assert cpu.tflops_fp32_by_shape == ((128.0, 256.0, 0.02), (512.0, 1024.0, 0.07))
    assert cpu.tflops(False, width=512, tokens=1024) == pytest.approx(0.07)


def test_tensor_parallel_matmuls_are_narrower_and_slower_per_flop(model_config) -> None:
    """tp2 halves a rank's FLOPs, but its hidden / tp = 256 wide matmuls run at a lower
    rate on CPU, so its compute is more than half of one rank's."""
    one = _plan(model_config, launch={"nproc_per_node": 1})
    tp2 = _plan(model_config, launch={"nproc_per_node": 2}, parallel={"tensor_parallel_size": 2})
    ratio = tp2.time_estimate["compute_s"] / one.time_estimate["compute_s"]
    cpu = BUILTIN_PROFILES["cpu"]
    expected = 0.5 * cpu.tflops(False, 512, 1024) / cpu.tflops(False, 256, 1024)
    assert ratio == pytest.approx(expected)
    assert ratio > 0.5


def test_on_cpu_the_gradient_averaging_is_not_hidden_behind_the_backward(model_config) -> None:
    """gloo runs on the cores that compute: overlap_grad_reduce hides nothing there
    (`collective_overlap` 0), where a device with copy engines hides all but the last
    bucket."""

    def dp_seconds(overlap: float, **training: Any) -> float:
        profiles = {"cpu": {"collective_overlap": overlap}}
        plan = _plan(
            model_config,
            launch={"nproc_per_node": 2},
            training={"grad_bucket_mb": 1, **training},
            planner={"device": "cpu", "device_profiles": profiles},
        )
        return plan.time_estimate["data_parallel_s"]

    after = dp_seconds(0.0, overlap_grad_reduce=False)
    assert dp_seconds(0.0, overlap_grad_reduce=True) == pytest.approx(after)
    assert 0 < dp_seconds(1.0, overlap_grad_reduce=True) < after
