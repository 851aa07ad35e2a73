"""Resuming: bitwise exact on the same layout, and equal to one process on another layout
(tp 2 -> 1, dp 2 -> 4 with ZeRO-1 re-partitioned, pp 2 -> 1; with tied embeddings
pp 2 -> 1 and pp 1 -> 2; between the V-shaped zbv schedule, whose rank 0 holds both tied
copies, and 1F1B, both ways), all in one 4-rank group. The checkpoints resumed from are
written in the background (`training.checkpoint_async`, the default); a synchronous save
of the same step writes the same bytes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshtrain.checkpoint import consolidate_checkpoint
from meshtrain.checkpoint.manifest import read_manifest
from tests.conftest import TINY_MODEL
from tests.distributed.reference import (
    STEPS,
    assert_matches_reference,
    make_spec,
    reference_run,
    run_group,
)

FOUR_LAYERS = {**TINY_MODEL, "num_hidden_layers": 4}
TIED = {**FOUR_LAYERS, "tie_word_embeddings": True}
SAVE_AT = 3
DP2_TP2 = {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_1": True}
DP2_PP2 = {
    "data_parallel_size": 2,
    "pipeline_parallel_size": 2,
    "pipeline_parallel_num_microbatches": 2,
    "zero_1": True,
}
DP2_PP2_ZBV = {**DP2_PP2, "pipeline_schedule": "zbv"}
DP4 = {"data_parallel_size": 4, "zero_1": True}
BATCH = {"per_device_train_batch_size": 4}  # x dp2 = 8
BATCH_DP4 = {"per_device_train_batch_size": 2}  # x dp4 = 8


@pytest.mark.slow
def test_resume_same_and_other_layouts(tiny_blocks, tmp_path: Path):
    def spec(name, parallel, training, resume_from=None, fields=FOUR_LAYERS):
        made = make_spec(
            tiny_blocks,
            tmp_path,
            name,
            world=4,
            parallel=parallel,
            training={**training, "checkpoint_every": SAVE_AT, "keep_last": 0},
            architecture="llama",
            fields=fields,
        )
        # The checkpoints to resume from are written by earlier runs of the same group.
        return dataclasses.replace(made, resume_from=resume_from)

    saved_tp = str(tmp_path / "dp2-tp2" / f"checkpoint-{SAVE_AT}")
    saved_pp = str(tmp_path / "dp2-pp2" / f"checkpoint-{SAVE_AT}")
    saved_tied_pp = str(tmp_path / "tied-dp2-pp2" / f"checkpoint-{SAVE_AT}")
    saved_tied_dp = str(tmp_path / "tied-dp4" / f"checkpoint-{SAVE_AT}")
    saved_tied_zbv = str(tmp_path / "tied-dp2-pp2-zbv" / f"checkpoint-{SAVE_AT}")
    specs = [
        spec("dp2-tp2", DP2_TP2, BATCH),
        spec("dp2-tp2-sync", DP2_TP2, {**BATCH, "checkpoint_async": False}),
        spec("dp2-tp2-resumed", DP2_TP2, BATCH, saved_tp),
        spec("dp4-from-tp2", DP4, BATCH_DP4, saved_tp),
        spec("dp2-pp2", DP2_PP2, BATCH),
        spec("dp4-from-pp2", DP4, BATCH_DP4, saved_pp),
        # Tied embeddings: the checkpoint holds the one weight, whichever stages held copies.
        spec("tied-dp2-pp2", DP2_PP2, BATCH, fields=TIED),
        spec("tied-dp4-from-pp2", DP4, BATCH_DP4, saved_tied_pp, fields=TIED),
        spec("tied-dp4", DP4, BATCH_DP4, fields=TIED),
        spec("tied-dp2-pp2-from-dp4", DP2_PP2, BATCH, saved_tied_dp, fields=TIED),
        # The V placement: rank 0 holds the first and the last stage.
        spec("tied-dp2-pp2-zbv", DP2_PP2_ZBV, BATCH, fields=TIED),
        spec("tied-dp2-pp2-zbv-resumed", DP2_PP2_ZBV, BATCH, saved_tied_zbv, fields=TIED),
        spec("tied-dp2-pp2-from-zbv", DP2_PP2, BATCH, saved_tied_zbv, fields=TIED),
        spec("tied-dp2-pp2-zbv-from-1f1b", DP2_PP2_ZBV, BATCH, saved_tied_pp, fields=TIED),
    ]
    results = dict(
        zip(
            [Path(s.run_dir).name for s in specs],
            run_group(specs, 4, tmp_path, "t-resume"),
            strict=True,
        )
    )
    losses, weights = reference_run(tiny_blocks, "llama", FOUR_LAYERS)

    # Uninterrupted runs match one process.
    for name in ("dp2-tp2", "dp2-pp2"):
        assert_matches_reference(name, results[name], losses, weights, tmp_path / f"{name}-hf")

    # A background save writes the files a synchronous one does, byte for byte.
    in_background, synchronous = (
        read_manifest(tmp_path / name / f"checkpoint-{SAVE_AT}")["files"]
        for name in ("dp2-tp2", "dp2-tp2-sync")
    )
    assert in_background == synchronous and len(in_background) > 4
    assert results["dp2-tp2-sync"]["losses"] == results["dp2-tp2"]["losses"]

    # Same layout: the resumed steps are bitwise the uninterrupted ones.
    for name in ("dp2-tp2", "tied-dp2-pp2-zbv"):
        straight, resumed = results[name], results[f"{name}-resumed"]
        assert resumed["losses"] == straight["losses"][SAVE_AT:], name
        consolidate_checkpoint(straight["final_checkpoint"], tmp_path / f"{name}-straight-hf")
        consolidate_checkpoint(resumed["final_checkpoint"], tmp_path / f"{name}-resumed-hf")
        a = load_file(tmp_path / f"{name}-straight-hf" / "model.safetensors")
        b = load_file(tmp_path / f"{name}-resumed-hf" / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), name

    # Another layout: the remaining steps and final weights match one process.
    tied_losses, tied_weights = reference_run(tiny_blocks, "llama", TIED)
    for name in ("tied-dp2-pp2", "tied-dp4", "tied-dp2-pp2-zbv"):
        hf = tmp_path / f"{name}-hf"
        assert_matches_reference(name, results[name], tied_losses, tied_weights, hf)
    reference = {False: (losses, weights), True: (tied_losses, tied_weights)}
    for name in (
        "dp4-from-tp2",
        "dp4-from-pp2",
        "tied-dp4-from-pp2",
        "tied-dp2-pp2-from-dp4",
        "tied-dp2-pp2-from-zbv",
        "tied-dp2-pp2-zbv-from-1f1b",
    ):
        want_losses, want_weights = reference[name.startswith("tied")]
        summary = results[name]
        assert [step for step, _ in summary["losses"]] == list(range(SAVE_AT + 1, STEPS + 1))
        earlier = [(0, x) for x in want_losses[:SAVE_AT]]
        padded = {**summary, "losses": earlier + summary["losses"]}
        assert_matches_reference(name, padded, want_losses, want_weights, tmp_path / f"{name}-hf")
