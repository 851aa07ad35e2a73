"""The time model's compute rate by matmul size, and what CPU collectives cannot hide."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from transformers import PretrainedConfig

from meshtrain.config import RunConfig, TrainingConfig
from meshtrain.models import build_model_config
from meshtrain.models.converters import converter_names
from meshtrain.planner import LayoutError, Plan, plan_run
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
# The CPU Linear layers' converter, whose rates the cpu profile measured apart.
CONVERTER = ("onednn_linear",)


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


def test_the_tables_come_from_yaml_as_lists() -> None:
    rows = [[128, 256, 0.02], [512, 1024, 0.07]]
    converter_rows = [[128, 256, 0.04], [512, 1024, 0.11]]
    tables = {
        "tflops_fp32_by_shape": rows,
        "converter_tflops_fp32_by_shape": {"onednn_linear": converter_rows},
    }
    cpu = device_profile("cpu", {"cpu": tables})
    assert cpu.tflops_fp32_by_shape == ((128.0, 256.0, 0.02), (512.0, 1024.0, 0.07))
    assert cpu.converter_tflops_fp32_by_shape == {
        "onednn_linear": ((128.0, 256.0, 0.04), (512.0, 1024.0, 0.11))
    }
    assert cpu.tflops(False, width=512, tokens=1024) == pytest.approx(0.07)
    assert cpu.tflops(False, width=512, tokens=1024, converters=CONVERTER) == pytest.approx(0.11)


def test_the_old_torch_mm_table_key_is_refused_with_the_new_names(model_config) -> None:
    """A profile override written for the release whose main table was oneDNN's would
    silently swap the two tables' meanings: refused, naming the keys that replace it."""
    old = {"cpu": {"blas_tflops_fp32_by_shape": [[128, 256, 0.01]]}}
    with pytest.raises(ValueError, match="converter_tflops_fp32_by_shape") as error:
        device_profile("cpu", old)
    assert "`tflops_fp32_by_shape` (the device's own path)" in str(error.value)
    with pytest.raises(LayoutError) as refused:
        _plan(model_config, planner={"device": "cpu", "device_profiles": old})
    (refusal,) = refused.value.refusals
    assert refusal.parameter == "planner.device_profiles.cpu"
    assert refusal.value == "blas_tflops_fp32_by_shape"
    with pytest.raises(ValueError, match="maps a converter's name"):
        device_profile("cpu", {"cpu": {"converter_tflops_fp32_by_shape": [[128, 256, 0.1]]}})


def test_a_profile_without_a_converters_rates_reads_its_own_table_for_its_runs() -> None:
    h100 = BUILTIN_PROFILES["h100"]
    assert h100.tflops(False, width=4096, tokens=4096, converters=CONVERTER) == h100.tflops_fp32
    cpu = dataclasses.replace(
        BUILTIN_PROFILES["cpu"], tflops_fp32_by_shape=TABLE, converter_tflops_fp32_by_shape={}
    )
    assert cpu.tflops(False, width=512, tokens=1024, converters=CONVERTER) == pytest.approx(0.07)
    # A converter the profile has no table for leaves the rate the device's own.
    assert BUILTIN_PROFILES["cpu"].tflops(
        False, 512, 1024, converters=("other",)
    ) == BUILTIN_PROFILES["cpu"].tflops(False, 512, 1024)


def test_tensor_parallel_matmuls_are_narrower_and_slower_per_flop(model_config) -> None:
    """tp2 halves a rank's FLOPs, but its 512 x 256 matmuls (the width of a 362 x 362
    square) run at a lower rate on CPU, so its compute is more than half of one rank's.
    (Both on the device's own table: tp2 has no converter whatever `cpu_matmul` says.)"""
    own_path = {"cpu_matmul": "blas"}
    one = _plan(model_config, launch={"nproc_per_node": 1}, training=own_path)
    assert (
        converter_names(TrainingConfig(cpu_matmul="onednn"), on_cpu=True, tensor_parallel=True)
        == ()
    )
    tp2 = _plan(
        model_config,
        launch={"nproc_per_node": 2},
        parallel={"tensor_parallel_size": 2},
        training={"cpu_matmul": "onednn"},
    )
    ratio = tp2.time_estimate["compute_s"] / one.time_estimate["compute_s"]
    cpu = BUILTIN_PROFILES["cpu"]
    narrow = cpu.tflops(False, 512 / 2**0.5, 1024)
    assert ratio == pytest.approx(0.5 * cpu.tflops(False, 512, 1024) / narrow)
    assert ratio > 0.5


@pytest.mark.skipif(
    converter_names(TrainingConfig(cpu_matmul="onednn"), on_cpu=True, tensor_parallel=False)
    != CONVERTER,
    reason="oneDNN's fp32 linear is not in this torch: no converter to plan for",
)
def test_a_converters_run_is_planned_at_its_table_and_one_without_at_the_devices(
    model_config,
) -> None:
    """On the CPUs the cpu profile was measured on, torch.mm runs the Linear layers
    1.4-1.6x slower than the oneDNN converter: a run without it (`cpu_matmul: blas`) is
    planned at the profile's own rates, one through it at the converter's."""
    one = {"nproc_per_node": 1}
    converted = _plan(model_config, launch=one, training={"cpu_matmul": "onednn"})
    own_path = _plan(model_config, launch=one, training={"cpu_matmul": "blas"})
    ratio = own_path.time_estimate["compute_s"] / converted.time_estimate["compute_s"]
    cpu = BUILTIN_PROFILES["cpu"]
    assert ratio == pytest.approx(
        cpu.tflops(False, 512, 1024, converters=CONVERTER) / cpu.tflops(False, 512, 1024)
    )
    assert ratio > 1.5


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


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_model_flops_count_every_matmul_weight_and_attention(architecture: str) -> None:
    """6 x the weights of every matmul a token passes (the input embedding is a lookup) +
    12 x layers x attention width x sequence, counted from the built model's own weights
    (qwen3's head_dim 128 makes the attention wider than the hidden size)."""
    from meshtrain.models import build_model
    from meshtrain.planner.flops import model_flops_per_token
    from meshtrain.planner.shapes import ModelShape

    fields = {**SHAPE, "head_dim": 256} if architecture == "qwen3" else dict(SHAPE)
    config = build_model_config(architecture, fields, vocab_size=4096)
    model = build_model(config, seed=0)
    matmul_weights = sum(
        p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed_tokens" not in n
    )
    width = config.num_attention_heads * config.head_dim
    expected = 6 * matmul_weights + 12 * config.num_hidden_layers * width * 256
    assert model_flops_per_token(ModelShape.from_config(config), 256) == expected


def test_a_plan_carries_its_mfu_basis_in_the_training_dtype(model_config) -> None:
    """The plan holds the model FLOPs per token and the device's published peak per rank
    (bf16's under mixed precision); MFU is tokens/s in those FLOPs over the world's peak."""
    fp32 = _plan(model_config, launch={"nproc_per_node": 2})
    assert fp32.peak_tflops_per_rank == BUILTIN_PROFILES["cpu"].peak_tflops_fp32
    tokens_per_s = 1000.0
    expected = tokens_per_s * fp32.model_flops_per_token / (2 * fp32.peak_tflops_per_rank * 1e12)
    assert fp32.mfu(tokens_per_s) == pytest.approx(expected)
    h100 = {"device": "h100"}
    bf16 = _plan(model_config, training={"mixed_precision": "bf16"}, planner=h100)
    assert bf16.peak_tflops_per_rank == BUILTIN_PROFILES["h100"].peak_tflops_bf16 == 989.4
    # A device defined without peaks plans as before and logs no MFU.
    fields = dataclasses.asdict(BUILTIN_PROFILES["cpu"])
    for name in ("name", "note", "peak_tflops_fp32", "peak_tflops_bf16"):
        fields.pop(name)
    fields["tflops_fp32_by_shape"] = [list(row) for row in fields["tflops_fp32_by_shape"]]
    custom = {"device": "mycpu", "device_profiles": {"mycpu": fields}}
    assert _plan(model_config, planner=custom).mfu(tokens_per_s) is None


def _pipeline_step(layers: tuple[int, ...], pp: int = 2, virtual: int = 1):
    from meshtrain.planner.shapes import FP32

    return dataclasses.replace(
        FP32,
        pp=pp,
        microbatches=4,
        schedule="1f1b",
        virtual_stages=virtual,
        stage_layers=layers,
        seq_len=256,
    )


def test_the_bubble_is_the_other_ranks_microbatch_around_the_busiest() -> None:
    """Balanced stages give the textbook (p-1)/v microbatch times; where the LM head makes
    the last rank the busiest, the first rank's lighter microbatch is all the fill and
    drain (tiny pp2's schedule picture: 16 ms of bubble around 39 ms microbatches)."""
    from meshtrain.planner.axes.pipeline import fill_and_drain, stage_shares
    from meshtrain.planner.shapes import ModelShape

    tiny = ModelShape.from_config(
        build_model_config(
            "llama",
            {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4},
            vocab_size=4096,
        )
    )

    def bubble(model: ModelShape, step) -> float:
        return fill_and_drain(stage_shares(model, step), step.virtual_stages)

    shares = stage_shares(tiny, _pipeline_step((2, 2)))
    assert sum(shares) == pytest.approx(1.0) and shares[1] > 2 * shares[0]
    assert bubble(tiny, _pipeline_step((2, 2))) == pytest.approx(shares[0] / shares[1])
    # Without an LM head worth counting (a tiny vocabulary), the stages balance: (p-1)/v.
    headless = dataclasses.replace(tiny, vocab=1)
    assert bubble(headless, _pipeline_step((2, 2))) == pytest.approx(1.0, rel=1e-3)
    four = _pipeline_step((1, 1, 1, 1, 1, 1, 1, 1), pp=4, virtual=2)
    assert bubble(headless, four) == pytest.approx(3 / 2, rel=1e-3)


def test_pipeline_sends_cost_the_point_to_point_latency(model_config) -> None:
    """A stage boundary's send waits for no third rank: the cpu profile's p2p latency, not
    its collective hop's, and a profile without one falls back to the hop."""

    def pipeline_s(**cpu: float) -> float:
        plan = _plan(
            model_config,
            launch={"nproc_per_node": 2},
            parallel={"pipeline_parallel_size": 2, "pipeline_parallel_num_microbatches": 4},
            planner={"device": "cpu", "device_profiles": {"cpu": cpu}},
        )
        return plan.time_estimate["pipeline_s"]

    cpu = BUILTIN_PROFILES["cpu"]
    assert cpu.send_latency_us < cpu.latency_us
    fallback = pipeline_s(p2p_latency_us=0.0)
    sends = 2 * 4  # one activation and one gradient per microbatch
    assert fallback - pipeline_s() == pytest.approx(
        sends * (cpu.latency_us - cpu.p2p_latency_us) * 1e-6
    )
