"""Pipeline parallelism, alone and composed with tensor and data parallelism,
reproduces one process (fp32, same data and seed), for every schedule; with tied
embeddings too (the first and the last stage each hold a copy; under the V-shaped
schedules, zbv and dualpipev, one rank holds both); the zero-bubble schedules with LoRA,
activation checkpointing, sharded data parallelism and in three dimensions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from meshtrain.pipeline_schedules import ZERO_BUBBLE
from tests.conftest import TINY_MODEL
from tests.distributed.lora import GQA, LORA, assert_matches_peft, peft_reference_run, save_base
from tests.distributed.packed import packed_reference_run
from tests.distributed.reference import (
    STEPS,
    References,
    assert_dry_run_holds,
    assert_matches_reference,
    assert_memory_model_holds,
    make_spec,
    run_group,
)

FOUR_LAYERS = {**TINY_MODEL, "num_hidden_layers": 4}
TIED = {**FOUR_LAYERS, "tie_word_embeddings": True}
BATCH_8 = {"per_device_train_batch_size": 8}


def _pp(size: int, schedule: str, microbatches: int, **extra) -> dict:
    return {
        "pipeline_parallel_size": size,
        "pipeline_schedule": schedule,
        "pipeline_parallel_num_microbatches": microbatches,
        **extra,
    }


# name: (parallel, training[, architecture, model fields]): llama, FOUR_LAYERS unless given
WORLD_2 = {
    "pp2-gpipe": (_pp(2, "gpipe", 2), BATCH_8),
    "pp2-1f1b": (_pp(2, "1f1b", 4), BATCH_8),
    "pp2-interleaved": (_pp(2, "interleaved_1f1b", 4), BATCH_8),
    "pp2-1f1b-accum2-checkpointing": (
        _pp(2, "1f1b", 2, activation_checkpointing="full"),
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    ),
    "tied-pp2-1f1b": (_pp(2, "1f1b", 4), BATCH_8, "llama", TIED),
    "tied-pp2-interleaved": (_pp(2, "interleaved_1f1b", 4), BATCH_8, "llama", TIED),
    # Qwen2: q/k/v biases.
    "qwen2-tied-pp2-1f1b": (_pp(2, "1f1b", 4), BATCH_8, "qwen2", TIED),
    # Zero-bubble: each backward split into its input and (later) its weight gradients.
    "pp2-interleaved-zb": (_pp(2, "interleaved_zb", 4), BATCH_8),
    "pp2-zbv": (_pp(2, "zbv", 4), BATCH_8),
    "pp2-dualpipev": (_pp(2, "dualpipev", 4), BATCH_8),
    "tied-pp2-zbv": (_pp(2, "zbv", 4), BATCH_8, "llama", TIED),
    "tied-pp2-dualpipev-accum2-checkpointing": (
        _pp(2, "dualpipev", 4, activation_checkpointing="full"),
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
        "llama",
        TIED,
    ),
}
# The zero-bubble schedules under sharded data parallelism (FSDP2 keeps each stage
# gathered through the step; torch reduce-scatters after the last weight gradient).
SDP2_PP2 = {"data_parallel_size": 2, "sharded_data_parallel_degree": 2}
BATCH_4 = {"per_device_train_batch_size": 4}
WORLD_4 = {
    "pp4-gpipe": (_pp(4, "gpipe", 4), BATCH_8),
    "pp4-1f1b": (_pp(4, "1f1b", 4), BATCH_8),
    "pp4-interleaved-v1": (
        _pp(4, "interleaved_1f1b", 4, pipeline_parallel_virtual_stages=1),
        BATCH_8,
    ),
    "pp2-tp2-sp": (_pp(2, "1f1b", 2, tensor_parallel_size=2), BATCH_8),
    "pp2-tp2-no-sp": (_pp(2, "1f1b", 2, tensor_parallel_size=2, sequence_parallel=False), BATCH_8),
    "tied-pp2-tp2-sp": (_pp(2, "1f1b", 2, tensor_parallel_size=2), BATCH_8, "llama", TIED),
    "tied-dp2-pp2-zero1": (
        _pp(2, "1f1b", 2, data_parallel_size=2, zero_1=True),
        {"per_device_train_batch_size": 4, "grad_bucket_mb": 0.01},
        "llama",
        TIED,
    ),
    "dp2-pp2-sdp2-interleaved-zb": (_pp(2, "interleaved_zb", 2, **SDP2_PP2), BATCH_4),
    "tied-dp2-pp2-sdp2-zbv": (_pp(2, "zbv", 2, **SDP2_PP2), BATCH_4, "llama", TIED),
    "dp2-pp2-sdp2-dualpipev": (_pp(2, "dualpipev", 4, **SDP2_PP2), BATCH_4),
}
WORLD_8 = {
    "dp2-pp2-tp2-zero1-sp": (
        _pp(2, "1f1b", 2, tensor_parallel_size=2, data_parallel_size=2, zero_1=True),
        {"per_device_train_batch_size": 4, "grad_bucket_mb": 0.01},
    ),
    # Sharded data parallelism (FSDP2) in all three dimensions, tied embeddings over the
    # stages, accumulation on top of the pipeline's microbatches.
    "tied-dp2-pp2-tp2-sdp2-sp-accum2": (
        _pp(
            2,
            "1f1b",
            2,
            tensor_parallel_size=2,
            data_parallel_size=2,
            sharded_data_parallel_degree=2,
        ),
        {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
        "llama",
        TIED,
    ),
    # The zero-bubble schedules in three dimensions.
    "tied-dp2-pp2-tp2-zero1-sp-zbv": (
        _pp(2, "zbv", 2, tensor_parallel_size=2, data_parallel_size=2, zero_1=True),
        {"per_device_train_batch_size": 4, "grad_bucket_mb": 0.01},
        "llama",
        TIED,
    ),
    "dp2-pp2-tp2-sp-interleaved-zb": (
        _pp(2, "interleaved_zb", 2, tensor_parallel_size=2, data_parallel_size=2),
        {"per_device_train_batch_size": 4},
    ),
    "dp2-pp2-tp2-sdp2-sp-dualpipev": (
        _pp(2, "dualpipev", 4, tensor_parallel_size=2, **SDP2_PP2),
        {"per_device_train_batch_size": 4},
    ),
}


CONTEXT_8 = {
    "dp4-sdp2-cp2": (
        {"data_parallel_size": 4, "sharded_data_parallel_degree": 2, "context_parallel_size": 2},
        {"per_device_train_batch_size": 2},
    ),
    "dp2-tp2-cp2-no-sp": (
        {
            "data_parallel_size": 2,
            "tensor_parallel_size": 2,
            "context_parallel_size": 2,
            "sequence_parallel": False,
        },
        {"per_device_train_batch_size": 4},
    ),
}


def _model(case: tuple) -> tuple[str, dict]:
    return (case[2], case[3]) if len(case) > 2 else ("llama", FOUR_LAYERS)


def _run(cases: dict, world: int, blocks, out: Path, extra: tuple = ()) -> list[dict]:
    """Run `cases` (and the `extra` specs after them) in one group; checks the cases and
    returns the extra specs' summaries."""
    specs = []
    for name, case in cases.items():
        architecture, fields = _model(case)
        specs.append(
            make_spec(
                blocks,
                out,
                name,
                world=world,
                parallel=case[0],
                training=case[1],
                architecture=architecture,
                fields=fields,
            )
        )
    results = run_group([*specs, *extra], world, out, f"t-pp{world}")
    references = References(blocks)
    for (name, case), spec, summary in zip(cases.items(), specs, results, strict=False):
        architecture, fields = _model(case)
        losses, weights = references(architecture, fields)
        assert_matches_reference(name, summary, losses, weights, out / f"{name}-hf")
        assert_memory_model_holds(name, summary)
        assert_dry_run_holds(name, spec, summary)
        if fields.get("tie_word_embeddings"):
            assert_one_tied_tensor(name, out / f"{name}-hf")
        splits_backward = case[0].get("pipeline_schedule") in ZERO_BUBBLE
        if case[0].get("data_parallel_size", 1) > 1 and "sdp" not in name and not splits_backward:
            # The schedule's last backward of each microbatch finishes the gradients: the
            # data-parallel reductions overlap the pipeline's backward (the tied copies'
            # bucket waits for their sum over the two stages).
            buckets = summary["gradient_buckets"]
            if fields.get("tie_word_embeddings"):
                assert 0 < buckets["started_in_backward"] < buckets["count"], buckets
            else:
                assert buckets["started_in_backward"] == buckets["count"] > 2, buckets
            # ZeRO-1's gather: after every update but the last (whose checkpoint waits for
            # it) each bucket waited for by the module of the stage that reads it.
            assert buckets["gather_rounds_in_forward"] == buckets["gather_rounds"] - 1, buckets
    return results[len(cases) :]


def assert_one_tied_tensor(name: str, consolidated: Path) -> None:
    """The consolidated folder ties its embeddings: one tensor, shared when loaded."""
    config = json.loads((consolidated / "config.json").read_text())
    assert config["tie_word_embeddings"] is True, name
    assert "lm_head.weight" not in load_file(consolidated / "model.safetensors"), name
    model = AutoModelForCausalLM.from_pretrained(consolidated)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), name


@pytest.mark.slow
def test_pipeline_on_two_ranks_matches_one_process(tiny_blocks, tmp_path: Path):
    # LoRA under a V-shaped zero-bubble schedule, against PEFT in one process.
    lora = make_spec(
        tiny_blocks,
        tmp_path,
        "lora-pp2-zbv",
        world=2,
        parallel=_pp(2, "zbv", 4),
        training=BATCH_8,
        architecture="llama",
        fields=GQA,
        model={"lora": LORA, "init_from": str(save_base(tmp_path / "base"))},
    )
    (lora_summary,) = _run(WORLD_2, 2, tiny_blocks, tmp_path, extra=(lora,))
    lora_losses, _, _ = peft_reference_run(tiny_blocks, GQA, LORA, STEPS)
    assert_matches_peft("lora-pp2-zbv", lora_summary, lora_losses)


@pytest.mark.slow
def test_pipeline_on_four_ranks_matches_one_process(tiny_blocks, tmp_path: Path):
    _run(WORLD_4, 4, tiny_blocks, tmp_path)


@pytest.mark.slow
@pytest.mark.long
def test_three_dimensional_layout_on_eight_ranks_matches_one_process(
    tiny_blocks, packed_blocks, tmp_path: Path
):
    # Packed fine-tuning blocks too: positions travel with the microbatches over both
    # stages, and the mean is over the global batch's trained tokens (tests/distributed/
    # test_packed_sft.py has the other layouts).
    name = "sft-dp2-pp2-tp2-zero1-sp"
    parallel, training = WORLD_8["dp2-pp2-tp2-zero1-sp"]
    sft = make_spec(
        packed_blocks,
        tmp_path,
        name,
        world=8,
        parallel=parallel,
        training=training,
        architecture="llama",
        fields=FOUR_LAYERS,
    )
    # LoRA adapters in all three dimensions, against PEFT in one process (tests/
    # distributed/test_lora.py has the other layouts).
    lora = make_spec(
        tiny_blocks,
        tmp_path,
        "lora-dp2-pp2-tp2-zero1-sp",
        world=8,
        parallel=parallel,
        training=training,
        architecture="llama",
        fields=GQA,
        model={"lora": LORA, "init_from": str(save_base(tmp_path / "base"))},
    )
    # Context parallelism's eight-rank compositions ride this group (a group's start-up
    # is most of a test's time): hybrid sharding (FSDP2 over dp_shard x cp, replicated
    # across dp_replicate) and tp without SP beside dp (tests/distributed/
    # test_context_parallel.py has the others).
    context = [
        make_spec(
            tiny_blocks,
            tmp_path,
            cp_name,
            world=8,
            parallel=cp_parallel,
            training=cp_training,
            architecture="llama",
            fields=FOUR_LAYERS,
        )
        for cp_name, (cp_parallel, cp_training) in CONTEXT_8.items()
    ]
    summary, lora_summary, *cp_summaries = _run(
        WORLD_8, 8, tiny_blocks, tmp_path, extra=(sft, lora, *context)
    )
    losses, weights = packed_reference_run(packed_blocks, FOUR_LAYERS)
    assert_matches_reference(name, summary, losses, weights, tmp_path / f"{name}-hf")
    lora_losses, _, _ = peft_reference_run(tiny_blocks, GQA, LORA, STEPS)
    assert_matches_peft("lora-dp2-pp2-tp2-zero1-sp", lora_summary, lora_losses)
    losses, weights = References(tiny_blocks)("llama", FOUR_LAYERS)
    for cp_name, cp_summary in zip(CONTEXT_8, cp_summaries, strict=True):
        assert_matches_reference(cp_name, cp_summary, losses, weights, tmp_path / f"{cp_name}-hf")
        assert_memory_model_holds(cp_name, cp_summary)
