"""The planner on mixtures of experts: their size and active size as published, their
model FLOPs on the active parameters, and the layouts meshtrain does not run yet refused
before any worker starts."""

from __future__ import annotations

import json

import pytest

from meshtrain.commands import main
from tests.planner.test_command import EXAMPLES

# Total and active parameters, in billions, as their model cards give them (rounded).
PUBLISHED = {
    "qwen3-30b-a3b": (30.5, 3.3, "8 of 128 experts a token"),
    "qwen3-235b-a22b": (235.1, 22.2, "8 of 128 experts a token"),
    "mixtral-8x7b": (46.7, 12.9, "2 of 8 experts a token"),
}


def _plan(*args: str) -> list[str]:
    return ["plan", "--model", *args]


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_moe_examples_plan_with_their_published_sizes(model: str, capsys) -> None:
    total, active, routed = PUBLISHED[model]
    path = str(EXAMPLES / f"{model}.json")
    assert main(_plan(path, "--devices", "256", "--device", "h100", "--seq-len", "4096")) == 0
    first = capsys.readouterr().out.splitlines()[0]
    numbers = first.split(", ")[1]  # "30.53B parameters (3.35B active: ...)"
    assert abs(float(numbers.split("B")[0]) - total) < 0.06, first
    assert abs(float(numbers.split("(")[1].split("B")[0]) - active) < 0.06, first
    assert routed in first


def test_moe_model_flops_count_the_active_parameters(capsys) -> None:
    """6 x the matmul weights a token passes (attention, router, its 8 experts, the head)
    + the attention scores, from the config by hand."""
    path = EXAMPLES / "qwen3-30b-a3b.json"
    assert (
        main(
            [*_plan(str(path)), "--devices", "8", "--device", "h100", "--seq-len", "4096", "--json"]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    c = json.loads(path.read_text())
    h, layers, hd = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    attention = h * (2 * q + 2 * kv)
    mlp = c["num_experts"] * h + c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]
    weights = layers * (attention + mlp) + h * c["vocab_size"]
    scores = 12 * layers * c["num_attention_heads"] * hd * 4096
    assert plan["model_flops_per_token"] == pytest.approx(6 * weights + scores, rel=1e-9)


def test_tensor_parallelism_of_a_mixture_of_experts_plans_with_sequence_parallelism(
    capsys,
) -> None:
    path = str(EXAMPLES / "qwen3-30b-a3b.json")
    assert main([*_plan(path), "--devices", "16", "--device", "h100", "--tp", "2"]) == 0
    chosen = capsys.readouterr().out.splitlines()[1]
    assert "-tp2-" in chosen and "-sp" in chosen, chosen


def test_pipeline_parallelism_of_a_mixture_of_experts_plans_ep_inside_the_stages(
    capsys,
) -> None:
    path = str(EXAMPLES / "qwen3-30b-a3b.json")
    assert main([*_plan(path), "--devices", "16", "--device", "h100", "--pp", "2"]) == 0
    chosen = capsys.readouterr().out.splitlines()[1]
    assert "-pp2-" in chosen and "-ep" in chosen, chosen


def test_context_parallelism_of_a_mixture_of_experts_plans_with_ep_from_its_ranks(
    capsys,
) -> None:
    """cp splits every sequence, sparse layers included; ep is taken from dp x cp."""
    path = str(EXAMPLES / "qwen3-30b-a3b.json")
    args = [*_plan(path), "--devices", "16", "--device", "h100", "--seq-len", "16384"]
    assert main([*args, "--cp", "2", "--ep", "8", "--bf16"]) == 0
    assert "chosen: dp8-tp1-pp1-cp2-ep8-" in capsys.readouterr().out.splitlines()[1]
    assert main([*args, "--cp", "4", "--ep", "16", "--tp", "2"]) == 1
    out = capsys.readouterr().out
    assert "taken from the 8 data- x context-parallel ranks, so it must divide 8" in out


@pytest.mark.parametrize(
    ("lora", "refusal"),
    [
        ({"target_modules": ["q_proj", "gate_proj"]}, "names gate_proj without up_proj"),
        ({"target_modules": r".*_proj"}, "a regular expression on a mixture of experts"),
        ({"target_modules": "all-linear", "lora_dropout": 0.1}, "PEFT refuses dropout"),
        ({"target_modules": [], "target_parameters": ["w2"]}, "not a parameter of this model"),
    ],
)
def test_lora_targets_on_a_mixture_of_experts_are_read_as_peft_reads_them(lora, refusal) -> None:
    """all-linear and the MLP's names reach the routers and the 3-D experts (gate and up
    fused at twice the rank), as PEFT maps them; what PEFT refuses is refused."""
    from meshtrain.config import ConfigError, LoraSettings
    from meshtrain.models import build_model_config
    from meshtrain.models.shapes import lora_adapter_shapes

    fields = {"hidden_size": 64, "num_attention_heads": 4, "num_experts": 4}
    config = build_model_config("qwen3_moe", fields, vocab_size=128)
    with pytest.raises(ConfigError, match=refusal):
        lora_adapter_shapes(config, LoraSettings(r=4, **lora))
    shapes = lora_adapter_shapes(config, LoraSettings(r=4, target_modules="all-linear"))
    layer = {k.removeprefix("model.layers.0."): v for k, v in shapes.items() if ".layers.0." in k}
    assert layer["mlp.experts.lora_A.gate_up_proj"] == (4, 8, 64)  # E x 2r x hidden
    assert layer["mlp.experts.lora_B.down_proj"] == (4, 64, 4)
    assert layer["mlp.gate.lora_B.weight"] == (4, 4)
    assert {k.split(".lora_")[0] for k in layer} == {
        *(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        "mlp.gate",
        "mlp.experts",
    }
    dense = build_model_config(
        "qwen3",
        {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4},
        vocab_size=128,
    )
    with pytest.raises(ConfigError, match="this qwen3 model has none of"):
        lora_adapter_shapes(dense, LoraSettings(target_parameters=["gate_up_proj"]))


def test_lora_on_the_experts_plans_their_merged_weights(capsys) -> None:
    """`plan --lora-r` on Qwen3-30B-A3B: the routers' and experts' adapters split with
    the experts over ep, and each sparse layer's merged expert weights (E/ep x out x in
    per adapted parameter, as PEFT builds them) counted."""
    from meshtrain.config import LoraSettings
    from meshtrain.models.config_file import read_config_file
    from meshtrain.models.shapes import lora_adapter_shapes
    from meshtrain.planner.lora_memory import merged_weight_bytes

    path = EXAMPLES / "qwen3-30b-a3b.json"
    config = read_config_file(path)
    shapes = lora_adapter_shapes(config, LoraSettings(r=16, target_modules="all-linear"))
    per_layer = merged_weight_bytes(shapes, 48, ep=2, value_bytes=2)
    assert per_layer == 64 * (2 * 768 * 2048 + 2048 * 768) * 2  # 64 experts a rank
    args = [*_plan(str(path)), "--devices", "8", "--device", "h100", "--seq-len", "4096"]
    assert main([*args, "--global-batch", "64", "--bf16", "--lora-r", "16"]) == 0
    chosen = capsys.readouterr().out.splitlines()[1]
    assert "-ep" in chosen and chosen.split()[1].endswith("-lora16")
