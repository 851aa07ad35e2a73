"""Sharded data parallelism (FSDP2: ZeRO-3 and hybrid) reproduces one process (fp32).

Every case cuts the reference's global batch of 8 over its data-parallel
ranks and accumulation microbatches; clipping is active, so the global norm
over shards (and tp copies, and pp stages) is checked too. A 4-rank group
runs full and hybrid sharding, sharding composed with TP + SP and with PP
(tied embeddings over the stages), the model-state memory against ZeRO-1 and
plain dp, and resumes between sharded and unsharded layouts (and one case
validates on a split its ranks cannot share evenly); then a 2-rank
group runs dp2 cases, bf16 master weights, and a plain dp2 run resumed from
the sharded dp4 checkpoint. (dp2 x tp2 x pp2 sharded runs in the 8-rank group
of tests/distributed/test_pipeline_parallel.py.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file

from meshtrain.checkpoint import consolidate_checkpoint
from meshtrain.data.blocks import arrow_files
from tests.conftest import TINY_MODEL
from tests.distributed.reference import (
    STEPS,
    References,
    assert_matches_reference,
    make_spec,
    run_group,
)
from tests.distributed.test_mixed_precision import assert_tracks, losses_of

TIED = {**TINY_MODEL, "tie_word_embeddings": True}
SAVE_AT = 3
SDP = "sharded_data_parallel_degree"
DP4_SDP4 = {"data_parallel_size": 4, SDP: 4}
DP2_TP2_SDP2 = {"data_parallel_size": 2, "tensor_parallel_size": 2, SDP: 2}
TP4 = {"tensor_parallel_size": 4}
ACCUM2 = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
UNEVEN_VALIDATION = "dp4-sdp2-hybrid-accum2"

# name: (parallel, training, model fields, resumed from (a run of the same group) or None)
WORLD_4 = {
    "dp4-sdp4-accum2": (
        DP4_SDP4,
        {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2},
        TINY_MODEL,
        None,
    ),
    "dp4-sdp2-hybrid-accum2": (
        {"data_parallel_size": 4, SDP: 2},
        {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2, "eval_batches": 4},
        TINY_MODEL,
        None,
    ),
    "dp2-tp2-sdp2-sp-accum2": (DP2_TP2_SDP2, ACCUM2, TINY_MODEL, None),
    "dp2-tp2-sdp2-resumed": (DP2_TP2_SDP2, ACCUM2, TINY_MODEL, "dp2-tp2-sdp2-sp-accum2"),
    "tp4-from-dp2-tp2-sdp2": (
        TP4,
        {"per_device_train_batch_size": 8},
        TINY_MODEL,
        "dp2-tp2-sdp2-sp-accum2",
    ),
    "tp4": (TP4, {"per_device_train_batch_size": 8}, TINY_MODEL, None),
    "dp2-tp2-sdp2-from-tp4": (DP2_TP2_SDP2, ACCUM2, TINY_MODEL, "tp4"),
    "tied-dp2-pp2-sdp2-1f1b-accum2": (
        {
            "data_parallel_size": 2,
            "pipeline_parallel_size": 2,
            "pipeline_parallel_num_microbatches": 2,
            "pipeline_schedule": "1f1b",
            SDP: 2,
        },
        ACCUM2,
        TIED,
        None,
    ),
    # Model-state memory at dp4: the same model under ZeRO-1 and plain dp.
    "dp4-zero1": (
        {"data_parallel_size": 4, "zero_1": True},
        {"per_device_train_batch_size": 2},
        TINY_MODEL,
        None,
    ),
    "dp4-plain": (
        {"data_parallel_size": 4, "zero_1": False},
        {"per_device_train_batch_size": 2},
        TINY_MODEL,
        None,
    ),
}
WORLD_2 = {
    "dp2-sdp2": (
        {"data_parallel_size": 2, SDP: 2},
        {"per_device_train_batch_size": 4},
        TINY_MODEL,
        None,
    ),
    "dp2-sdp2-accum2-ac-full": (
        {"data_parallel_size": 2, SDP: 2, "activation_checkpointing": "full"},
        ACCUM2,
        TINY_MODEL,
        None,
    ),
    "dp2-sdp2-accum2-ac-selective-offload": (
        {
            "data_parallel_size": 2,
            SDP: 2,
            "activation_checkpointing": "selective",
            "activation_offloading": True,
        },
        ACCUM2,
        TINY_MODEL,
        None,
    ),
    # torch.compile'd decoder layers, wrapped by FSDP2 after compiling (torchtitan's order).
    "dp2-sdp2-compile": (
        {"data_parallel_size": 2, SDP: 2},
        {"per_device_train_batch_size": 4, "compile": True},
        TINY_MODEL,
        None,
    ),
    "dp2-from-dp4-sdp4": (
        {"data_parallel_size": 2, "zero_1": True},
        {"per_device_train_batch_size": 4},
        TINY_MODEL,
        "dp4-sdp4-accum2",
    ),
}
BF16_MASTER = {
    "dp2-sdp2-bf16-master": (
        {"data_parallel_size": 2, SDP: 2},
        {"per_device_train_batch_size": 4, "mixed_precision": "bf16_master"},
        TINY_MODEL,
        None,
    ),
}


def _uneven_validation(tiny_blocks, tmp_path: Path) -> list[str]:
    """30 validation blocks: at dp4 with batches of 1, three ranks score 8 batches and one
    6 (FSDP2's gathers are collective, so that rank must still run two more forwards)."""
    path = tmp_path / "uneven-validation"
    tiny_blocks["validation"].select(range(30)).save_to_disk(str(path))
    return arrow_files(datasets.load_from_disk(str(path)))


def _specs(tiny_blocks, tmp_path: Path, cases: dict, world: int) -> list:
    specs = []
    for name, (parallel, training, fields, resumed_from) in cases.items():
        made = make_spec(
            tiny_blocks,
            tmp_path,
            name,
            world=world,
            parallel=parallel,
            training={**training, "checkpoint_every": SAVE_AT, "keep_last": 0},
            architecture="llama",
            fields=fields,
        )
        if name == UNEVEN_VALIDATION:
            made = dataclasses.replace(
                made, validation_files=_uneven_validation(tiny_blocks, tmp_path)
            )
        if resumed_from is not None:
            checkpoint = tmp_path / resumed_from / f"checkpoint-{SAVE_AT}"
            made = dataclasses.replace(made, resume_from=str(checkpoint))
        specs.append(made)
    return specs


def _run(tiny_blocks, tmp_path: Path, cases: dict, world: int) -> dict[str, dict]:
    """Every case of `cases` in one spawned group of `world` ranks: name -> summary."""
    specs = _specs(tiny_blocks, tmp_path, cases, world)
    return dict(zip(cases, run_group(specs, world, tmp_path, f"t-sdp{world}"), strict=True))


def _assert_resumed_matches(name: str, summary: dict, references, fields, tmp_path: Path):
    """A resumed run's steps SAVE_AT+1.. and final weights equal one process's."""
    losses, weights = references("llama", fields)
    assert [step for step, _ in summary["losses"]] == list(range(SAVE_AT + 1, STEPS + 1))
    padded = {**summary, "losses": [(0, x) for x in losses[:SAVE_AT]] + summary["losses"]}
    assert_matches_reference(name, padded, losses, weights, tmp_path / f"{name}-hf")


@pytest.mark.slow
def test_sharded_data_parallel_matches_one_process_and_resumes_across_layouts(
    tiny_blocks, tmp_path: Path
):
    cases_2 = {**WORLD_2, **BF16_MASTER}
    results = {
        **_run(tiny_blocks, tmp_path, WORLD_4, 4),
        **_run(tiny_blocks, tmp_path, cases_2, 2),
    }
    references = References(tiny_blocks)

    for name, (parallel, _, fields, resumed_from) in {**WORLD_4, **WORLD_2}.items():
        summary = results[name]
        if SDP in parallel:
            degree = parallel[SDP]
            assert f"sdp{degree}" in summary["layout_name"], name
        if resumed_from is None:
            losses, weights = references("llama", fields)
            assert_matches_reference(name, summary, losses, weights, tmp_path / f"{name}-hf")
        else:
            _assert_resumed_matches(name, summary, references, fields, tmp_path)

    # Same layout: the resumed steps are bitwise the uninterrupted ones.
    straight, resumed = results["dp2-tp2-sdp2-sp-accum2"], results["dp2-tp2-sdp2-resumed"]
    assert resumed["losses"] == straight["losses"][SAVE_AT:]
    a = load_file(tmp_path / "dp2-tp2-sdp2-sp-accum2-hf" / "model.safetensors")
    b = load_file(tmp_path / "dp2-tp2-sdp2-resumed-hf" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)

    # Model states per rank at dp4 (fp32): parameters, gradients and AdamW moments,
    # 4 bytes per parameter sharded over 4 ranks, against ZeRO-1's 10 and plain dp's 16.
    sharded = results["dp4-sdp4-accum2"]["model_states_bytes_rank0"]
    assert sharded <= 0.42 * results["dp4-zero1"]["model_states_bytes_rank0"]
    assert sharded <= 0.27 * results["dp4-plain"]["model_states_bytes_rank0"]

    # bf16 compute on fp32 shards tracks the fp32 run; its checkpoint holds fp32 masters.
    losses, _ = references("llama", TINY_MODEL)
    master = results["dp2-sdp2-bf16-master"]
    assert_tracks("dp2-sdp2-bf16-master", losses_of(master), losses)
    consolidate_checkpoint(master["final_checkpoint"], tmp_path / "master-hf", progress=False)
    assert all(
        t.dtype == torch.float32
        for t in load_file(tmp_path / "master-hf" / "model.safetensors").values()
    )
