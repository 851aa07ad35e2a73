"""The dry run on CUDA against a real CUDA run: one GPU, conf/gpu's ~1.1B model.

The real side is `bench/gpu_throughput.py`'s meshtrain run (the Trainer, bf16 autocast,
its memory probe reading `torch.cuda.max_memory_allocated` over one step, and the
caching allocator's reserved peak beside it); the dry side runs the same plan's rank 0
with `meshtrain.dryrun` on fake `cuda` tensors, the CUDA code path. Needs a GPU:

    python3 bench/dryrun_cuda.py        # ~1 min on one H100/H200
"""

from __future__ import annotations

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import contextlib  # noqa: E402

import gpu_throughput  # noqa: E402  (bench/gpu_throughput.py: the 1B shape and its job)
import throughput  # noqa: E402
import torch  # noqa: E402
from bench_runs import token_blocks, work_root  # noqa: E402

from meshtrain.config import RunConfig  # noqa: E402
from meshtrain.dryrun.fake_world import dry_run_device  # noqa: E402
from meshtrain.dryrun.rank import dry_run_rank  # noqa: E402
from meshtrain.planner import Plan  # noqa: E402

MIB = 2**20


def main() -> None:
    # Without a GPU (a smoke run of this script): the project's CPU shape on the CPU.
    cuda = torch.cuda.is_available()
    shape = gpu_throughput.GPU_SHAPES["1b" if cuda else "default"]
    job = {
        **shape,
        "world": 1,
        "steps": 2,
        "warmup": 1,
        "threads": "auto",
        "bucket_mb": RunConfig.from_params().training.grad_bucket_mb,
        "device": "cuda" if cuda else "cpu",
        "mixed_precision": "bf16",
    }
    with contextlib.ExitStack() as stack:
        root = work_root(stack, None, "mt-dry-")
        token_blocks(root / "blocks", 64, shape["vocab"], shape["block"], learnable=False)
        import datasets  # noqa: PLC0415

        blocks = datasets.load_from_disk(str(root / "blocks"))
        spec = throughput.meshtrain_spec(job, blocks, root, "real", "meshtrain", 4)
        result = throughput._launch(
            throughput.meshtrain_entry, job, (spec, job), root, "real", False
        )
        summary = result["summary"]
        real = summary["measured_peak_memory"]["peak_bytes"]
        run, plan = RunConfig.from_dict(spec.run), Plan.from_dict(spec.plan)
        device, why = dry_run_device("h200" if cuda else "cpu")
        dry = dry_run_rank(run, plan, 0, device)
    print(f"{plan.layout.name}, bf16, block {shape['block']} x {shape['batch']}; {why}")
    print(f"real step peak (torch.cuda.max_memory_allocated): {real / MIB:,.1f} MiB")
    print(f"dry run step peak ({device}):                     {dry.peak_bytes / MIB:,.1f} MiB")
    print(
        f"dry / real: {dry.peak_bytes / real:.4f}; planner / real: "
        f"{plan.memory_estimate_per_rank['total'] / real:.4f}; dry run {dry.seconds:.1f} s"
    )
    print("dry run at the peak, MiB:", {k: round(v / MIB, 1) for k, v in dry.at_peak.items()})
    print("where:", dry.peak_at, "; model states:", dry.model_states)
    if cuda:  # the allocator's and the runtime's share, over the whole run
        allocated, reserved, used = (
            summary[f"{name}_per_rank"][0]
            for name in ("device_peak_allocated_mb", "device_peak_reserved_mb", "device_used_mb")
        )
        print(
            f"run peaks, MiB: allocated {allocated:,.1f}, reserved {reserved:,.1f} "
            f"(x{reserved / allocated:.4f}), device in use at the end {used:,.1f} "
            f"(beyond the reserved peak: {used - reserved:,.1f})"
        )
    print("torch", torch.__version__)


if __name__ == "__main__":
    main()
