"""The planner against real runs: predicted / measured peak memory and step time per layout.

Per layout of LAYOUTS (dp/tp/pp, ZeRO-1, sequence parallelism, activation
checkpointing, schedules, precisions; tiny and small Llamas) one short real run
measures every rank's peak of live tensors in one step and the median step time,
beside the planner's estimate; layouts of one world size and model share one spawned
group. Then per world size and model the planner's own choice against the fastest
measured. Targets (docs/planner.md, "Validation"): memory within 10%, step time within
20% (`--time-model`), the choice within 10% of the fastest. Nothing is asserted.

    .venv/bin/python bench/planner_validation.py [--steps 6] [--only small]
    .venv/bin/python bench/planner_validation.py --time-model --steps 6   # ~10 min
    .venv/bin/python bench/planner_validation.py --calibrate              # ~3 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import machine_limit  # noqa: E402  (bench/machine_limit.py)
import torch  # noqa: E402
from bench_runs import one_way_send_s, planned_side, token_blocks  # noqa: E402
from shapes import SHAPES, hf_fields  # noqa: E402

from meshtrain.config import LaunchConfig, TrainingConfig  # noqa: E402
from meshtrain.launch.elastic import run_workers  # noqa: E402
from meshtrain.launch.worker import worker_main_sequence  # noqa: E402
from meshtrain.models import build_model_config  # noqa: E402
from meshtrain.models.converters import build_converters, converter_names  # noqa: E402


def _preset(name: str) -> dict[str, Any]:
    """A bench/shapes.py preset as this script's model entry."""
    return {
        "fields": hf_fields(SHAPES[name]),
        **{k: SHAPES[name][k] for k in ("vocab", "block", "batch")},
    }


MODELS = {
    # The project's default shape. Its steps take a quarter of a second: five times
    # `--steps` of them cost little and steady the median step time, which one
    # descheduled step moves by a third.
    "tiny": {**_preset("default"), "step_factor": 5},
    "small": {
        "fields": {
            "hidden_size": 256,
            "intermediate_size": 704,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "max_position_embeddings": 512,
        },
        "vocab": 8192,
        "block": 256,
        "batch": 4,
    },
    # The sizes where compute dominates (issue #19): bench/throughput.py's --shape presets.
    "27m": _preset("27m"),
    "110m": _preset("110m"),
}

TP2, PP2 = {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}
FULL, SELECTIVE = {"activation_checkpointing": "full"}, {"activation_checkpointing": "selective"}
# (model, world size, parallel overrides[, training overrides])
LAYOUTS: list[tuple] = [
    ("tiny", 1, {}),
    ("tiny", 1, FULL),
    ("tiny", 1, SELECTIVE),
    ("tiny", 2, {"data_parallel_size": 2}),
    ("tiny", 2, {"data_parallel_size": 2, "zero_1": False}),
    ("tiny", 2, {**TP2, "sequence_parallel": False}),
    ("tiny", 2, TP2),
    ("tiny", 2, {**PP2, "pipeline_schedule": "1f1b"}),
    ("tiny", 2, {**PP2, "pipeline_schedule": "gpipe"}),
    ("small", 1, {}),
    ("small", 2, {"data_parallel_size": 2}),
    ("small", 2, TP2),
    ("small", 2, {**TP2, **FULL}),
    ("small", 2, {**PP2, "pipeline_parallel_num_microbatches": 2}),
    ("small", 4, {"data_parallel_size": 2, **TP2}),
    ("small", 4, {**TP2, **PP2}),
    ("small", 2, {**TP2, **SELECTIVE}),
    ("small", 2, {**TP2, "sequence_parallel": False, **SELECTIVE}),
    ("tiny", 1, SELECTIVE, {"mixed_precision": "bf16"}),
    ("tiny", 1, {}, {"mixed_precision": "bf16"}),
    (
        "small",
        2,
        {**PP2, "pipeline_schedule": "interleaved_1f1b", "pipeline_parallel_num_microbatches": 4},
    ),
]
# The time model's check: dp2, tp2 and pp2 (1F1B) at the three sizes, predicted step time
# within 20% of the measured (`--time-model`).
TIME_MODEL_LAYOUTS: list[tuple] = [
    (model, 2, parallel)
    for model in ("tiny", "27m", "110m")
    for parallel in ({"data_parallel_size": 2}, TP2, {**PP2, "pipeline_schedule": "1f1b"})
]
# Matmul widths the cpu profile's rate is measured at (`--calibrate`): the models above.
CALIBRATION_MODELS = ("tiny", "small", "27m", "110m")
# The planner's own choice, to compare with the fastest layout measured.
ALL_AUTO = {"tensor_parallel_size": "auto", "pipeline_parallel_size": "auto"}
# The 2 x 1 GEMM rates of the machine when the cpu profile's tables were measured
# (bench/machine_limit.py): its speed moves 20-40% between hours, the step times with it.
CALIBRATED_AT = "oneDNN 320-374, torch.mm 147-155"


def planned(model: str, world: int, parallel: dict, training: dict, root: Path, blocks, name: str):
    """(worker spec, plan) of one layout's run of `model` (bench_runs.planned_side)."""
    shape = MODELS[model]
    return planned_side(
        blocks,
        root,
        name,
        world=world,
        parallel={
            "data_parallel_size": "auto",
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
        }
        | parallel,
        training={"per_device_train_batch_size": shape["batch"], **training},
        shape=shape["fields"],
        vocab=shape["vocab"],
        block=shape["block"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", choices=sorted(MODELS), default=None)
    parser.add_argument("--match", help="only layouts whose overrides name this parameter")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the cpu profile's numbers (training FLOP/s on one core per matmul "
        "width, gloo all-reduce bandwidth and latency between two processes) and exit",
    )
    parser.add_argument(
        "--time-model",
        action="store_true",
        help="only dp2, tp2 and pp2 at the tiny, 27m and 110m sizes: predicted step time "
        "against measured (target: within 20%%)",
    )
    args = parser.parse_args()
    if args.calibrate:
        calibrate()
        return
    layouts = [
        (model, world, parallel, rest[0] if rest else {})
        for model, world, parallel, *rest in (TIME_MODEL_LAYOUTS if args.time_model else LAYOUTS)
        if (not args.only or model == args.only)
        and (not args.match or args.match in {**parallel, **(rest[0] if rest else {})})
    ]
    gemm_before = machine_limit.gemm_rate(2, 1)
    with tempfile.TemporaryDirectory() as tmp:
        rows, choices = run_layouts(layouts, args.steps, Path(tmp))
    print_table(rows, args.steps, choices)
    gemm_after = machine_limit.gemm_rate(2, 1)
    print(
        "the machine's fp32 GEMM rate, 2 processes x 1 thread, at the start / end: "
        + " / ".join(_gemm_summary(rate) for rate in (gemm_before, gemm_after))
        + f" GFLOP/s (the cpu profile was calibrated at {CALIBRATED_AT})"
    )


def run_layouts(
    layouts: list[tuple], steps: int, root: Path
) -> tuple[list[tuple[str, int, str, dict, dict]], dict[tuple[str, int], str]]:
    """Train every layout, those of one model and world size in one spawned group
    (start-up dominates): (model, world, label, plan, summary) rows, and the planner's
    own choice per model and world size."""
    groups: dict[tuple[str, int], list[tuple[str, dict, Any]]] = {}
    choices: dict[tuple[str, int], str] = {}
    blocks_of = {}
    for index, (model, world, parallel, training) in enumerate(layouts):
        shape = MODELS[model]
        model_steps = steps * shape.get("step_factor", 1)
        if model not in blocks_of:
            count = shape["batch"] * 4 * (model_steps + 2) + 8
            out = root / f"blocks-{model}"
            blocks_of[model] = token_blocks(
                out, count, shape["vocab"], shape["block"], learnable=False, validation=8
            )
        blocks, fixed = blocks_of[model], {"max_steps": model_steps, **training}
        spec, plan = planned(model, world, parallel, fixed, root, blocks, f"{model}-{index}")
        label = plan.layout.name + "".join(f" {k}={v}" for k, v in training.items())
        groups.setdefault((model, world), []).append((label, plan.to_dict(), spec))
        if world > 1 and (model, world) not in choices:
            choice = planned(model, world, ALL_AUTO, {"max_steps": 10}, root, blocks, "choice")
            choices[model, world] = choice[1].layout.name
    rows = []
    for (model, world), items in groups.items():
        started = time.perf_counter()
        summaries = run_workers(
            worker_main_sequence,
            ([spec for *_, spec in items],),
            LaunchConfig(nproc_per_node=world),
            log_dir=root / "logs",
            run_id=f"validation-{model}-{world}",
        )[0]
        seconds = time.perf_counter() - started
        print(f"[{model} world {world}: {len(items)} runs in {seconds:.0f}s]", file=sys.stderr)
        for (label, plan, _), summary in zip(items, summaries, strict=True):
            rows.append((model, world, label, plan, summary))
    return rows, choices


def _gemm_summary(rate: dict[str, Any]) -> str:
    """Each library's best rate over the sizes, as "oneDNN X, torch.mm Y"."""
    names = {"onednn": "oneDNN", "blas": "torch.mm"}
    return ", ".join(
        f"{names[library]} {max(by_size.values()):.0f}"
        for library, by_size in rate["by_library"].items()
    )


def print_table(
    rows: list[tuple[str, int, str, dict, dict]],
    steps: int,
    choices: dict[tuple[str, int], str],
) -> None:
    """Predicted / measured memory and step time per layout, then the planner's choice
    against the fastest layout measured."""
    print(
        f"{'model':6} {'layout':32} {'memory MiB: pred':>16} {'meas':>7} {'ratio':>6} "
        f"{'step ms: pred':>14} {'meas':>7} {'ratio':>6}"
    )
    worst = worst_time = 0.0
    for model, _, label, plan, summary in rows:
        predicted = plan["memory_estimate_per_rank"]["total"]
        measured = summary["measured_peak_memory"]["peak_bytes"]
        worst = max(worst, abs(predicted / measured - 1))
        step_pred = plan["time_estimate"]["step_s"] * 1e3
        median = summary["median_step_s"]  # the steady steps' median, as the plan predicts one
        step_meas = median * 1e3 if median else float("nan")
        worst_time = max(worst_time, abs(step_pred / step_meas - 1))
        print(
            f"{model:6} {label:32} {predicted / 2**20:16.1f} "
            f"{measured / 2**20:7.1f} {predicted / measured:6.2f} "
            f"{step_pred:14.0f} {step_meas:7.0f} {step_pred / step_meas:6.2f}"
        )
    more = ", ".join(
        f"{name} {shape['step_factor']} times as many"
        for name, shape in MODELS.items()
        if shape.get("step_factor", 1) > 1
    )
    print(
        f"largest memory error: {worst:.1%} over {len(rows)} layouts ({steps} steps each, "
        f"{more}; measured step: the median of the steady steps)"
    )
    print(f"largest step time error: {worst_time:.1%} (target for the time model: 20%)")
    for (model, world), choice in choices.items():
        # Throughput, not step time: dp changes the global batch, so steps differ in tokens.
        measured = {
            p["layout_name"]: s["mean_tokens_per_s"]
            for m, w, _, p, s in rows
            if (m, w) == (model, world)
        }
        if len(measured) < 2:
            continue
        fastest = max(measured, key=measured.get)
        verdict = (
            f"{measured[choice] / measured[fastest]:.2f}x the fastest tokens/s"
            if choice in measured
            else "not among the measured layouts"
        )
        print(
            f"{model} world {world}: planner chose {choice}; fastest measured {fastest}; {verdict}"
        )


def calibrate() -> None:
    """The numbers behind the `cpu` device profile, measured on this machine.

    Per matmul width (the models of CALIBRATION_MODELS) and tokens per forward (one
    sequence or 256 tokens, and the model's whole batch), the training rate of forward +
    backward, in two fresh single-thread processes at once (as two ranks run): on the
    device's own path (`tflops_fp32_by_shape`) and through each model converter a
    default CPU run goes through (`converter_tflops_fp32_by_shape`); then gloo's
    all-reduce latency and bandwidth between two processes.
    """
    names = converter_names(TrainingConfig(), on_cpu=True, tensor_parallel=False)
    rates = {
        name: sum((_rate_points(model, name) for model in CALIBRATION_MODELS), [])
        for name in (None, *names)
    }
    own = rates.pop(None)
    by_converter = ", ".join(f"{name}: {points}" for name, points in rates.items())
    print(
        f"planner.device_profiles: {{cpu: {{tflops_fp32_by_shape: {own}, "
        f"converter_tflops_fp32_by_shape: {{{by_converter}}}}}}}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_gloo_probe, args=(tmp,), nprocs=2, join=True)


def _rate_points(model: str, converter: str | None) -> list[list[float]]:
    """[[width, tokens, TFLOP/s per core]] of `model` on the device's own path, or through
    the named model converter; the mean of the two processes."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_rate_probe, args=(model, converter, tmp), nprocs=2, join=True)
        found = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rate-*.json"))]
    width = MODELS[model]["fields"]["hidden_size"]
    points = []
    for index, (tokens, _) in enumerate(found[0]):
        rate = statistics.fmean(ranks[index][1] for ranks in found)
        path = converter or "own path"
        print(f"{path}, width {width} ({model}), {tokens} tokens: {rate:.4f} TFLOP/s")
        points.append([width, tokens, round(rate, 4)])
    return points


def _rate_probe(rank: int, model: str, converter: str | None, tmp: str, steps: int = 6) -> None:
    """[(tokens per forward, TFLOP/s)] of `model`'s forward + backward on one thread, at
    256 tokens (or one sequence, if longer) and at the model's batch: median step times."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from meshtrain.planner.flops import training_flops_per_token  # noqa: PLC0415
    from meshtrain.planner.shapes import ModelShape  # noqa: PLC0415

    torch.set_num_threads(1)
    shape = MODELS[model]
    config = build_model_config("llama", shape["fields"], vocab_size=shape["vocab"])
    net = AutoModelForCausalLM.from_config(config)
    for found in build_converters(TrainingConfig(), "cpu", tensor_parallel=False):
        if found.name == converter:  # as training applies it
            found.convert(net)
    block = shape["block"]
    flops = training_flops_per_token(ModelShape.from_config(config), block, "none")
    rates = []
    for rows in (max(1, 256 // block), shape["batch"]):
        ids = torch.randint(0, shape["vocab"], (rows, block))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            logits = net(input_ids=ids).logits
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
            times.append(time.perf_counter() - start)
            net.zero_grad(set_to_none=True)
        rates.append((ids.numel(), ids.numel() * flops / statistics.median(times[2:]) / 1e12))
    (Path(tmp) / f"rate-{rank}.json").write_text(json.dumps(rates))


def _gloo_probe(rank: int, tmp: str) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    results = {}
    for numel in (256, 4 * 2**20):
        tensor = torch.ones(numel)
        for _ in range(3):
            dist.all_reduce(tensor)
        start = time.perf_counter()
        for _ in range(10):
            dist.all_reduce(tensor)
        results[numel] = (time.perf_counter() - start) / 10
    if rank == 0:
        latency = results[256]
        # A 2-rank ring all-reduce moves 2 (n-1)/n = 1 times the bytes.
        bandwidth = 4 * 4 * 2**20 / (results[4 * 2**20] - latency)
        print(
            f"gloo all-reduce, 2 processes: latency {latency * 1e6:.0f} us, "
            f"bandwidth {bandwidth / 1e9:.2f} GB/s"
        )
    _p2p_probe(rank)
    dist.destroy_process_group()


def _p2p_probe(rank: int) -> None:
    """gloo send/recv between the two processes, as a pipeline stage boundary uses it:
    one way, for a small tensor and a 1 MiB one."""
    small, large = (one_way_send_s((numel,)) for numel in (256, 2**18))
    if rank == 0:
        bandwidth = 4 * (2**18 - 256) / (large - small)
        print(
            f"gloo send/recv, 2 processes: latency {small * 1e6:.0f} us one way, "
            f"bandwidth {bandwidth / 1e9:.2f} GB/s"
        )


if __name__ == "__main__":
    main()
