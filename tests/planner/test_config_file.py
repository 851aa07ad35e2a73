"""`models.config_file`: a config.json read as JSON gives the planner what transformers'
own config classes give it, and `python -m meshtrain plan` then runs without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from meshtrain.config import ConfigError
from meshtrain.models.config_file import SUPPORTED_ARCHITECTURES, read_config_file
from meshtrain.planner.search import plan_run
from tests.planner.test_command import EXAMPLES

# Every field the planner reads of a model's config (directly or by getattr).
READ = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    # Mixtures of experts (`models.moe_config`).
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "output_router_logits",
    "router_aux_loss_coef",
)
# A file that gives nothing but its type, a small shape that leaves the derived sizes
# to the class, one that sets the key/value heads to null, and one that sets all of them.
VARIANTS = [
    {},
    {"hidden_size": 64, "num_attention_heads": 4},
    {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": None},
    {
        "hidden_size": 96,
        "intermediate_size": 200,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
        "max_position_embeddings": 512,
    },
]
MISSING = object()


def _fields(config) -> dict:
    return {name: getattr(config, name, MISSING) for name in READ}


def _write(tmp_path: Path, values: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    return path


# (MistralConfig, MixtralConfig and Qwen3MoeConfig type num_key_value_heads as int:
# transformers refuses a null there.)
CASES = [
    (architecture, variant)
    for architecture in SUPPORTED_ARCHITECTURES
    for variant in range(len(VARIANTS))
    if (architecture, variant) not in (("mistral", 2), ("mixtral", 2), ("qwen3_moe", 2))
]


@pytest.mark.parametrize(("architecture", "variant"), CASES)
def test_the_planners_fields_are_transformers(tmp_path: Path, architecture: str, variant: int):
    path = _write(tmp_path, {"model_type": architecture, **VARIANTS[variant]})
    assert _fields(read_config_file(path)) == _fields(AutoConfig.from_pretrained(str(path)))


# Each example on a cluster it fits (the README's and docs/planner.md's sizes): devices,
# and the big ones' tp and pp fixed (their whole search takes 15 s; the small ones' is
# searched whole).
CLUSTERS = {
    "llama-3.2-3b": (8, "auto", "auto"),
    "llama-3.1-8b": (8, "auto", "auto"),
    "llama-3.1-70b": (64, 8, "auto"),
    "llama-3.1-405b": (512, 8, 8),
}


@pytest.mark.parametrize("example", sorted(CLUSTERS))
def test_an_example_plans_the_same_from_either_reader(example: str):
    """The plan (layout, memory, time, every runner-up and why it lost) is the one
    transformers' config gives; only `model_config` differs: the file's own fields, where
    transformers' lists its whole class (the dry run rebuilds either)."""
    from meshtrain.config import RunConfig

    path = EXAMPLES / f"{example}.json"
    devices, tp, pp = CLUSTERS[example]
    run = RunConfig.from_params(
        parallel={
            "data_parallel_size": "auto",
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "context_parallel_size": "auto",
            "sharded_data_parallel_degree": "auto",
            "zero_1": "auto",
            "activation_checkpointing": "auto",
        },
        launch={"nproc_per_node": 8, "nnodes": devices // 8},
        data={"block_size": 4096},
        training={
            "per_device_train_batch_size": 1,
            "global_batch_size": 256,
            "mixed_precision": "bf16",
        },
        planner={"device": "h100"},
    )
    light, full = (
        plan_run(
            run, config, num_train_blocks=10**6, num_validation_blocks=64, cuda_available=False
        ).to_dict()
        for config in (read_config_file(path), AutoConfig.from_pretrained(str(path)))
    )
    assert light.pop("model_config") != full.pop("model_config")
    assert light == full


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"model_type": "deepseek_v3"}', "model_type is 'deepseek_v3'; meshtrain supports llama"),
        ('{"model_type": "Llama"}', "Did you mean `model.architecture=llama`?"),
        ("[1, 2]", "holds one JSON object"),
        ("{not json", "not a readable config.json"),
    ],
)
def test_a_file_the_planner_cannot_read_is_refused(tmp_path: Path, content: str, message: str):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        read_config_file(tmp_path)


def test_plan_imports_neither_torch_nor_transformers():
    """What makes `plan` start in under a second (docs/benchmarks.md): the planner's
    modules, the config reader and the command import no modelling code."""
    probe = (
        "import sys; from meshtrain.commands import main; "
        f"rc = main(['plan', '--model', {str(EXAMPLES / 'llama-3.1-8b.json')!r}, "
        "'--devices', '8', '--device', 'h100', '--json']); "
        "print(rc, sorted(m for m in ('torch', 'transformers', 'mlflow', 'datasets') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "0 []"
