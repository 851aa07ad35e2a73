"""The shipped Kedro environments change configuration only, and run where they can.

`--env trn1` on a machine without the AWS Neuron packages: data processing,
planning for a trn1.32xlarge (plan.json, MLflow) work, and the launch stops
with what to install. `--env gpu` cannot run here (NCCL, a hub dataset); its
parameters are checked to parse into a valid run configuration.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kedro.config import OmegaConfigLoader

from meshtrain.config import RunConfig
from tests.kedro_project import REPO, kedro_run, make_project, mlflow_client

GROUPS = ("parallel", "training", "launch", "model", "data", "planner")


def _parameters(env: str) -> dict:
    loader = OmegaConfigLoader(
        str(REPO / "conf"),
        base_env="base",
        default_run_env=env,
        merge_strategy={"parameters": "soft"},
    )
    return loader["parameters"]


@pytest.mark.parametrize("env", ["gpu", "trn1", "team", "sft", "moe", "qwen3_lora"])
def test_environment_parameters_parse_and_keep_the_base_values(env: str) -> None:
    params = _parameters(env)
    run = RunConfig.from_params(**{group: params.get(group) for group in GROUPS})
    base = _parameters("base")
    # Soft merge: an environment that sets one field of a group keeps the others.
    assert run.training.seed == base["training"]["seed"]
    assert run.model.architecture == ("qwen3_moe" if env == "moe" else "auto")
    if env == "gpu":
        assert run.launch.backend == "nccl"
        assert run.training.mixed_precision == "bf16"
        assert run.data.source == "hub"
        assert run.model.config["hidden_size"] == 2048
        assert run.model.config["rms_norm_eps"] == base["model"]["config"]["rms_norm_eps"]
    if env == "sft":  # the default model, fine-tuned on chats: only the data and files change
        assert run.model.init_from == "data/06_models/consolidated"
        assert (run.data.source, run.data.loss_on, run.data.packing) == (
            "builtin_instructions",
            "assistant",
            "bfd",
        )
        assert run.model.config == base["model"]["config"]  # not applied: the folder's wins
    if env == "moe":  # the default shape, its MLPs made 8 experts with the router loss on
        assert run.model.config["hidden_size"] == base["model"]["config"]["hidden_size"]
        assert (run.model.config["num_experts"], run.model.config["num_experts_per_tok"]) == (8, 2)
        assert run.model.config["output_router_logits"] is True
    if env == "qwen3_lora":  # optimum-neuron's example, its LoraConfig as written
        lora = run.model.lora
        assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (64, 128, 0.05)
        assert lora.target_modules[0] == "embed_tokens" and len(lora.target_modules) == 8
        assert (run.parallel.tensor_parallel_size, run.launch.nproc_per_node) == (8, 32)
        assert (run.data.block_size, run.training.mixed_precision) == (4096, "bf16_master")
    if env == "trn1":
        assert run.launch.backend == "neuron"
        assert (run.parallel.tensor_parallel_size, run.parallel.pipeline_parallel_size) == (4, 2)
        assert run.model.config["tie_word_embeddings"] is True  # Llama-3.2-3B's own


@pytest.mark.slow
def test_trn1_plans_for_a_trn1_32xlarge_and_stops_at_the_launch(tmp_path: Path) -> None:
    project = make_project(tmp_path / "project")
    result = kedro_run(
        project,
        "--env",
        "trn1",
        "--params",
        "data.builtin_max_chars=2000000,data.num_proc=1",
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "launch.backend=neuron needs torch_neuronx" in output
    assert "pip.repos.neuron.amazonaws.com" in output
    assert "[rank0]" not in output  # no worker started

    plan = json.loads((project / "data/05_model_input/plan.json").read_text())
    # optimum-neuron's Llama-3.2-3B example, tied embeddings across the two stages.
    assert plan["layout_name"] == "dp4-tp4-pp2-zero1-sp-1f1b-mb8"
    assert plan["device"] == "trn1"
    assert plan["backend"] == "neuron"
    memory = plan["memory_estimate_per_rank"]
    assert 0 < memory["total"] < 16 * 2**30 * 0.9  # fits a 16 GiB NeuronCore
    assert len(memory["total_per_pipeline_rank"]) == 2

    client = mlflow_client(project)
    (run,) = client.search_runs([client.get_experiment_by_name("meshtrain").experiment_id])
    assert run.data.params["parallel.tensor_parallel_size"] == "4"
    assert run.data.params["parallel.pipeline_parallel_size"] == "2"
    assert run.data.tags["kedro.env"] == "trn1"
