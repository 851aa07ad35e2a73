"""bf16 parameters with fp32 master weights (`training.mixed_precision=bf16_master`), in one
4-rank group: it tracks the fp32 run, resumes bitwise on its own layout and onto another,
keeps its fp32 master weights in the checkpoint, and the planner's memory model holds.

bf16 arithmetic depends on the layout (each tp or dp split rounds differently), so these
runs are compared with fp32 within the issue's 2%, not to 1e-5 like the fp32 layouts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshtrain.checkpoint import consolidate_checkpoint
from tests.conftest import TINY_MODEL
from tests.distributed.reference import (
    STEPS,
    assert_memory_model_holds,
    make_spec,
    reference_run,
    run_group,
)

LONG = 50  # steps of the tracking comparison
SAVE_AT = 25
DP2_TP2 = {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_1": True}
DP4 = {"data_parallel_size": 4, "zero_1": True}
DP2_PP2 = {
    "data_parallel_size": 2,
    "pipeline_parallel_size": 2,
    "pipeline_parallel_num_microbatches": 2,
    "zero_1": True,
}
TIED = {**TINY_MODEL, "num_hidden_layers": 4, "tie_word_embeddings": True}
MASTER = {"mixed_precision": "bf16_master"}


def assert_tracks(name: str, got: list[float], want: list[float], tolerance: float = 0.02):
    assert len(got) == len(want), name
    differences = [abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)]
    assert max(differences) <= tolerance, (
        f"{name}: losses differ from fp32 by {[f'{d:.2%}' for d in differences]}"
    )


def losses_of(summary: dict) -> list[float]:
    return [loss for _, loss in summary["losses"]]


@pytest.mark.slow
def test_bf16_master_tracks_fp32_resumes_and_keeps_fp32_masters(tiny_blocks, tmp_path: Path):
    def spec(name, parallel, training, resume_from=None, fields=TINY_MODEL):
        made = make_spec(
            tiny_blocks,
            tmp_path,
            name,
            world=4,
            parallel=parallel,
            training={"checkpoint_every": SAVE_AT, "keep_last": 0, **training},
            architecture="llama",
            fields=fields,
        )
        return dataclasses.replace(made, resume_from=resume_from)

    # The project's default learning rate (the shared one, 1e-2, is there to make six
    # steps move the weights visibly).
    long = {"max_steps": LONG, "per_device_train_batch_size": 4, "learning_rate": 3e-3}
    saved = str(tmp_path / "master-dp2-tp2" / f"checkpoint-{SAVE_AT}")
    specs = [
        spec("fp32-dp2-tp2", DP2_TP2, long),
        spec("master-dp2-tp2", DP2_TP2, {**long, **MASTER}),
        spec("master-dp2-tp2-resumed", DP2_TP2, {**long, **MASTER}, saved),
        spec(
            "master-dp4-from-tp2", DP4, {**long, **MASTER, "per_device_train_batch_size": 2}, saved
        ),
        # Tied embeddings over two stages (their gradient sum reads the fp32 gradients),
        # gradients averaged in bf16.
        spec(
            "master-tied-dp2-pp2-bf16-reduce",
            DP2_PP2,
            {**MASTER, "grad_reduce_dtype": "bf16", "per_device_train_batch_size": 4},
            fields=TIED,
        ),
    ]
    results = dict(
        zip(
            [Path(s.run_dir).name for s in specs],
            run_group(specs, 4, tmp_path, "t-bf16-master"),
            strict=True,
        )
    )
    fp32, master = results["fp32-dp2-tp2"], results["master-dp2-tp2"]

    # Tracks fp32 over 50 steps; on another layout after a resume too.
    assert_tracks("master-dp2-tp2", losses_of(master), losses_of(fp32))
    assert_tracks(
        "master-dp4-from-tp2",
        losses_of(results["master-dp4-from-tp2"]),
        losses_of(fp32)[SAVE_AT:],
    )
    tied_losses, _ = reference_run(tiny_blocks, "llama", TIED)
    tied = results["master-tied-dp2-pp2-bf16-reduce"]
    assert len(tied_losses) == STEPS
    assert_tracks("master-tied-dp2-pp2-bf16-reduce", losses_of(tied), tied_losses)

    # Same layout: the resumed steps and the final fp32 masters are bitwise the run's.
    resumed = results["master-dp2-tp2-resumed"]
    assert resumed["losses"] == master["losses"][SAVE_AT:]
    straight_hf, resumed_hf = tmp_path / "master-hf", tmp_path / "resumed-hf"
    consolidate_checkpoint(master["final_checkpoint"], straight_hf, progress=False)
    consolidate_checkpoint(resumed["final_checkpoint"], resumed_hf, progress=False)
    a = load_file(straight_hf / "model.safetensors")
    b = load_file(resumed_hf / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The checkpoint holds fp32 master weights (not their bf16 rounding); --dtype bf16
    # casts them while streaming, as torch would.
    manifest = json.loads((Path(master["final_checkpoint"]) / "manifest.json").read_text())
    assert {t["dtype"] for t in manifest["tensors"].values()} == {"float32"}
    assert all(v.dtype == torch.float32 for v in a.values())
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in a.values())
    summary = consolidate_checkpoint(
        master["final_checkpoint"], tmp_path / "master-bf16", progress=False, dtype="bf16"
    )
    assert summary["dtype"] == ["bfloat16"]
    as_bf16 = load_file(tmp_path / "master-bf16" / "model.safetensors")
    assert all(torch.equal(as_bf16[k], a[k].to(torch.bfloat16)) for k in a)
    config = json.loads((tmp_path / "master-bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"

    # The planner counts 2 + 4 + 12/dp bytes per parameter, and the step's measured peak.
    for name in ("master-dp2-tp2", "master-tied-dp2-pp2-bf16-reduce"):
        assert_memory_model_holds(name, results[name])
