"""LoRA's parts that need no process group: which layers it adapts, PEFT's arithmetic and
initialisation, the refusals, the base's identity, and what the planner makes of it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from meshtrain.checkpoint.lora_base import base_identity, check_same_base
from meshtrain.checkpoint.manifest import CheckpointError
from meshtrain.config import ConfigError, LoraSettings, RunConfig
from meshtrain.models import build_model, build_model_config
from meshtrain.models.builder import build_meta_model
from meshtrain.models.lora import AdapterInit, LoraConverter, check_pretrained_base, target_names
from meshtrain.models.shapes import lora_adapter_shapes
from meshtrain.planner import plan_run
from tests.conftest import TINY_MODEL, TINY_VOCAB


@pytest.fixture(scope="module")
def config():
    return build_model_config("llama", TINY_MODEL, vocab_size=TINY_VOCAB)


def _targets(config, **settings) -> set[str]:
    names = target_names(build_meta_model(config), LoraSettings(**settings))
    return {name.rsplit(".", 1)[-1] for name in names}


def test_targets_follow_peft(config):
    assert _targets(config) == {"q_proj", "v_proj"}  # PEFT's default for the Llama family
    every = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert _targets(config, target_modules="all-linear") == every  # not lm_head
    assert _targets(config, target_modules=["o_proj", "mlp.down_proj"]) == {"o_proj", "down_proj"}
    assert _targets(config, target_modules=r".*\.layers\.1\..*_proj") == every
    with pytest.raises(ConfigError, match="'qproj'.*Closest: q_proj"):
        _targets(config, target_modules=["qproj"])
    # The vocabulary layers when named, as PEFT adapts them (an embedding is no Linear).
    vocabulary = ["q_proj", "embed_tokens", "lm_head"]
    assert _targets(config, target_modules=vocabulary) == set(vocabulary)
    assert _targets(config, target_modules=r"model\.embed_tokens|lm_head") == set(vocabulary[1:])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"r": 0}, "model.lora.r"),
        ({"lora_alpha": 0}, "model.lora.lora_alpha"),
        ({"lora_dropout": 1.0}, "model.lora.lora_dropout"),
        ({"lora_dropout": -0.1}, "model.lora.lora_dropout"),
        ({"target_modules": []}, "model.lora.target_modules"),
        ({"lora_aplha": 8}, "did you mean `model.lora.lora_alpha`"),
        ({"use_dora": True}, "PEFT's `use_dora`"),
        ({"bias": "all"}, "model.lora.bias"),
        ({"modules_to_save": []}, "model.lora.modules_to_save"),
        ({"ensure_weight_tying": True}, "AdamW steps twice"),
    ],
)
def test_bad_settings_are_refused_naming_the_parameter(values, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        RunConfig.from_params(model={"lora": values})


def test_modules_to_save_are_the_named_modules_parameters_and_refused_where_they_cannot_be(
    config,
):
    def saved(model_config, **settings) -> dict:
        return lora_adapter_shapes(model_config, LoraSettings(r=4, **settings))

    trained = saved(config, target_modules=["q_proj"], modules_to_save=["lm_head", "norm"])
    assert {n for n in trained if ".lora_" not in n} == {"lm_head.weight", "model.norm.weight"}
    with pytest.raises(ConfigError, match="'lm_haed'.*Closest: lm_head"):
        saved(config, modules_to_save=["lm_haed"])
    with pytest.raises(ConfigError, match="target_modules adapts too"):
        saved(config, target_modules=["q_proj", "lm_head"], modules_to_save=["lm_head"])
    tied = build_model_config(
        "llama", {**TINY_MODEL, "tie_word_embeddings": True}, vocab_size=TINY_VOCAB
    )
    with pytest.raises(ConfigError, match="ties its embedding and LM head"):
        saved(tied, modules_to_save=["embed_tokens"])


def test_lora_on_a_random_base_is_refused_unless_forced():
    with pytest.raises(ConfigError, match="model.init_from"):
        check_pretrained_base(LoraSettings(), None)
    check_pretrained_base(LoraSettings(allow_random_base=True), None)
    check_pretrained_base(LoraSettings(), "some/folder")


@pytest.mark.parametrize("targets", ["all-linear", ["embed_tokens", "q_proj", "lm_head"]])
def test_a_lora_layer_computes_as_peft_and_starts_as_the_base(config, targets):
    """The converter's layers, filled with the adapters' initial values, against PEFT's
    model holding the same values: equal logits, equal to the base's at the start (B is
    zero; an embedding's A), and equal again once it is not."""
    settings = LoraSettings(r=4, lora_alpha=8, target_modules=targets, use_rslora=True)
    ours = build_model(config, seed=3)
    base = build_model(config, seed=3)
    converter = LoraConverter(settings, seed=3)
    converter.convert(ours)
    initial = AdapterInit(base=None, shapes=converter.shapes, seed=3)
    peft = get_peft_model(
        build_model(config, seed=3),
        LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_rslora=True),
    )
    with torch.no_grad():
        for name, parameter in ours.named_parameters():
            if parameter.requires_grad:
                value = initial.full(name)
                if not value.any():
                    value = torch.randn(value.shape) * 0.1  # as after some training
                parameter.copy_(value)
                peft_name = "base_model.model." + name.replace(".weight", ".default.weight")
                if name.endswith(("lora_embedding_A", "lora_embedding_B")):
                    peft_name += ".default"
                peft.get_parameter(peft_name).copy_(value)
    ids = torch.arange(16).reshape(2, 8)
    assert torch.allclose(ours(input_ids=ids).logits, peft(input_ids=ids).logits, atol=1e-6)
    assert not torch.allclose(ours(input_ids=ids).logits, base(input_ids=ids).logits)
    trained = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)


def test_adapters_start_as_peft_draws_them_and_alike_on_every_call(config):
    converter = LoraConverter(LoraSettings(r=8), seed=1)
    converter.convert(build_meta_model(config))
    init = AdapterInit(base=None, shapes=converter.shapes, seed=1)
    name = "model.layers.0.self_attn.q_proj.lora_A.weight"
    a = init.full(name)
    bound = 1 / math.sqrt(TINY_MODEL["hidden_size"])  # kaiming_uniform(a=sqrt(5))
    assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound
    assert torch.equal(a, init.full(name))
    assert not torch.equal(a, init.full(name.replace("layers.0", "layers.1")))
    assert not init.full(name.replace("lora_A", "lora_B")).any()
    # An embedding's: A zeros, B standard normal (PEFT's `reset_lora_parameters`).
    embedding = LoraConverter(LoraSettings(r=8, target_modules=["embed_tokens"]), seed=1)
    embedding.convert(build_meta_model(config))
    init = AdapterInit(base=None, shapes=embedding.shapes, seed=1)
    assert not init.full("model.embed_tokens.lora_embedding_A").any()
    b = init.full("model.embed_tokens.lora_embedding_B")
    assert b.shape == (TINY_MODEL["hidden_size"], 8) and 0.8 < b.std() < 1.2


def test_the_base_identity_names_what_changed(tmp_path: Path, config):
    folder = tmp_path / "base"
    build_model(config, seed=0).save_pretrained(folder)
    saved = base_identity(str(folder), config.to_dict(), seed=0)
    assert saved == base_identity(str(folder), config.to_dict(), seed=9)
    check_same_base(saved, saved, "resume")
    build_model(config, seed=1).save_pretrained(folder)  # other weights, same place
    with pytest.raises(CheckpointError, match="weights_sha256"):
        check_same_base(saved, base_identity(str(folder), config.to_dict(), 0), "resume")
    random = base_identity(None, config.to_dict(), seed=0)
    with pytest.raises(CheckpointError, match="random_init_seed"):
        check_same_base(random, base_identity(None, config.to_dict(), seed=1), "resume")


def _plan(config, lora, **parallel):
    run = RunConfig.from_params(
        parallel=parallel,
        launch={"nproc_per_node": 8},
        model={"lora": lora, "init_from": "base"},
        data={"block_size": 4096},
        training={"per_device_train_batch_size": 1, "mixed_precision": "bf16"},
        planner={"device": "h100"},
    )
    return plan_run(run, config, num_train_blocks=10_000, num_validation_blocks=8)


def test_the_planner_fits_lora_where_full_fine_tuning_needs_model_parallelism():
    """Llama-3.1-8B on 8 H100s: full fine-tuning does not fit plain dp (its model states
    alone are 16 bytes a parameter); LoRA's frozen base in bf16 does, at a fraction of the
    model states, and its step skips the base's weight gradients."""
    config = _config_8b()
    lora = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    plain = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "sharded_data_parallel_degree": 1,
        "zero_1": False,
    }
    adapted = _plan(config, lora, **plain)
    assert adapted.layout.name.endswith("-lora16")
    memory = adapted.memory_estimate_per_rank
    assert memory["gradients"] < 0.02 * memory["parameters"]  # fp32 adapters, bf16 base
    with pytest.raises(Exception, match="estimated peak"):
        _plan(config, None, **plain)
    full = _plan(config, None, tensor_parallel_size=8, pipeline_parallel_size=1)
    states = lambda m: m["parameters"] + m["gradients"] + m["optimizer_states"]  # noqa: E731
    full_states = states(full.memory_estimate_per_rank) * 8  # tp 8 splits them
    assert states(memory) < 0.3 * full_states
    assert adapted.num_trainable_parameters < 0.01 * adapted.num_parameters


def _config_8b():
    import json  # noqa: PLC0415

    fields = json.loads(Path("examples/model_configs/llama-3.1-8b.json").read_text())
    fields.pop("architectures", None)
    fields.pop("model_type", None)
    vocab = fields.pop("vocab_size")
    return build_model_config("llama", fields, vocab_size=vocab)


def test_only_the_adapters_need_gradients_under_the_converter(config):
    model = build_meta_model(config)
    LoraConverter(LoraSettings(target_modules=["q_proj"]), seed=0).convert(model)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert "model.embed_tokens.weight" in frozen and "lm_head.weight" in frozen
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
