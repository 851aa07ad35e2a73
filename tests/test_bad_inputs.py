"""Bad input is refused early and clearly: a matrix of wrong parameters, one case each.

Each case is a `--params` string, parsed by Kedro's own `--params` callback and merged
into the shipped `conf/base` by the project's config loader, as `kedro run` does, and
goes to the project hook's checks (`pipelines.run_checks.check_parameters`, `meshtrain.preflight`),
which run before the first node: every group a node of the default pipeline reads,
consolidation and evaluation included, and the layout planned as far as it can be
before the data is read. Each must raise a deliberate refusal (`Refused`, which `kedro
run` prints without a traceback) that names the parameter, in at most 15 lines, and
leave a data/ folder that was there before untouched. A few cases run a real `kedro
run` in a scratch project (tests/test_refusals_e2e.py has one per class of mistake).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from kedro.config import OmegaConfigLoader
from kedro.framework.cli.utils import _split_params

from meshtrain import refusals, settings
from meshtrain.config import AUTO, RUN_GROUPS, Refused, RunConfig, check_launch
from meshtrain.pipeline_registry import register_pipelines
from meshtrain.pipelines.run_checks import check_parameters
from meshtrain.planner.resolve import plan_for_run
from tests.kedro_project import REPO, kedro_run, make_project

TRAIN_BLOCKS = 1000
VALIDATION_BLOCKS = 50
MAX_LINES = 15  # the message, a blank line and the MESHTRAIN_TRACEBACK hint included


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A scratch project whose data/ already holds what an earlier run wrote."""
    root = make_project(tmp_path_factory.mktemp("bad_inputs") / "project")
    (root / "data/01_raw/corpus.txt").write_text("an earlier run's corpus\n")
    (root / "data/05_model_input/plan.json").write_text('{"layout_name": "dp2-tp1-pp1"}\n')
    return root


@pytest.fixture(scope="module")
def tokenizer():
    import datasets

    from meshtrain.data.tokenizer import train_tokenizer

    corpus = datasets.Dataset.from_dict(
        {"text": [f"the quick brown fox {i} jumps over the lazy dog" for i in range(200)]}
    )
    return train_tokenizer(corpus, 300)


@pytest.fixture(scope="module")
def default_pipeline():
    return register_pipelines()["__default__"]


def parameters(project: Path, params: str) -> dict[str, Any]:
    """The parameters the nodes of `kedro run --params <params>` receive."""
    runtime = _split_params(None, None, params)  # the --params option's own callback
    args = dict(settings.CONFIG_LOADER_ARGS)
    loader = OmegaConfigLoader(str(project / "conf"), runtime_params=runtime, **args)
    return loader["parameters"]


def validate_and_plan(params: dict[str, Any], pipeline, tokenizer) -> None:
    """What a `kedro run` checks before a worker starts, in its order."""
    check_parameters(params, pipeline)  # the project hook, before the first node
    run = RunConfig.from_params(**{group: params.get(group) for group in RUN_GROUPS})
    plan_for_run(
        run,
        tokenizer,
        num_train_blocks=TRAIN_BLOCKS,
        num_validation_blocks=VALIDATION_BLOCKS,
    )
    check_launch(run.launch)  # the training node, before the launch


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def case(params: str, named: str | None = None, *, id: str, marks=()) -> Any:
    """`named` is what the message must name; by default the first parameter of `params`."""
    return pytest.param(params, named or params.split("=")[0], id=id, marks=marks)


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="nccl is fine with CUDA")

CASES = [
    # parallel.*: wrong kind, wrong value, wrong combination
    case("parallel.tensor_parallel_size=two", id="tp-not-a-number"),
    case("parallel.tensor_parallel_size=0", id="tp-zero"),
    case("parallel.tensor_parallel_size=3", id="tp-not-dividing-heads"),
    case("parallel.tensor_parallel_sise=2", "parallel.tensor_parallel_size", id="tp-typo"),
    case("parallel.data_parallel_size=4", id="dp-times-tp-pp-not-the-world"),
    case("parallel.pipeline_parallel_size=8", id="pp-more-stages-than-layers"),
    case(
        "parallel.pipeline_parallel_size=2,parallel.pipeline_parallel_num_microbatches=3",
        "parallel.pipeline_parallel_num_microbatches",
        id="microbatches-not-dividing-the-batch",
    ),
    case("parallel.pipeline_schedule=zigzag", id="unknown-schedule"),
    case("parallel.pipeline_parallel_virtual_stages=0", id="virtual-stages-zero"),
    case("parallel.pipeline_parallel_layers=3:5", id="layers-colon-is-a-yaml-number"),
    case(
        "parallel.pipeline_parallel_size=2,parallel.pipeline_parallel_layers=3 5",
        "parallel.pipeline_parallel_layers",
        id="layers-not-summing-to-the-model",
    ),
    case(
        "parallel.pipeline_parallel_size=1,parallel.pipeline_parallel_layers=2 2",
        "parallel.pipeline_parallel_layers",
        id="layers-pinned-without-a-pipeline",
    ),
    case(
        "parallel.sequence_parallel=true,parallel.tensor_parallel_size=1",
        "parallel.tensor_parallel_size",
        id="sp-at-tp1",
    ),
    case("parallel.sequence_parallel=sometimes", id="sp-not-a-bool"),
    case("parallel.zero_1=2", id="zero1-not-a-bool"),
    case("parallel.activation_checkpointing=everything", id="unknown-checkpointing"),
    case(
        "parallel.tensor_parallel_size=2,data.block_size=127",
        "data.block_size",
        id="sp-block-not-splitting-over-tp",
    ),
    # training.*
    case("training.learning_rate=-1", id="negative-learning-rate"),
    case("training.learning_rate=fast", id="learning-rate-not-a-number"),
    case("training.max_grad_norm=-1", id="negative-grad-norm"),
    case("training.keep_last=-1", id="negative-keep-last"),
    case("training.per_device_train_batch_size=0", id="batch-zero"),
    case(
        "training.per_device_train_batch_size=100000",
        "training.per_device_train_batch_size",
        id="batch-larger-than-the-corpus",
    ),
    case("training.gradient_accumulation_steps=0", id="accumulation-zero"),
    case(
        "training.global_batch_size=3,parallel.tensor_parallel_size=1,"
        "parallel.pipeline_parallel_size=1",
        "training.global_batch_size",
        id="global-batch-not-splitting-over-dp",
    ),
    case("training.mixed_precision=fp16", id="unknown-precision"),
    case("training.adam_beta2=1.5", id="beta-above-one"),
    case("training.adam_epsilon=0", id="epsilon-zero"),
    case("training.warmup_steps=-1", id="negative-warmup"),
    case("training.weight_decay=-0.1", id="negative-weight-decay"),
    case("training.min_learning_rate_ratio=2", id="lr-floor-above-the-rate"),
    case("training.run_name=../escaped", id="run-name-escaping-the-output-dir"),
    case("training.grad_bucket_mb=0", id="bucket-zero"),
    case("training.max_steps=0", id="no-steps"),
    case("training.checkpoint_every=0", id="checkpoint-every-zero"),
    case("training.eval_batches=-1", id="negative-eval-batches"),
    case("training.loss_chunk_tokens=-8", id="negative-loss-chunk"),
    case("training.loss_chunk_tokens=some", id="loss-chunk-not-a-number"),
    case("training.maxsteps=10", "training.max_steps", id="training-typo"),
    # launch.*
    case("launch.nproc_per_node=0", id="no-processes"),
    case("launch.nproc_per_node=many", id="nproc-not-a-number"),
    case("launch.nnodes=2", "launch.rdzv_endpoint", id="nodes-without-rendezvous"),
    case("launch.node_rank=3", id="node-rank-outside-the-nodes"),
    case("launch.backend=mpi", id="unknown-backend"),
    case("launch.backend=nccl", id="nccl-without-cuda", marks=NO_CUDA),
    case("launch.rdzv_endpoint=node001:99999", id="port-out-of-range"),
    case(
        "launch.nnodes=2,launch.nproc_per_node=1,launch.rdzv_endpoint=10.1.2.3:29500,"
        "launch.network_interface=nope0",
        "launch.network_interface",
        id="network-interface-not-on-this-host",
    ),
    case("launch.max_restarts=-1", id="negative-restarts"),
    case("launch.monitor_interval=0", id="monitor-interval-zero"),
    case("launch.shutdown_grace_s=0", id="shutdown-grace-zero"),
    case("launch.collective_timeout_s=-1", id="negative-collective-timeout"),
    case("training.mixed_precision=fp16", id="unknown-precision"),
    case("training.grad_reduce_dtype=bf16", id="bf16-reduction-without-bf16-parameters"),
    # model.*
    case("model.architecture=gpt2", id="unsupported-architecture"),
    case("model.config.hiden_size=256", "model.config.hidden_size", id="model-field-typo"),
    case("model.config.hidden_size=abc", id="model-field-wrong-kind"),
    case("model.config.num_attention_heads=0", id="zero-heads"),
    case("model.config.hidden_size=130", id="hidden-not-dividing-heads"),
    case("model.config.hidden_act=swishy", id="unknown-activation"),
    case("model.config.vocab_size=99", id="vocab-the-tokenizer-overrides"),
    case("model.config.rms_norm_eps=0", id="norm-eps-zero"),
    case("model.config=5", id="model-config-not-a-mapping"),
    case(
        "model.config.max_position_embeddings=64",
        "data.block_size",
        id="blocks-longer-than-positions",
    ),
    case("model.init_from=/nonexistent/folder", id="init-from-missing"),
    # data.*
    case("data.source=web", id="unknown-source"),
    case("data.source=text_files", "data.text_files", id="text-files-without-files"),
    case("data.source=hub", "data.hub_dataset", id="hub-without-dataset"),
    case("data.block_size=1", id="block-of-one-token"),
    case("data.block_size=1024", id="block-longer-than-the-model"),
    case("data.validation_fraction=0", id="no-validation"),
    case("data.validation_fraction=1.5", id="validation-above-one"),
    case("data.vocab_size=100", id="vocab-below-the-byte-alphabet"),
    case("data.num_proc=0", id="no-tokenizer-processes"),
    case("data.builtin_max_chars=-5", id="negative-corpus-size"),
    case("data.vocab_sise=100", "data.vocab_size", id="data-typo"),
    # data.*: a value the data's format (known before it is read) makes meaningless
    case("data.loss_on=assistant", id="loss-on-assistant-on-plain-text"),
    case("data.loss_on=completion", id="loss-on-completion-on-plain-text"),
    case(
        "data.source=builtin_instructions,data.loss_on=completion",
        "data.loss_on",
        id="loss-on-completion-on-conversations",
    ),
    case("data.format=conversational", id="conversational-format-on-plain-text"),
    case(
        "data.source=builtin_instructions,data.format=prompt_completion",
        "data.format",
        id="prompt-completion-format-on-conversations",
    ),
    case("data.truncation=truncate", id="truncation-on-a-stream"),
    case("data.columns.messages=conversations", "data.columns", id="columns-of-plain-text"),
    # model.lora.*
    case("model.lora.r=0,model.lora.allow_random_base=true", id="lora-rank-zero"),
    case("model.lora.lora_dropout=1,model.lora.allow_random_base=true", id="lora-dropout-one"),
    case(
        "model.lora.target_modules=qproj,model.lora.allow_random_base=true",
        "model.lora.target_modules",
        id="lora-target-typo",
    ),
    case("model.lora.r=8", "model.init_from", id="lora-on-a-random-model"),
    case("model.lora.use_dora=true", id="lora-peft-feature-not-implemented"),
    case("consolidation.merge_lora=true", id="merge-lora-without-lora"),
    # consolidation.* and evaluation.*: read after training, refused before it
    case("consolidation.dtype=int8", id="consolidation-dtype-unknown"),
    case("consolidation.max_shard_size=big", id="shard-size-not-a-size"),
    case("consolidation.checkpoint=/nonexistent/checkpoint-8", id="checkpoint-missing"),
    case("consolidation.output_dir=data/01_raw/corpus.txt", id="output-dir-a-file"),
    case("evaluation.lm_eval_tasks=meshtrain_python_basic", id="lm-eval-task-typo"),
    case("evaluation.lm_eval_tasks=hellaswag", id="lm-eval-task-not-cached-offline"),
    case("evaluation.lm_eval_include_path=/nonexistent/tasks", id="lm-eval-include-missing"),
    case("evaluation.device=cuda:7", id="eval-device-not-here", marks=NO_CUDA),
    case("evaluation.dtype=int4", id="eval-dtype-unknown"),
    case("evaluation.batch_size=0", id="eval-batch-zero"),
    # files and names data.* and model.* point at
    case("data.tokenizer=/nonexistent/tok", id="tokenizer-folder-missing"),
    case("data.tokenizer=not a hub id!", id="tokenizer-not-a-hub-id"),
    case("data.tokenizer=conf", id="tokenizer-folder-without-one"),
    case(
        "data.source=text_files,data.text_files=/nonexistent/*.txt",
        "data.text_files",
        id="text-files-matching-nothing",
    ),
    case("data.chat_template=/nonexistent/chatml.jinja", id="chat-template-missing"),
    case("model.init_from=conf", id="init-from-without-config-json"),
    case("model.config.num_key_value_heads=3", id="kv-heads-not-dividing-heads"),
    case("model.config.rope_theta=-1", id="negative-rope-theta"),
    case("training.resume_from=/nonexistent/checkpoint-4", id="resume-from-missing"),
    case("parallel.context_parallel_size=0", id="cp-zero"),
    case("parallel.context_parallel_size=3", id="cp-not-dividing-the-world"),
    case(
        "parallel.context_parallel_size=2,parallel.data_parallel_size=2",
        "parallel.data_parallel_size",
        id="dp-times-cp-not-the-world",
    ),
    case(
        "parallel.context_parallel_size=2,data.block_size=126",
        "data.block_size",
        id="block-not-splitting-into-cp-chunks",
    ),
    # planner.*
    case("planner.memory_margin=1.5", id="margin-above-one"),
    case("planner.device=tpu", id="unknown-device"),
    case("planner.moe_imbalance=0.8", id="moe-imbalance-below-one"),
]


@pytest.mark.parametrize(("params", "named"), CASES)
def test_a_bad_input_is_refused_naming_it(
    params: str, named: str, project: Path, tokenizer, default_pipeline, monkeypatch
) -> None:
    monkeypatch.chdir(project)  # anything written relative to the project would land here
    before = snapshot(project / "data")
    with pytest.raises(Refused) as refused:  # by the project hook, before the first node
        check_parameters(parameters(project, params), default_pipeline)
    message = str(refused.value)
    assert named in message, message
    printed = f"{type(refused.value).__name__}: {message}\n\n(hint)"  # as hooks prints it
    assert len(printed.splitlines()) <= MAX_LINES, message
    assert "Traceback" not in message
    assert snapshot(project / "data") == before


def test_the_matrix_covers_every_group_with_enough_cases() -> None:
    groups = {param.values[0].split(".")[0] for param in CASES}
    assert groups >= {*RUN_GROUPS, "consolidation", "evaluation"}
    assert len(CASES) >= 100


@pytest.mark.parametrize(
    "layers",
    ["3 1", "[3 1]", "3,1"],
    ids=["spaces", "brackets", "one-list-in-yaml"],
)
def test_pipeline_layers_pass_through_params(
    layers: str, project: Path, tokenizer, default_pipeline
) -> None:
    """`parallel.pipeline_parallel_layers=[3,5]` cannot be passed with --params (Kedro splits
    on the comma); the numbers separated by spaces can, with or without brackets."""
    if layers == "3,1":  # as in a YAML file: the --params string would split
        params = parameters(project, "parallel.pipeline_parallel_size=2")
        params["parallel"]["pipeline_parallel_layers"] = [3, 1]
    else:
        params = parameters(
            project, f"parallel.pipeline_parallel_size=2,parallel.pipeline_parallel_layers={layers}"
        )
    check_parameters(params, default_pipeline)
    run = RunConfig.from_params(**{group: params.get(group) for group in RUN_GROUPS})
    plan = plan_for_run(
        run, tokenizer, num_train_blocks=TRAIN_BLOCKS, num_validation_blocks=VALIDATION_BLOCKS
    )
    assert plan.layout.pipeline_parallel_size == 2
    assert plan.layout.pipeline_parallel_layers == [3, 1]


def test_sequence_parallel_at_tp_auto_picks_a_tp_that_allows_it(
    project: Path, tokenizer, default_pipeline
) -> None:
    params = parameters(project, "parallel.sequence_parallel=true")
    assert params["parallel"]["tensor_parallel_size"] == AUTO
    run = RunConfig.from_params(**{group: params.get(group) for group in RUN_GROUPS})
    plan = plan_for_run(
        run, tokenizer, num_train_blocks=TRAIN_BLOCKS, num_validation_blocks=VALIDATION_BLOCKS
    )
    assert plan.layout.sequence_parallel and plan.layout.tensor_parallel_size == 2


def test_keep_last_zero_keeps_every_checkpoint_and_is_accepted(project: Path) -> None:
    params = parameters(project, "training.keep_last=0")
    assert RunConfig.from_params(**{g: params.get(g) for g in RUN_GROUPS}).training.keep_last == 0


def test_model_config_with_init_from_is_noted_not_checked(project: Path, default_pipeline) -> None:
    """With model.init_from the folder's config.json is the model's: model.config (always
    set in conf/base) is not applied, so its names are not held against the run."""
    params = parameters(project, "model.init_from=some/model,model.config.hiden_size=256")
    check_parameters(params, default_pipeline)


@pytest.mark.parametrize("env", ["base", "gpu", "trn1"])
def test_the_shipped_model_configs_pass_the_field_check(env: str) -> None:
    """conf/gpu's rope_theta (folded into rope_parameters in transformers 5) and conf/trn1's
    head_dim are real fields, though to_dict() alone would not list the first."""
    from meshtrain.models.builder import check_model_fields

    args = {**settings.CONFIG_LOADER_ARGS, "default_run_env": env}
    model = OmegaConfigLoader(str(REPO / "conf"), **args)["parameters"]["model"]
    check_model_fields(model["architecture"], model["config"])


@pytest.mark.parametrize(
    "architecture", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"]
)
def test_head_dim_and_rope_theta_are_fields_of_every_architecture(architecture: str) -> None:
    from meshtrain.models.builder import known_config_fields

    assert {"head_dim", "rope_theta", "hidden_size"} <= known_config_fields(architecture)


# --- end to end: a real `kedro run` ------------------------------------------------------


@pytest.fixture
def fresh_project(tmp_path: Path) -> Path:
    root = make_project(tmp_path / "project")
    (root / "data/01_raw/notes.txt").write_text("written before the run\n")
    return root


def _refused_cleanly(result, *expected: str) -> str:
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-2000:]
    assert "Traceback" not in output, output[-4000:]
    for text in expected:
        assert text in output, output[-2000:]
    return output


def test_planning_on_a_fresh_clone_names_the_missing_tokenizer(fresh_project: Path) -> None:
    result = kedro_run(fresh_project, "--pipeline", "planning", timeout=300)
    _refused_cleanly(
        result,
        "MissingInputError",
        "the tokenizer at data/02_intermediate/tokenizer does not exist yet",
        "kedro run --pipeline data_processing",
    )
    assert "Repo id must be" not in result.stdout + result.stderr


def test_the_readmes_refusal_example_is_what_a_user_sees(
    project, default_pipeline, tokenizer, monkeypatch, capsys
):
    """The README's `kedro run --params "parallel.tensor_parallel_size=3"` block, less
    Kedro's log lines above it, byte for byte as the project's exception hook prints it."""
    readme = (REPO / "README.md").read_text()
    command = '$ kedro run --params "parallel.tensor_parallel_size=3"\n'
    shown = readme.split(command, 1)[1].split("```", 1)[0]
    with pytest.raises(Refused) as caught:
        validate_and_plan(
            parameters(project, "parallel.tensor_parallel_size=3"), default_pipeline, tokenizer
        )
    monkeypatch.setattr(sys, "excepthook", lambda *_: None)
    monkeypatch.delenv(refusals.TRACEBACK_VARIABLE, raising=False)
    refusals.show_refusals_plainly()
    sys.excepthook(type(caught.value), caught.value, None)
    assert capsys.readouterr().err == shown


def test_a_pipeline_is_not_refused_for_a_group_it_does_not_read(project: Path, monkeypatch):
    monkeypatch.chdir(project)
    params = parameters(project, "data.vocab_size=100,training.max_steps=0,parallel.zero_1=2")
    consolidation = register_pipelines()["consolidation"]
    assert check_parameters(params, consolidation) == []
    with pytest.raises(Refused, match="data.vocab_size"):
        check_parameters(params, register_pipelines()["data_processing"])
