"""Data parallelism and ZeRO-1 reproduce one process (fp32, same data and seed).

The reference is a plain PyTorch loop written here, independent of the
engine's flat buffer and sharded optimizer: HF model, torch AdamW with the
usual decay groups, `clip_grad_norm_`, the global batch in one piece. The
distributed runs cut the same global batch over 2 ranks and accumulation
microbatches, all in one spawned gloo group.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from meshtrain.config import RunConfig
from meshtrain.data.blocks import BlockStore, arrow_files
from meshtrain.data.sampler import GlobalBatchSampler
from meshtrain.launch import run_workers
from meshtrain.models import build_model, build_model_config
from meshtrain.planner import plan_run
from meshtrain.schedule import warmup_cosine
from meshtrain.training import make_worker_spec
from meshtrain.worker import worker_main_sequence
from tests.conftest import TINY_BLOCK, TINY_MODEL, TINY_VOCAB

STEPS = 6
GLOBAL_BATCH = 8
TRAINING = {
    "max_steps": STEPS,
    "learning_rate": 1e-2,
    "warmup_steps": 2,
    "weight_decay": 0.1,
    "max_grad_norm": 0.5,  # small enough that clipping is active
    "seed": 7,
    "log_every": 1,
    "checkpoint_every": 100,
    "eval_batches": 2,
}


def reference_run(blocks) -> tuple[list[float], dict[str, torch.Tensor]]:
    config = build_model_config("llama", TINY_MODEL, vocab_size=TINY_VOCAB)
    model = build_model(config, seed=TRAINING["seed"])
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=TRAINING["learning_rate"],
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        partial(warmup_cosine, warmup_steps=2, max_steps=STEPS, min_ratio=0.1),
    )
    store = BlockStore(arrow_files(blocks["train"]))
    sampler = GlobalBatchSampler(len(store), GLOBAL_BATCH, TRAINING["seed"])
    losses = []
    for step in range(STEPS):
        ids = store.batch(sampler.global_indices(step))
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, TINY_VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAINING["max_grad_norm"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    rel = (actual - expected).norm() / expected.norm()
    assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"


@pytest.mark.slow
def test_dp2_with_and_without_zero1_match_one_process(tiny_blocks, tmp_path: Path):
    cases = {
        # per-device batch x accumulation x dp = 8 in every case
        "dp2-zero1": ({"zero_1": True}, {"per_device_train_batch_size": 4}),
        "dp2-zero1-accum2": (
            {"zero_1": True},
            {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
        ),
        "dp2-no-zero": ({"zero_1": False}, {"per_device_train_batch_size": 4}),
        "dp2-zero1-checkpointing": (
            {"zero_1": True, "activation_checkpointing": "full"},
            {"per_device_train_batch_size": 4},
        ),
    }
    bf16 = (
        "dp2-zero1-bf16",
        ({"zero_1": True}, {"per_device_train_batch_size": 4, "mixed_precision": "bf16"}),
    )
    specs = []
    for name, (parallel, training) in [*cases.items(), bf16]:
        run = RunConfig.from_params(
            parallel={"data_parallel_size": 2, **parallel},
            training={**TRAINING, **training, "output_dir": str(tmp_path), "run_name": name},
            launch={"nproc_per_node": 2},
            model={"config": TINY_MODEL},
            data={"block_size": TINY_BLOCK},
        )
        config = build_model_config("llama", TINY_MODEL, vocab_size=TINY_VOCAB)
        plan = plan_run(run, config, num_train_blocks=128, num_validation_blocks=32)
        assert plan.global_batch_size == GLOBAL_BATCH
        specs.append(
            make_worker_spec(
                run,
                plan,
                train_files=arrow_files(tiny_blocks["train"]),
                validation_files=arrow_files(tiny_blocks["validation"]),
                tokenizer_dir=None,
            )
        )
    *results, bf16_result = run_workers(
        worker_main_sequence, (specs,), run.launch, log_dir=tmp_path / "logs", run_id="t-dp"
    )[0]

    expected_losses, expected_weights = reference_run(tiny_blocks)
    assert expected_losses[-1] < expected_losses[0]
    for name, summary in zip(cases, results, strict=True):
        losses = [loss for _, loss in summary["losses"]]
        assert len(losses) == STEPS
        for step, (got, want) in enumerate(zip(losses, expected_losses, strict=True)):
            assert abs(got - want) / abs(want) <= 1e-5, f"{name} step {step}: {got} vs {want}"
        shard = Path(summary["final_checkpoint"]) / "shards/tp_rank_00_pp_rank_00/model.safetensors"
        weights = load_file(shard)
        assert weights.keys() == expected_weights.keys()
        for key, want in expected_weights.items():
            assert_close_rel(weights[key], want, f"{name} {key}")
        assert summary["initial_val_loss"] > summary["final_val_loss"]

    # bf16 autocast is not fp32 arithmetic, so it only has to track the fp32 run closely.
    bf16_losses = [loss for _, loss in bf16_result["losses"]]
    for got, want in zip(bf16_losses, expected_losses, strict=True):
        assert abs(got - want) / want < 0.02
