"""The dry run against real runs: one rank's step on fake tensors under a fake process
group holds, within 5%, the peak of live tensors the real rank's memory probe measured
(`components.memory_probe`, the same tracker over real tensors), rank by rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshtrain.config import RunConfig
from meshtrain.dryrun.rank import dry_run_rank
from meshtrain.planner import Plan
from tests.conftest import TINY_MODEL
from tests.distributed.reference import make_spec, run_group

WORLD2 = {
    "dp2-zero1": ({"data_parallel_size": 2, "zero_1": True}, {}),
    "dp2-bf16-ckpt": (
        {"data_parallel_size": 2, "activation_checkpointing": "full"},
        {"mixed_precision": "bf16"},
    ),
    "tp2-sp": ({"tensor_parallel_size": 2, "sequence_parallel": True}, {}),
    "sdp2": ({"data_parallel_size": 2, "sharded_data_parallel_degree": 2}, {}),
    "sdp2-bf16-master": (
        {"data_parallel_size": 2, "sharded_data_parallel_degree": 2},
        {"mixed_precision": "bf16_master"},
    ),
}


@pytest.mark.slow
def test_dry_runs_hold_what_the_real_ranks_held(tiny_blocks, tmp_path: Path):
    specs = [
        make_spec(
            tiny_blocks,
            tmp_path,
            name,
            world=2,
            parallel=parallel,
            training={
                "per_device_train_batch_size": 8 // parallel.get("data_parallel_size", 1),
                **training,
            },
            architecture="llama",
            fields=TINY_MODEL,
        )
        for name, (parallel, training) in WORLD2.items()
    ]
    results = run_group(specs, 2, tmp_path, "t-dry")
    failures = []
    for name, spec, summary in zip(WORLD2, specs, results, strict=True):
        measured = summary["measured_peak_memory"]["peak_bytes_per_rank"]
        run, plan = RunConfig.from_dict(spec.run), Plan.from_dict(spec.plan)
        for rank, real in enumerate(measured):
            dry = dry_run_rank(run, plan, rank, torch.device("cpu"))
            mib = dry.peak_bytes / 2**20, real / 2**20
            line = f"{name} rank {rank}: dry {mib[0]:.3f} MiB, real {mib[1]:.3f} MiB"
            print(line, dry.at_peak, dry.peak_at)
            if abs(dry.peak_bytes / real - 1) > 0.05:
                failures.append(line)
    assert not failures, failures
