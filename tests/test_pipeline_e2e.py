"""The whole default pipeline through `kedro run`, as a user runs it, in a scratch project.

The project's `conf/` and `pyproject.toml` are copied into a temporary folder
so the run writes its data, checkpoints and MLflow store there, not into the
repository. Checks: the MLflow run holds the resolved layout and the metrics,
the consolidated folder loads in a Python that never imports meshtrain and
gives the trained model's logits, and a bad layout stops before any worker.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from meshtrain.config import TrainingConfig
from meshtrain.models.converters import converter_names
from tests import warm_kedro
from tests.conftest import worker_processes
from tests.kedro_project import (
    SMALL_RUN,
    kedro_run,
    make_project,
    mlflow_client,
    project_env,
)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return make_project(tmp_path_factory.mktemp("project"))


# The default run also registers its model and runs meshtrain's offline lm-eval task.
REGISTERED = "meshtrain-e2e"
LM_EVAL = "evaluation.lm_eval_tasks=meshtrain_python_basics,evaluation.lm_eval_limit=8"
# Adam's epsilon above the last-bit noise of near-zero gradients, so that the 3-D run
# below can be held to the default run's weights at 1e-5 (it trains the same global batch).
ADAM_EPSILON = "training.adam_epsilon=1e-5"
# The planning node also dry-runs the plan's rank 0 (docs/dry_run.md).
DRY_RUN = "planner.dry_run=true"


@pytest.fixture(scope="module")
def default_run(project: Path) -> subprocess.CompletedProcess:
    (project / "conf/local/mlflow.yml").write_text(f"registered_model_name: {REGISTERED}\n")
    result = kedro_run(project, "--params", f"{SMALL_RUN},{LM_EVAL},{ADAM_EPSILON},{DRY_RUN}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.mark.slow
def test_default_pipeline_trains_consolidates_and_evaluates(project: Path, default_run):
    metrics = json.loads((project / "data/08_reporting/metrics.json").read_text())
    assert metrics["layout"] == "dp2-tp1-pp1"
    assert metrics["val_perplexity"] < metrics["initial_val_perplexity"]
    assert metrics["sample"].startswith(metrics["prompt"])
    # Several prompts from the validation text, none continued by one token repeated.
    samples = metrics["samples"]
    assert len(samples) == 4 and len({s["prompt"] for s in samples}) == 4
    for sample in samples:
        assert sample["prompt"].strip() and sample["continuation"].strip(), sample
        assert len(set(sample["continuation"].split())) > 1, sample
    assert (metrics["eval_device"], metrics["eval_dtype"]) == ("cpu", "float32")
    assert 0 <= metrics["lm_eval"]["meshtrain_python_basics/acc"] <= 1
    plan = json.loads((project / "data/05_model_input/plan.json").read_text())
    assert plan["layout"]["data_parallel_size"] == 2
    assert plan["memory_estimate_per_rank"]["optimizer_states"] > 0
    assert "step 8/8" in default_run.stdout + default_run.stderr


@pytest.mark.slow
def test_mlflow_run_holds_layout_params_and_metrics(project: Path, default_run):
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("meshtrain")
    runs = client.search_runs([experiment.experiment_id], "tags.mlflow.runName = 'dp2-tp1-pp1'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "dp2-tp1-pp1"
    params = run.data.params
    assert params["parallel.data_parallel_size"] == "2"
    assert params["parallel.tensor_parallel_size"] == "1"
    assert params["parallel.pipeline_parallel_size"] == "1"
    assert params["parallel.zero_1"] == "False"
    assert params["training.max_steps"] == "8"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 8
    for key in ("tokens_per_s", "mfu", "grad_norm", "learning_rate", "memory/peak_rss_mb"):
        assert key in run.data.metrics, key
    assert "val_loss" in run.data.metrics
    # MFU: the steady-state tokens/s in model FLOPs over the 2 ranks' published peak.
    plan = json.loads((project / "data/05_model_input/plan.json").read_text())
    metrics = run.data.metrics
    peak = plan["world_size"] * plan["peak_tflops_per_rank"] * 1e12
    assert plan["peak_tflops_per_rank"] == 0.18  # the cpu profile's fp32 peak per core
    assert run.data.params["mfu.peak_tflops_per_rank"] == "0.18"
    mfu = metrics["eval/train_tokens_per_s"] * plan["model_flops_per_token"] / peak
    assert metrics["eval/train_mfu"] == pytest.approx(mfu, rel=1e-6)
    assert 0 < metrics["eval/train_mfu"] < 1
    # planner.dry_run: rank 0's step on fake tensors, in plan.json and as metrics, holds
    # what the real rank 0 then measured within 5%.
    (dry,) = plan["dry_run"]
    assert dry["rank"] == 0 and dry["peak_at"].startswith(("forward", "backward"))
    dry_peak = metrics["dry_run/step_peak_rank0_bytes"]
    assert dry_peak == dry["terms"]["step_peak"]["dry_run"]
    assert dry_peak / 2**20 == pytest.approx(metrics["memory/peak_tensor_mb_rank0"], rel=0.05)
    assert "eval/val_perplexity" in run.data.metrics
    assert "eval/meshtrain_python_basics/acc" in run.data.metrics
    assert run.data.tags["kedro.env"] == "local"
    # What changed the model's modules in this run: the converters `training.cpu_matmul:
    # auto` chose for a dp2 (not tensor-parallel) run on this machine's CPU, or none.
    expected = converter_names(TrainingConfig(), on_cpu=True, tensor_parallel=False)
    assert run.data.tags["meshtrain.converters"] == (",".join(expected) or "none")
    assert run.data.tags["meshtrain.trains"] == "true"
    assert run.data.tags["meshtrain.pipelines"] == (
        "data_processing,planning,training,consolidation,evaluation"
    )
    # The UI opens the experiment on its runs (MLflow 3's experiment kind).
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    # The planner's estimates beside what the run measured.
    assert float(run.data.params["estimate.time.tokens_per_s"]) > 0
    assert run.data.params["estimate.device"] == "cpu"
    assert 0.9 <= run.data.metrics["memory/predicted_over_measured"] <= 1.1
    assert run.data.metrics["memory/peak_tensor_mb"] > 0
    assert run.data.metrics["memory/predicted_peak_mb"] > 0
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    for name in ("plan.json", "loss_curve.png", "memory_breakdown.png", "samples.json"):
        assert name in artifacts, name
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "samples.json")).read_text())
    assert table["columns"] == ["prompt", "continuation"] and len(table["data"]) == 4


@pytest.mark.slow
def test_mlflow_run_holds_the_model_and_its_data(project: Path, default_run):
    """The model logged from its folder, registered, with the evaluation's metrics linked
    to it; the packed splits as dataset inputs with digests of their blocks."""
    import mlflow

    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("meshtrain")
    (run,) = client.search_runs([experiment.experiment_id], "tags.mlflow.runName = 'dp2-tp1-pp1'")
    inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
    assert sorted(inputs) == ["training", "validation"]
    assert inputs["training"].name == "builtin-train-b128"
    assert json.loads(inputs["validation"].profile)["num_rows"] > 0
    assert len(inputs["training"].digest) == 16
    assert inputs["training"].digest != inputs["validation"].digest

    (output,) = run.outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    assert model.tags["meshtrain.layout"] == "dp2-tp1-pp1"
    assert "eval/val_perplexity" in {m.key for m in model.metrics}
    (version,) = client.search_model_versions(f"name = '{REGISTERED}'")
    assert version.run_id == run.info.run_id
    assert version.tags["meshtrain.layout"] == "dp2-tp1-pp1"

    mlflow.set_tracking_uri(uri)
    loaded = mlflow.pyfunc.load_model(f"models:/{output.model_id}")
    (text,) = loaded.predict(["The"], params={"max_new_tokens": 4, "do_sample": False})
    assert isinstance(text, str) and text.startswith("The")


@pytest.mark.slow
def test_consolidated_model_loads_without_meshtrain_and_matches_training(
    project: Path, default_run
):
    summary = json.loads((project / "data/06_models/training_summary.json").read_text())
    assert_loads_and_matches_checkpoint(
        project, project / "data/06_models/consolidated", Path(summary["final_checkpoint"])
    )


def assert_loads_and_matches_checkpoint(project: Path, consolidated: Path, checkpoint: Path):
    """The consolidated folder loads in plain transformers (no meshtrain imported) and its
    logits equal, bitwise, those of the weights the workers wrote in `checkpoint`."""
    probe = (
        "import sys, torch, transformers\n"
        f"model = transformers.AutoModelForCausalLM.from_pretrained({str(consolidated)!r})\n"
        "ids = torch.arange(1, 33).reshape(2, 16)\n"
        "torch.save(model(input_ids=ids).logits, sys.argv[1])\n"
        "assert not any(m.startswith('meshtrain') for m in sys.modules)\n"
    )
    logits_path = project / "logits.pt"
    result = subprocess.run(
        [sys.executable, "-c", probe, str(logits_path)],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    consolidated_logits = torch.load(logits_path, weights_only=True)

    # The trained weights, exactly as the workers wrote them in the final checkpoint.
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    trained = AutoModelForCausalLM.from_config(config)
    shard = load_file(checkpoint / "shards/tp_rank_00_pp_rank_00/model.safetensors")
    missing, unexpected = trained.load_state_dict(shard, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    with torch.no_grad():
        trained_logits = trained(input_ids=torch.arange(1, 33).reshape(2, 16)).logits
    torch.testing.assert_close(consolidated_logits, trained_logits, rtol=0, atol=0)


@pytest.mark.slow
def test_a_mixture_of_experts_trains_with_its_routing_tracked(project: Path, default_run):
    """`kedro run --env moe` (the default corpus and tokenizer, a small Qwen3-MoE on dp2
    with expert parallelism over both ranks): MLflow holds its layout (ep2) and its router
    loss and expert load per step, and the consolidated folder, one tensor per expert,
    loads in plain transformers with the trained weights' logits."""
    run = kedro_run(
        project,
        "--env",
        "moe",
        "--from-nodes",
        "plan_layout",
        "--params",
        f"{SMALL_RUN},evaluation.log_model=false",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    client = mlflow_client(project)
    experiment = client.get_experiment_by_name("meshtrain")
    (tracked,) = client.search_runs(
        [experiment.experiment_id], "params.`model.architecture` = 'qwen3_moe'"
    )
    assert tracked.data.params["parallel.expert_parallel_size"] == "2"
    assert "-ep2" in tracked.data.tags["meshtrain.layout"]
    for metric in ("router_loss", "expert_load_max_over_mean", "expert_rank_load_max_over_mean"):
        history = client.get_metric_history(tracked.info.run_id, metric)
        assert len(history) == 8, metric
    loads = client.get_metric_history(tracked.info.run_id, "expert_load_max_over_mean")
    assert all(1.0 <= point.value <= 8.0 for point in loads)
    # Two ep ranks: the busier receives at most all of its group's rows.
    ranks = client.get_metric_history(tracked.info.run_id, "expert_rank_load_max_over_mean")
    assert all(1.0 <= point.value <= 2.0 for point in ranks)
    dropped = client.get_metric_history(tracked.info.run_id, "expert_dropped_pairs")
    assert len(dropped) == 8 and all(point.value == 0 for point in dropped)  # dropless
    consolidated = project / "data/06_models/moe"
    assert (consolidated / "model.safetensors").is_file()
    summary = json.loads((project / "data/06_models/training_summary.json").read_text())
    assert_loads_and_matches_checkpoint(project, consolidated, Path(summary["final_checkpoint"]))


@pytest.mark.slow
def test_a_layout_refused_on_the_data_stops_before_any_worker(project: Path, default_run):
    """A batch larger than the corpus passes every check made before the data is read
    (tests/test_refusals_e2e.py has those) and is refused by the planning node."""
    checkpoints = project / "data/06_models/checkpoints"
    before = sorted(p.name for p in checkpoints.iterdir())
    result = kedro_run(
        project,
        "--pipeline",
        "planning",
        "--params",
        SMALL_RUN + ",training.gradient_accumulation_steps=100000",
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "training.per_device_train_batch_size=4: the global batch" in output
    assert "training.gradient_accumulation_steps<=" in output
    assert "Traceback" not in output  # the refusal alone, as the README shows it
    assert "[rank0]" not in output
    assert sorted(p.name for p in checkpoints.iterdir()) == before
    # The refused run left no run in the runs list (soft-deleted, tagged with the refusal).
    from mlflow.entities import ViewType

    client = mlflow_client(project)
    experiment = client.get_experiment_by_name("meshtrain")
    active = client.search_runs([experiment.experiment_id], "tags.`meshtrain.refused` != ''")
    assert active == []
    deleted = client.search_runs(
        [experiment.experiment_id],
        "tags.`meshtrain.refused` = 'LayoutError'",
        run_view_type=ViewType.DELETED_ONLY,
    )
    assert [r.info.run_name for r in deleted] == ["planning"]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.slow
def test_three_d_run_is_tracked_and_equals_the_default_run(project: Path, default_run):
    """The 3-D example (`tensor_parallel_size=2,pipeline_parallel_size=2` on 4 processes)
    trains, consolidates and evaluates, MLflow shows the layout and the pipeline picture,
    and the weights equal those of the default dp=2 run. (tp=2, pp=2 and dp=2 alone are
    compared with each other by the sweep in tests/test_sweep.py.)"""
    # The default run's global batch, 8: 2 dp ranks of 4 there, one pipeline of 8 here.
    # The model is not logged to MLflow here (test_mlflow_run_holds_the_model_and_its_data).
    expected = _weights(project / "data/06_models/consolidated")
    three_d = kedro_run(
        project,
        "--from-nodes",
        "plan_layout",
        "--params",
        f"{SMALL_RUN},{ADAM_EPSILON},evaluation.log_model=false"
        + ",training.per_device_train_batch_size=8"
        + ",parallel.tensor_parallel_size=2,parallel.pipeline_parallel_size=2"
        + ",launch.nproc_per_node=4,consolidation.output_dir=data/06_models/tp2pp2",
    )
    assert three_d.returncode == 0, three_d.stdout[-3000:] + three_d.stderr[-5000:]
    metrics = json.loads((project / "data/08_reporting/metrics.json").read_text())
    assert metrics["layout"] == "dp1-tp2-pp2-sp-1f1b-mb4"
    assert metrics["val_perplexity"] < metrics["initial_val_perplexity"]

    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("meshtrain")
    (run,) = client.search_runs(
        [experiment.experiment_id], "tags.mlflow.runName = 'dp1-tp2-pp2-sp-1f1b-mb4'"
    )
    params = run.data.params
    assert (params["parallel.data_parallel_size"], params["parallel.tensor_parallel_size"]) == (
        "1",
        "2",
    )
    assert params["parallel.pipeline_parallel_size"] == "2"
    assert params["parallel.sequence_parallel"] == "True"
    assert params["parallel.pipeline_schedule"] == "1f1b"
    assert params["parallel.pipeline_parallel_num_microbatches"] == "4"
    assert "pipeline/bubble_fraction" in run.data.metrics
    assert "eval/val_perplexity" in run.data.metrics
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "pipeline_timeline.png" in artifacts
    got = _weights(project / "data/06_models/tp2pp2")
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        assert got[key].shape == want.shape
        assert (got[key] - want).norm() / want.norm() <= 1e-5, key


@pytest.mark.slow
def test_context_parallel_run_is_tracked_and_equals_the_default_run(project: Path, default_run):
    """`parallel.context_parallel_size=4` on 4 processes: every block's tokens split over the
    4 ranks, one pipeline of the whole global batch; MLflow names the layout `cp4`, and the
    consolidated weights equal those of the default dp=2 run."""
    expected = _weights(project / "data/06_models/consolidated")
    run = kedro_run(
        project,
        "--from-nodes",
        "plan_layout",
        "--params",
        f"{SMALL_RUN},{ADAM_EPSILON},evaluation.log_model=false"
        + ",training.per_device_train_batch_size=8,parallel.context_parallel_size=4"
        + ",launch.nproc_per_node=4,consolidation.output_dir=data/06_models/cp4",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    metrics = json.loads((project / "data/08_reporting/metrics.json").read_text())
    assert metrics["layout"] == "dp1-tp1-pp1-cp4"
    client = mlflow_client(project)
    experiment = client.get_experiment_by_name("meshtrain")
    (tracked,) = client.search_runs(
        [experiment.experiment_id], "tags.mlflow.runName = 'dp1-tp1-pp1-cp4'"
    )
    assert tracked.data.params["parallel.context_parallel_size"] == "4"
    assert tracked.data.params["parallel.data_parallel_size"] == "1"
    got = _weights(project / "data/06_models/cp4")
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        assert (got[key] - want).norm() / want.norm() <= 1e-5, key


@pytest.mark.slow
@pytest.mark.long
def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(
    project: Path, default_run, tmp_path: Path
):
    # Both runs are fully sharded (FSDP2 over the 2 ranks): the sharded checkpoint resumes
    # bitwise through `kedro run`, and consolidates into a plain Hugging Face model.
    longer = (
        SMALL_RUN.replace("training.max_steps=8", "training.max_steps=20").replace(
            "training.checkpoint_every=4", "training.checkpoint_every=5"
        )
        + ",training.keep_last=0,parallel.sharded_data_parallel_degree=2"
        + ",evaluation.log_model=false"
    )
    # The uninterrupted run goes beside the killed one and its resumption (a run is mostly
    # start-up on one core; the tests have two), in a project of its own with the same
    # tokenizer and blocks, so neither run reads the other's plan or summaries.
    other = make_project(tmp_path / "straight_project")
    blocks = "data/02_intermediate"
    shutil.copytree(project / blocks, other / blocks, dirs_exist_ok=True)
    straight_log = tmp_path / "straight.log"
    straight = _start_kedro(
        other,
        longer + ",training.run_name=straight,consolidation.output_dir=data/06_models/straight",
        straight_log,
    )
    killed_params = (
        longer + ",training.run_name=killed,consolidation.output_dir=data/06_models/killed"
    )
    process = _start_kedro(project, killed_params, tmp_path / "killed.log")
    run_dir = project / "data/06_models/checkpoints/killed"
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoint-5" / "COMPLETE").exists():
        assert process.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    workers = worker_processes(process.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    assert process.wait(timeout=300) != 0
    assert not (run_dir / "checkpoint-20").exists(), "the kill came too late to test anything"

    resumed = kedro_run(
        project,
        "--from-nodes",
        "plan_layout",
        "--params",
        killed_params + ",training.resume_from=latest",
    )
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert straight.wait(timeout=600) == 0, straight_log.read_text()[-5000:]
    assert_loads_and_matches_checkpoint(
        other,
        other / "data/06_models/straight",
        other / "data/06_models/checkpoints/straight/checkpoint-20",
    )
    expected = _weights(other / "data/06_models/straight")
    got = _weights(project / "data/06_models/killed")
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def _start_kedro(project: Path, params: str, log: Path):
    """`kedro run --from-nodes plan_layout --params <params>` in the background, its
    output (stdout and stderr) to `log`."""
    args = ["run", "--from-nodes", "plan_layout", "--params", params]
    return warm_kedro.start(args, project, project_env(), log, None)


# The fine-tune of the default run's model on the builtin instructions (conf/sft), small.
SFT_RUN = ",".join(
    [
        "data.builtin_max_chars=400000",
        "data.num_proc=1",
        "training.max_steps=12",
        "training.checkpoint_every=12",
        "training.eval_every=6",
        "training.eval_batches=2",
        "evaluation.max_batches=4",
        "evaluation.max_new_tokens=12",
        "evaluation.log_model=false",
    ]
)


@pytest.fixture(scope="module")
def sft_run(project: Path, default_run) -> tuple[subprocess.CompletedProcess, bytes]:
    """`kedro run --env sft` after the default run; the default model's bytes before it."""
    pretrained = project / "data/06_models/consolidated/model.safetensors"
    before = pretrained.read_bytes()
    result = kedro_run(project, "--env", "sft", "--params", SFT_RUN)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result, before


@pytest.mark.slow
def test_the_default_model_fine_tunes_on_the_builtin_instructions(project: Path, sft_run):
    """`kedro run --env sft`: the consolidated default model, with its own tokenizer and
    chat template, trained on the assistant turns only; its files beside the default
    run's, which stay as they were."""
    result, before = sft_run
    pretrained = project / "data/06_models/consolidated/model.safetensors"
    assert pretrained.read_bytes() == before
    metrics = json.loads((project / "data/08_reporting/sft_metrics.json").read_text())
    assert metrics["val_loss"] < metrics["initial_val_loss"]
    assert metrics["val_tokens"] > 0
    for sample in metrics["samples"]:
        assert sample["prompt"].endswith("<|im_start|>assistant\n"), sample
        assert sample["reference"].strip(), sample
        assert "response" in sample
    chat = project / "data/06_models/chat"
    assert (chat / "model.safetensors").exists() and (chat / "tokenizer_config.json").exists()
    plan = json.loads((project / "data/05_model_input/sft_plan.json").read_text())
    assert plan["model_config"]["model_type"] == "llama"
    output = result.stdout + result.stderr
    assert "efficiency" in output  # the packing report


DPO_RUN = ",".join(
    [
        "data.builtin_max_chars=200000",
        "data.num_proc=1",
        "training.max_steps=16",
        "training.checkpoint_every=16",
        "training.eval_every=8",
        "training.eval_batches=2",
        "evaluation.max_batches=4",
        "evaluation.max_new_tokens=12",
        "evaluation.log_model=false",
    ]
)


@pytest.mark.slow
def test_the_fine_tuned_model_learns_the_builtin_preferences(project: Path, sft_run):
    """`kedro run --env dpo` after `--env sft`, offline: pairs made from the builtin
    conversations, the SFT model as policy and frozen reference; the preference accuracy
    on the validation pairs rises from 0 (policy = reference) and MLflow holds TRL's
    rewards metrics per step."""
    chat = project / "data/06_models/chat/model.safetensors"
    before = chat.read_bytes()
    result = kedro_run(project, "--env", "dpo", "--params", DPO_RUN)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert chat.read_bytes() == before  # the reference stays as it was
    metrics = json.loads((project / "data/08_reporting/dpo_metrics.json").read_text())
    assert metrics["val_pairs"] > 0
    assert metrics["val_preference_accuracy"] > 0.5, metrics
    assert metrics["val_reward_margin"] > 0, metrics
    client = mlflow_client(project)
    experiment = client.get_experiment_by_name("meshtrain")
    (tracked,) = client.search_runs(
        [experiment.experiment_id], "params.`training.objective` = 'dpo'"
    )
    run_id = tracked.info.run_id
    for metric in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
        assert len(client.get_metric_history(run_id, metric)) == 16, metric
    accuracy = client.get_metric_history(run_id, "val_rewards/accuracies")
    assert [point.step for point in accuracy] == [0, 8, 16]
    assert accuracy[0].value == 0 and accuracy[-1].value > 0.5
    assert tracked.data.metrics["eval/val_preference_accuracy"] > 0.5
    assert (project / "data/06_models/dpo/model.safetensors").is_file()
    output = result.stdout + result.stderr
    assert "pairs in" in output and "preference accuracy" in output


LORA_RUN = ",".join(
    [
        SFT_RUN.replace("training.max_steps=12", "training.max_steps=8").replace(
            "training.checkpoint_every=12", "training.checkpoint_every=4"
        ),
        "model.lora.r=16",
        "model.lora.lora_alpha=32",
        "model.lora.target_modules=all-linear",
        "consolidation.output_dir=data/06_models/chat-lora",
        "consolidation.merge_lora=true",
        "consolidation.merged_output_dir=data/06_models/chat-lora-merged",
        "evaluation.log_model=true",
    ]
)


@pytest.mark.slow
def test_lora_fine_tunes_the_default_model_into_an_adapter_folder_and_a_merged_model(
    project: Path, default_run
):
    """`kedro run --env sft` with `model.lora`: only adapters train and are checkpointed;
    consolidation writes PEFT's adapter folder (which evaluation loads on its base) and
    the merged model, whose logits are the adapter's."""
    result = kedro_run(project, "--env", "sft", "--params", LORA_RUN)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    metrics = json.loads((project / "data/08_reporting/sft_metrics.json").read_text())
    assert metrics["layout"].endswith("-lora16")
    assert metrics["val_loss"] < metrics["initial_val_loss"]
    adapter = project / "data/06_models/chat-lora"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (16, 32)
    base = project / "data/06_models/consolidated"
    assert Path(config["base_model_name_or_path"]) == base.resolve()
    checkpoint = max((project / "data/06_models/sft_checkpoints").glob("*lora16*/checkpoint-8"))
    tensors = json.loads((checkpoint / "manifest.json").read_text())["tensors"]
    assert len(tensors) == 4 * 7 * 2 and all(".lora_" in name for name in tensors)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["lora"]["base"]["folder"] == str(base.resolve())
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 11, 8]])
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    merged = AutoModelForCausalLM.from_pretrained(project / "data/06_models/chat-lora-merged")
    with torch.no_grad():
        want, got = peft(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def small_qwen3(project: Path) -> Path:
    """A small Qwen3 (tied embeddings, as Qwen3 up to 4B ties them) with the default run's
    tokenizer and chat template beside it, as a pretrained folder brings its own."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: PLC0415

    tokenizer = project / "data/06_models/consolidated"
    vocab = json.loads((tokenizer / "config.json").read_text())["vocab_size"]
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    folder = project / "data/06_models/small-qwen3"
    Qwen3ForCausalLM(config).save_pretrained(folder)
    for path in [*tokenizer.glob("*token*"), tokenizer / "chat_template.jinja"]:
        shutil.copy2(path, folder / path.name)
    return folder


# conf/qwen3_lora as it is, but at tp 2 on this machine's CPU, on the small Qwen3, short.
QWEN3_HERE = [
    "launch.nproc_per_node=2",
    "launch.backend=auto",
    "parallel.tensor_parallel_size=2",
    "planner.device=cpu",
    "data.block_size=512",
    "training.max_steps=4",
    "training.checkpoint_every=4",
    "training.eval_every=4",
    "training.eval_batches=2",
    "training.log_every=1",
]


@pytest.mark.slow
def test_the_qwen3_lora_environment_runs_at_tp2_on_a_small_qwen3(project: Path, default_run):
    """`kedro run --env qwen3_lora` (optimum-neuron's Qwen3 example: LoRA r 64 on the
    embedding and every projection, dropout 0.05, packed chat blocks, bf16 with fp32
    masters, ZeRO-1, tp with SP) at tp 2 on a small Qwen3 folder: the embedding's adapter
    trains split on the vocabulary, the adapter folder loads with PEFT on its base and
    the merged model, untied, gives the same logits."""
    base = small_qwen3(project)
    params = [f"model.init_from={base}", *QWEN3_HERE, *SFT_RUN.split(",")[:2]]
    params += ["evaluation.max_batches=4", "evaluation.max_new_tokens=8"]
    result = kedro_run(project, "--env", "qwen3_lora", "--params", ",".join(params))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    plan = json.loads((project / "data/05_model_input/qwen3_lora_plan.json").read_text())
    assert plan["model_config"]["model_type"] == "qwen3"
    assert plan["layout"]["tensor_parallel_size"] == 2 and plan["layout"]["zero_1"] is False
    metrics = json.loads((project / "data/08_reporting/qwen3_lora_metrics.json").read_text())
    assert metrics["layout"].endswith("-lora64")
    adapter = project / "data/06_models/qwen3_lora"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (64, 128, 0.05)
    assert "embed_tokens" in config["target_modules"]
    saved = load_file(adapter / "adapter_model.safetensors")
    assert saved["base_model.model.model.embed_tokens.lora_embedding_A"].any()  # trained
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 11, 8]])
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    merged = AutoModelForCausalLM.from_pretrained(project / "data/06_models/qwen3_lora_merged")
    assert not merged.config.tie_word_embeddings
    with torch.no_grad():
        want, got = peft(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
