"""LoRA on every layout equals PEFT in one process: the same pretrained base, the same
initial adapters, fp32; losses per step to 1e-5 relative and the adapters after (read
from the PEFT adapter folder consolidation writes). The folder loads with
`PeftModel.from_pretrained` and the merged model with plain transformers, both with the
trained model's logits; a LoRA checkpoint resumes bitwise on its layout and onto another."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from meshtrain.checkpoint.consolidate.lora import (
    ADAPTER_WEIGHTS,
    consolidate_lora,
    write_adapter_folder,
)
from tests.conftest import TINY_VOCAB
from tests.distributed.lora import (
    GQA,
    LORA,
    SAVE_AT,
    STEPS,
    assert_matches_peft,
    lora_spec,
    peft_reference_run,
    save_base,
)
from tests.distributed.reference import assert_memory_model_holds, run_group

PIPELINE = {
    "pipeline_parallel_size": 2,
    "pipeline_parallel_num_microbatches": 2,
    "pipeline_schedule": "1f1b",
}
ZERO_1 = ({"data_parallel_size": 2, "zero_1": True}, {"per_device_train_batch_size": 4})
TP2 = ({"tensor_parallel_size": 2}, {"per_device_train_batch_size": 8})
TWO_RANKS = {
    "lora-dp2-zero1": ZERO_1,
    "lora-dp2-sdp2": (
        {"data_parallel_size": 2, "sharded_data_parallel_degree": 2},
        {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
    ),
    "lora-tp2-sp-kv": TP2,
    "lora-pp2-1f1b": (PIPELINE, {"per_device_train_batch_size": 8}),
    "lora-dp2-zero1-ac-full": (
        {"data_parallel_size": 2, "zero_1": True, "activation_checkpointing": "full"},
        {"per_device_train_batch_size": 4},
    ),
}
DROPOUT = {**LORA, "lora_dropout": 0.1}
TIED_GQA = {**GQA, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory) -> Path:
    return save_base(tmp_path_factory.mktemp("lora") / "base")


def assert_adapters_match(name: str, folder: Path, expected: dict[str, torch.Tensor]) -> None:
    got = load_file(folder / ADAPTER_WEIGHTS)
    assert got.keys() == expected.keys(), name
    for key, want in expected.items():
        rel = (got[key] - want).norm() / want.norm()
        assert rel <= 1e-5, f"{name} {key}: relative difference {rel:.2e}"


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.slow
def test_lora_on_two_ranks_matches_peft(tiny_blocks, base_folder: Path, tmp_path: Path):
    specs = [
        lora_spec(tiny_blocks, tmp_path, n, *case, base_folder) for n, case in TWO_RANKS.items()
    ]
    # Resumed at step 6: dp2 ZeRO-1 from its own checkpoint (bitwise), and from tp 2's.
    for name, source in (("zero1-resumed", "lora-dp2-zero1"), ("tp2-onto-dp2", "lora-tp2-sp-kv")):
        resumed = lora_spec(tiny_blocks, tmp_path, name, *ZERO_1, base_folder)
        saved = tmp_path / source / f"checkpoint-{SAVE_AT}"
        specs.append(dataclasses.replace(resumed, resume_from=str(saved)))
    # Dropout: the same seed, the same losses; tied embeddings over two stages; bf16 masters.
    tied_base = save_base(tmp_path / "tied-base", TIED_GQA)
    extra = {
        "dropout-a": lora_spec(
            tiny_blocks, tmp_path, "dropout-a", *ZERO_1, base_folder, lora=DROPOUT
        ),
        "dropout-b": lora_spec(
            tiny_blocks, tmp_path, "dropout-b", *ZERO_1, base_folder, lora=DROPOUT
        ),
        "tied-pp2": lora_spec(
            tiny_blocks, tmp_path, "tied-pp2", PIPELINE, TP2[1], tied_base, fields=TIED_GQA
        ),
        "bf16-master": lora_spec(
            tiny_blocks,
            tmp_path,
            "bf16-master",
            ZERO_1[0],
            {**ZERO_1[1], "mixed_precision": "bf16_master"},
            base_folder,
        ),
    }
    summaries = run_group([*specs, *extra.values()], 2, tmp_path, "t-lora2")
    losses, adapters, trained = peft_reference_run(tiny_blocks, GQA, LORA, STEPS)
    for name, summary in zip(TWO_RANKS, summaries, strict=False):
        assert_matches_peft(name, summary, losses)
        if "sdp" not in name:  # FSDP2's buffers at this toy size: bench/lora.py checks it
            assert_memory_model_holds(name, summary)
        folder = tmp_path / f"{name}-adapter"
        write_adapter_folder(summary["final_checkpoint"], folder)
        assert_adapters_match(name, folder, adapters)
    same, other = summaries[len(TWO_RANKS) : len(TWO_RANKS) + 2]
    assert same["losses"] == summaries[0]["losses"][SAVE_AT:]
    assert_matches_peft("tp2-onto-dp2", other, losses, first_step=SAVE_AT)
    ran = dict(zip(extra, summaries[len(TWO_RANKS) + 2 :], strict=True))
    assert ran["dropout-a"]["losses"] == ran["dropout-b"]["losses"] != summaries[0]["losses"]
    assert_memory_model_holds("dropout-a", ran["dropout-a"])
    tied_losses, _, _ = peft_reference_run(tiny_blocks, TIED_GQA, LORA, STEPS)
    assert_matches_peft("tied-pp2", ran["tied-pp2"], tied_losses)
    # bf16 parameters and activations: near the fp32 oracle; the adapters' fp32 masters
    # are what the checkpoint holds.
    bf16 = [loss for _, loss in ran["bf16-master"]["losses"]]
    assert all(abs(a - b) <= 2e-2 * b for a, b in zip(bf16, losses, strict=True)), bf16
    manifest = json.loads(
        (Path(ran["bf16-master"]["final_checkpoint"]) / "manifest.json").read_text()
    )
    assert {entry["dtype"] for entry in manifest["tensors"].values()} == {"float32"}

    # The tp2 run's adapters through PEFT's loader and merged, against the trained oracle.
    ids = torch.arange(24).reshape(2, 12) % TINY_VOCAB
    want = logits(trained, ids)
    summary = consolidate_lora(
        summaries[2]["final_checkpoint"], tmp_path / "adapter", merged_dir=tmp_path / "merged"
    )
    assert summary["merged"]["merged_layers"] == 4 * 7
    base = AutoModelForCausalLM.from_pretrained(base_folder)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    for label, model in (("PeftModel.from_pretrained", loaded), ("merged", merged)):
        got = logits(model, ids)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), label
