"""`model.init_from`: a Hugging Face folder of another shape than the runs' default, in
several safetensors files, started from on tp2 x pp2 (each rank reads only its slices)
and read back bit-identical; a folder whose weights disagree with its config is refused
before any worker starts, naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from meshtrain.checkpoint import consolidate_checkpoint
from meshtrain.config import RunConfig
from meshtrain.data.blocks import arrow_files
from meshtrain.launch.job import make_worker_spec
from meshtrain.models import build_model, build_model_config
from meshtrain.models.llama.pretrained import PretrainedError, check_pretrained
from meshtrain.planner import plan_run
from tests.conftest import TINY_BLOCK, TINY_VOCAB
from tests.distributed.reference import TRAINING, run_group

# Qwen2 (q/k/v biases), tied embeddings, one KV head (replicated for tp=2), hidden 96.
PRETRAINED = {
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A model saved by transformers itself, with weights no init would give."""
    folder = tmp_path_factory.mktemp("pretrained") / "qwen2"
    config = AutoConfig.for_model("qwen2", vocab_size=TINY_VOCAB, **PRETRAINED)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)  # biases and norms too
    model.save_pretrained(folder, max_shard_size="100KB")
    return folder


def _folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _config(folder: Path):
    return build_model_config("qwen2", {}, vocab_size=TINY_VOCAB, init_from=str(folder))


def test_the_folders_config_is_the_models_and_one_process_reads_it_exactly(pretrained):
    assert len(list(pretrained.glob("*.safetensors"))) > 2  # several files and an index
    config = build_model_config(
        "qwen2", {"hidden_size": 128}, vocab_size=TINY_VOCAB, init_from=str(pretrained)
    )
    assert config.hidden_size == 96  # model.config fields do not apply to a pretrained model
    model = build_model(config, seed=0, init_from=str(pretrained))
    original = _folder_tensors(pretrained)
    assert original.keys() == dict(model.named_parameters()).keys()
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.detach(), original[name]), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def _altered_copy(folder: Path, tmp_path: Path, name: str, tensor: torch.Tensor | None) -> Path:
    """A copy of the folder with tensor `name` replaced (or removed, for None)."""
    copy = tmp_path / "altered"
    shutil.copytree(folder, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    path = copy / index["weight_map"][name]
    tensors = load_file(path)
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, path, metadata={"format": "pt"})
    return copy


def test_weights_that_disagree_with_the_config_are_refused_naming_the_tensor(pretrained, tmp_path):
    name = "model.layers.2.mlp.up_proj.weight"
    wrong = _altered_copy(pretrained, tmp_path, name, torch.zeros(8, 96))
    with pytest.raises(PretrainedError, match=rf"{name} is \[8, 96\].*\[160, 96\]"):
        check_pretrained(wrong, _config(pretrained))


def test_a_missing_tensor_and_an_empty_folder_are_refused(pretrained, tmp_path):
    name = "model.layers.1.self_attn.k_proj.bias"
    missing = _altered_copy(pretrained, tmp_path, name, None)
    with pytest.raises(PretrainedError, match=rf"no tensor {name}"):
        check_pretrained(missing, _config(pretrained))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PretrainedError, match="neither model.safetensors"):
        check_pretrained(empty, _config(pretrained))


@pytest.mark.slow
def test_init_from_through_tp2_pp2_reads_back_bit_identical(pretrained, tiny_blocks, tmp_path):
    """One step at learning rate 0 changes nothing: every consolidated tensor is the
    folder's, bit for bit, after each rank read only its tp shard of its stages."""
    run = RunConfig.from_params(
        parallel={
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 2,
            "pipeline_parallel_num_microbatches": 2,
        },
        training={
            **TRAINING,
            "max_steps": 1,
            "learning_rate": 0.0,
            "output_dir": str(tmp_path),
            "run_name": "init-from",
        },
        launch={"nproc_per_node": 4},
        model={"architecture": "qwen2", "init_from": str(pretrained)},
        data={"block_size": TINY_BLOCK},
    )
    plan = plan_run(
        run,
        _config(pretrained),
        num_train_blocks=len(tiny_blocks["train"]),
        num_validation_blocks=len(tiny_blocks["validation"]),
        cuda_available=False,
    )
    spec = make_worker_spec(
        run,
        plan,
        train_files=arrow_files(tiny_blocks["train"]),
        validation_files=arrow_files(tiny_blocks["validation"]),
        tokenizer_dir=None,
    )
    (summary,) = run_group([spec], 4, tmp_path, "t-init-from")
    consolidate_checkpoint(summary["final_checkpoint"], tmp_path / "hf")
    written = load_file(tmp_path / "hf" / "model.safetensors")
    original = _folder_tensors(pretrained)
    assert written.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
