"""Training throughput on GPUs: a ~1B Llama in bf16, meshtrain against a bare loop, as MFU.

Issue #19's GPU measurement as one command (docs/speed.md, "On a GPU"): conf/gpu's
model (TinyLlama's shape), blocks of 2048, per-device batch 4, random blocks; the sides
of `bench/throughput.py` run by its own entry points and timed the same way: meshtrain
as planned (NCCL, bf16 autocast over fp32 master weights), the bare loop under bf16
autocast, meshtrain again (A/A), and with N > 1 devices meshtrain at dp=N and tp=2.
Beside each: model TFLOP/s over the published peak and over the bf16 GEMM measured on
the device before every repeat and at the end.

    .venv/bin/python bench/gpu_throughput.py          # ~1.1B, bf16; ~6 min on one H100/H200

`--device cpu --shape default` runs the same code on CPUs (tests/test_gpu_bench.py).
"""

from __future__ import annotations

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import datasets  # noqa: E402
import throughput  # noqa: E402  (bench/throughput.py: the sides' entry points and timing)
import torch  # noqa: E402
from bench_runs import token_blocks, work_root  # noqa: E402  (bench/bench_runs.py)
from shapes import SHAPE_FIELDS, SHAPES, model_flops_per_token  # noqa: E402

from meshtrain.config import RunConfig  # noqa: E402
from meshtrain.models import build_model_config  # noqa: E402
from meshtrain.planner.devices import resolve_device  # noqa: E402

# conf/gpu's model (TinyLlama's shape), its blocks and per-device batch; `default` is the
# project's CPU shape, for the smoke run.
GPU_SHAPES: dict[str, dict[str, int]] = {
    "1b": dict(
        zip(SHAPE_FIELDS, (2048, 5632, 22, 32, 4, 32000, 2048, 4), strict=True),
    ),
    "default": {name: SHAPES["default"][name] for name in SHAPE_FIELDS},
}
# The GEMM of the machine limit: n x n x n on a GPU; on CPU (the smoke run) a size its
# cores finish in milliseconds.
GEMM_SIZE = {"cuda": 8192, "cpu": 256}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(GPU_SHAPES), default="1b")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=2, help="order reversed on odd repeats")
    parser.add_argument(
        "--worlds", type=int, nargs="+", default=None, help="default: 1 and every device"
    )
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (use --device cpu)")
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1:
        parser.error("--steps, --warmup and --repeats must be at least 1")
    devices = torch.cuda.device_count() if args.device == "cuda" else 2
    args.worlds = args.worlds or sorted({1, devices})
    if any(world < 1 or world > devices for world in args.worlds):
        parser.error(f"--worlds: between 1 and {devices} ({args.device} ranks here)")
    return args


def sides(world: int) -> tuple[str, ...]:
    """The sides run at `world` ranks, in run order (reversed on odd repeats)."""
    if world == 1:
        return ("meshtrain", "bare", "meshtrain_again")
    return ("meshtrain", "meshtrain_tp2") if world % 2 == 0 else ("meshtrain",)


def gemm_tflops(device: str, bf16: bool, repeats: int = 10) -> float:
    """One device's `torch.mm` rate on `GEMM_SIZE` square matrices, median of `repeats`."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    n = GEMM_SIZE[device]
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = []
    for index in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        torch.mm(a, b, out=out)
        if device == "cuda":
            torch.cuda.synchronize()
        if index >= 2:  # the first two warm up
            seconds.append(time.perf_counter() - began)
    return 2 * n**3 / statistics.median(seconds) / 1e12


def run_world(
    world: int, args: argparse.Namespace, root: Path, blocks_path: Path, gemm: list[float]
) -> dict[str, dict[str, list]]:
    """Every side at `world` ranks, `--repeats` times; the GEMM rate before each repeat."""
    blocks = datasets.load_from_disk(str(blocks_path))
    job = {
        **GPU_SHAPES[args.shape],
        "world": world,
        "blocks": str(blocks_path),
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": "auto",
        "bucket_mb": RunConfig.from_params().training.grad_bucket_mb,
        "device": args.device,
        "mixed_precision": "bf16" if args.precision == "bf16" else "no",
    }
    runs: dict[str, dict[str, list]] = {side: defaultdict(list) for side in sides(world)}
    for repeat in range(args.repeats):
        order = sides(world) if repeat % 2 == 0 else tuple(reversed(sides(world)))
        gemm.append(gemm_tflops(args.device, args.precision == "bf16"))
        print(f"world {world}, repeat {repeat + 1}: {' -> '.join(order)}", flush=True)
        for side in order:
            tag = f"w{world}-r{repeat + 1}-{side}"
            result = throughput.run_one(side, job, blocks, root, tag, args.verbose)
            for key in ("tokens_per_s", "layout"):
                runs[side][key].append(result[key])
            if side.startswith("meshtrain"):
                runs[side]["own_mfu"].append(result["summary"]["mean_mfu"])
    return runs


def world_lines(
    world: int, runs: dict[str, dict[str, list]], flops: int, peak: float, gemm: float
) -> list[str]:
    """One world's table (tokens/s, model TFLOP/s, MFU against the published peak and the
    measured GEMM rate) and meshtrain's ratios with the A/A control."""
    lines = [
        "",
        f"world {world}: {world} x {peak:g} TFLOP/s published peak, "
        f"{world} x {gemm:,.1f} measured GEMM",
        "| side | layout | tokens/s per repeat | mean | model TFLOP/s | MFU | vs GEMM | "
        "own mean_mfu |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    means = {side: statistics.fmean(values["tokens_per_s"]) for side, values in runs.items()}
    for side, values in runs.items():
        tflops = means[side] * flops / 1e12
        own = values.get("own_mfu") or []
        own_text = ", ".join(f"{value:.3f}" for value in own if value is not None) or "-"
        repeats = ", ".join(f"{value:,.0f}" for value in values["tokens_per_s"])
        lines.append(
            f"| {side} | {values['layout'][0]} | {repeats} | {means[side]:,.0f} | "
            f"{tflops:,.4g} | {tflops / (world * peak):.3f} | {tflops / (world * gemm):.3f} | "
            f"{own_text} |"
        )
    for other in ("bare", "meshtrain_again", "meshtrain_tp2"):
        if other in means:
            lines.append(f"meshtrain / {other}: {means['meshtrain'] / means[other]:.3f}x")
    return lines


def main() -> None:
    args = parse_args()
    shape = GPU_SHAPES[args.shape]
    bf16 = args.precision == "bf16"
    with contextlib.ExitStack() as stack:
        root = work_root(stack, args.work_dir, "mt-gpu-")
        per_run = (args.warmup + args.steps + 3) * shape["batch"] * max(args.worlds)
        blocks_path = root / "blocks"
        token_blocks(
            blocks_path, max(64, 2 * per_run), shape["vocab"], shape["block"], learnable=False
        )
        (root / "runs").mkdir()
        config = build_model_config(
            "llama", throughput.model_fields(shape), vocab_size=shape["vocab"]
        )
        flops = model_flops_per_token(config, shape["block"])
        peak = resolve_device("auto", {}, cuda=args.device == "cuda").peak_tflops(bf16)
        name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        header = (
            f"Llama (--shape {args.shape}): {shape}; {flops / 1e9:.2f} GFLOPs per token; "
            f"{args.precision}; {name}; torch {torch.__version__}; "
            f"{time.strftime('%Y-%m-%d %H:%M')}"
        )
        print(header, flush=True)
        gemm: list[float] = []
        runs = {world: run_world(world, args, root, blocks_path, gemm) for world in args.worlds}
        gemm.append(gemm_tflops(args.device, bf16))
        rate = statistics.fmean(gemm)
        lines = [
            header,
            f"{args.precision} GEMM TFLOP/s per device: "
            f"{', '.join(f'{value:,.1f}' for value in gemm)}; mean {rate:,.1f}",
        ]
        if args.device == "cpu":
            lines.append(
                "(on CPU the ranks share the cores the GEMM ran on, and the peak is the cpu "
                "profile's: the smoke run of this script, not a measurement)"
            )
        for world, world_runs in runs.items():
            lines += world_lines(world, world_runs, flops, peak, rate)
        print()
        print(f"command: .venv/bin/python {' '.join(sys.argv)}")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
