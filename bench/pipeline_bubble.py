"""Pipeline-parallel bubble benchmark: measured idle fraction beside theory.

For each pipeline size pp (world size = pp, dp = tp = 1) one process group is
spawned with `meshtrain.launch.elastic.run_workers` (process start-up costs more than a
measurement, so every schedule and microbatch count of that pp runs inside the
same group). For each schedule -- GPipe, 1F1B and interleaved 1F1B with v
virtual stages per rank -- and each microbatch count m in {pp, 2pp, 4pp}, the
model is built and parallelised as `meshtrain.trainer.Trainer` does
(`build_model` -> `meshtrain.models.llama.parallelize.parallelize` with a `Layout` whose
stages are balanced), then trained on one random token batch per step:
`--warmup` steps first, then `--steps` measured steps with the runner's
`SpanRecorder` on. The bubble of a step is, per rank, the share of the step's
wall window (first forward start to last backward end, over all ranks) spent
outside any forward or backward chunk (`idle_fraction`); it is averaged over
the measured steps and shown beside `theoretical_bubble`:
(p-1)/(m+p-1) for GPipe and 1F1B, ((p-1)/v)/(m+(p-1)/v) interleaved.

Everything outside a chunk counts as idle: waiting for a neighbour (the bubble
proper), the point-to-point sends and receives, the schedule's own Python, and
the loss on the last stage (torch computes it between the last stage's forward
and backward chunks). The model must therefore be large enough that a chunk
takes much longer than a send; the vocabulary is kept small so that the first
(embedding) and last (norm, LM head) stages cost about what the others do.

One timeline picture per (pp, schedule) at m = 2pp is written to `--out`
(a folder outside the repository by default). Nothing is asserted; the script
fails only if a rank fails.

    .venv/bin/python bench/pipeline_bubble.py [--hidden 256] [--layers 8] [--seq 128] ...
"""

from __future__ import annotations

import os

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import argparse  # noqa: E402
import resource  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext, suppress  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from meshtrain.config import LaunchConfig, Layout  # noqa: E402
from meshtrain.distributed.parallel_dims import ParallelDims  # noqa: E402
from meshtrain.distributed.pipeline_parallel import (  # noqa: E402
    Span,
    idle_fraction,
    theoretical_bubble,
)
from meshtrain.launch.elastic import run_workers  # noqa: E402
from meshtrain.models import build_model, build_model_config  # noqa: E402
from meshtrain.models.llama.parallelize import parallelize  # noqa: E402
from meshtrain.planner.checks import balanced_split  # noqa: E402

SEED = 1234
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
ENV_PREFIX = (
    "KEDRO_DISABLE_TELEMETRY=true DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true "
    "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1"
)


def microbatch_counts(pp: int) -> list[int]:
    return [pp, 2 * pp, 4 * pp]


def combinations(pp: int, layers: int, virtual: int) -> tuple[list[tuple[str, int, int]], list]:
    """(schedule, v, m) to measure for this pp, and the ones skipped with the reason."""
    runs, skipped = [], []
    for schedule in SCHEDULES:
        v = virtual if schedule == "interleaved_1f1b" else 1
        for m in microbatch_counts(pp):
            if layers < pp * v:
                skipped.append((schedule, v, m, f"{layers} layers < {pp * v} stages"))
            elif schedule == "interleaved_1f1b" and m % pp:
                skipped.append((schedule, v, m, f"m is not a multiple of pp={pp}"))
            else:
                runs.append((schedule, v, m))
    return runs, skipped


# --------------------------------------------------------------------------- on every rank


def measure(job: dict[str, Any], dims: ParallelDims, schedule: str, v: int, m: int) -> dict:
    """Warm up, then time `steps` training steps of one (schedule, v, m); rank 0 gets the
    spans of every rank and step, the other ranks None."""
    pp = dims.pp
    layout = Layout(
        data_parallel_size=1,
        tensor_parallel_size=1,
        pipeline_parallel_size=pp,
        pipeline_parallel_num_microbatches=m,
        pipeline_schedule=schedule,
        sequence_parallel=False,
        zero_1=False,
        activation_checkpointing="none",
        activation_offloading=False,
        pipeline_parallel_virtual_stages=v,
        pipeline_parallel_layers=balanced_split(job["layers"], pp * v),
    )
    config = build_model_config("llama", job["model"], vocab_size=job["vocab"])
    model = build_model(config, seed=SEED)
    pm = parallelize(model, dims, layout, torch.device("cpu"), nullcontext)
    del model
    pm.set_training(True)
    # The same batch on every rank (only the first and last stages read it).
    generator = torch.Generator().manual_seed(SEED)
    input_ids = torch.randint(0, job["vocab"], (job["batch"], job["seq"]), generator=generator)

    steps: list[tuple[list[Span], float]] = []
    for step in range(job["warmup"] + job["steps"]):
        measured = step >= job["warmup"]
        pm.runner.recorder.spans = []
        pm.runner.recorder.enabled = measured
        dist.barrier()  # every rank starts the step together
        start = time.perf_counter()
        pm.train_batch(input_ids, accumulation_steps=1)
        elapsed = time.perf_counter() - start
        pm.runner.recorder.enabled = False
        for parameter in pm.parameters.values():
            if parameter.grad is not None:
                parameter.grad.zero_()
        if measured:
            steps.append((list(pm.runner.recorder.spans), elapsed))

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dims.pp_rank, steps))
    del pm
    if dist.get_rank() != 0:
        return None
    by_rank = dict(gathered)
    return {
        "schedule": schedule,
        "v": v,
        "m": m,
        # [step] -> {pp rank: spans}
        "spans": [{r: by_rank[r][i][0] for r in by_rank} for i in range(job["steps"])],
        # the step's time: the slowest rank's, from the common start
        "step_s": [max(by_rank[r][i][1] for r in by_rank) for i in range(job["steps"])],
    }


def one_way_send_ms(shape: tuple[int, ...], rounds: int = 20) -> float | None:
    """Median one-way time (half a round trip) of one activation of `shape` between ranks 0
    and 1 with plain gloo send/recv: the floor under every hop between stages. Collective;
    rank 0 gets the time, the others None."""
    rank = dist.get_rank()
    buffer = torch.randn(shape)
    times = []
    dist.barrier()
    for _ in range(3 + rounds):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        times.append(time.perf_counter() - start)
    dist.barrier()
    return 1e3 * statistics.median(times[3:]) / 2 if rank == 0 else None


@record
def bench_worker(job: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Entry point of a spawned rank: every (schedule, m) of this pipeline size."""
    torch.set_num_threads(1)  # one core per rank; the ranks must not fight over threads
    dist.init_process_group("gloo")
    try:
        dims = ParallelDims.build(1, 1, job["pp"], "cpu")
        sizes = sorted({job["batch"] // m for _, _, m in job["runs"]})
        shapes = {size: (size, job["seq"], job["model"]["hidden_size"]) for size in sizes}
        send_ms = {size: one_way_send_ms(shape) for size, shape in shapes.items()}
        results = []
        for schedule, v, m in job["runs"]:
            result = measure(job, dims, schedule, v, m)
            if dist.get_rank() == 0:
                print(f"  pp={job['pp']} {schedule} v={v} m={m} done", flush=True)
            if result is not None:
                result["send_ms"] = send_ms[job["batch"] // m]
            results.append(result)
        return results if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- summary


def summarise(pp: int, result: dict[str, Any]) -> dict[str, Any]:
    """Per-rank idle fraction averaged over the measured steps, chunk times, theory."""
    per_step = [idle_fraction(spans) for spans in result["spans"]]
    ranks = sorted(per_step[0])
    per_rank = [statistics.mean(step[r] for step in per_step) for r in ranks]
    every = [s for spans in result["spans"] for rank in spans.values() for s in rank]
    forward = [s.end - s.start for s in every if s.kind == "forward"]
    backward = [s.end - s.start for s in every if s.kind == "backward"]
    measured = statistics.mean(per_rank)
    theory = theoretical_bubble(pp, result["m"], result["v"])
    return {
        "pp": pp,
        "schedule": result["schedule"],
        "v": result["v"],
        "m": result["m"],
        "bubble": measured,
        "bubble_min": min(per_rank),
        "bubble_max": max(per_rank),
        "theory": theory,
        "diff_points": 100 * (measured - theory),
        "step_s": statistics.mean(result["step_s"]),
        "send_ms": result["send_ms"],
        "forward_ms": 1e3 * statistics.mean(forward),
        "backward_ms": 1e3 * statistics.mean(backward),
    }


def draw_timeline(pp: int, result: dict[str, Any], out: Path) -> Path:
    from meshtrain.tracking.plots import pipeline_timeline

    spans = result["spans"][-1]  # the last measured step
    idle = idle_fraction(spans)
    measured = statistics.mean(idle.values())
    theory = theoretical_bubble(pp, result["m"], result["v"])
    schedule, v, m = result["schedule"], result["v"], result["m"]
    label = f"{schedule} (v={v})" if v > 1 else schedule
    return pipeline_timeline(
        spans,
        out / f"pipeline_timeline_{schedule}_pp{pp}.png",
        f"{label}, pp={pp}, {m} microbatches: measured bubble {measured:.0%}, theory {theory:.0%}",
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'pp':>2}  {'schedule':<16} {'v':>1}  {'m':>2}  {'bubble':>6}  {'min-max':>11}  "
        f"{'theory':>6}  {'diff':>6}  {'step s':>6}  {'fwd/bwd ms':>10}  {'send ms':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        span = f"{row['bubble_min']:.1%}-{row['bubble_max']:.1%}"
        chunks = f"{row['forward_ms']:.0f}/{row['backward_ms']:.0f}"
        print(
            f"{row['pp']:>2}  {row['schedule']:<16} {row['v']:>1}  {row['m']:>2}  "
            f"{row['bubble']:>6.1%}  {span:>11}  {row['theory']:>6.1%}  "
            f"{row['diff_points']:>+6.1f}  {row['step_s']:>6.2f}  {chunks:>10}  "
            f"{row['send_ms']:>7.2f}"
        )


# --------------------------------------------------------------------------- main


def cpu_seconds() -> tuple[float, float | None, float]:
    """(wall clock, CPU seconds the whole machine spent busy or None off Linux, CPU seconds
    this process and its finished children used)."""
    machine = None
    with suppress(OSError, ValueError):
        with open("/proc/stat") as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
        machine = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    ours = sum(
        usage.ru_utime + usage.ru_stime
        for usage in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
    )
    return time.perf_counter(), machine, ours


def describe_cpu(before: tuple, after: tuple) -> str:
    """Wall time of a group and how much of the machine other processes took meanwhile:
    a shared machine stretches chunks and so moves the measured bubble."""
    wall = after[0] - before[0]
    text = f"{wall:.0f}s with process start-up"
    if before[1] is not None and after[1] is not None:
        others = max(0.0, (after[1] - before[1]) - (after[2] - before[2]))
        text += (
            f"; other processes used {others / (wall * (os.cpu_count() or 1)):.0%} of "
            f"the {os.cpu_count()} cores meanwhile"
        )
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=None, help="default ~8/3 hidden")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument(
        "--batch",
        type=int,
        default=16,
        help="sequences per step, the same for every pp; must be divisible by 4*pp "
        "(at pp=2: 8 sequences per microbatch at m=2, 2 at m=8)",
    )
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--virtual", type=int, default=2, help="v of interleaved 1F1B")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(tempfile.gettempdir()) / "meshtrain-bench" / "pipeline_bubble",
        help="folder for the timeline pictures (bench/out/ is not git-ignored)",
    )
    options = parser.parse_args(argv)
    for pp in options.pp:
        if pp < 2 or options.batch % (4 * pp):
            parser.error(f"pp={pp}: pp must be >= 2 and --batch divisible by {4 * pp}")
    return options


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    intermediate = options.intermediate or int(round(options.hidden * 8 / 3 / 64)) * 64
    model = {
        "hidden_size": options.hidden,
        "num_hidden_layers": options.layers,
        "num_attention_heads": options.heads,
        "num_key_value_heads": options.kv_heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": options.seq,
        "tie_word_embeddings": False,
    }
    spelled = [
        *("--hidden", options.hidden, "--layers", options.layers, "--heads", options.heads),
        *("--kv-heads", options.kv_heads, "--intermediate", intermediate),
        *("--vocab", options.vocab, "--seq", options.seq, "--batch", options.batch),
        *("--pp", *options.pp, "--virtual", options.virtual),
        *("--warmup", options.warmup, "--steps", options.steps, "--out", options.out),
    ]
    command = " ".join(shlex.quote(str(a)) for a in [".venv/bin/python", sys.argv[0], *spelled])
    print(f"reproduce: {ENV_PREFIX} {command}")
    print(
        f"llama: hidden {options.hidden}, {options.layers} layers, {options.heads} heads "
        f"({options.kv_heads} kv), intermediate {intermediate}, vocab {options.vocab}, "
        f"seq {options.seq}; torch {torch.__version__}, {os.cpu_count()} cpu cores, "
        f"1 thread per rank, gloo; warm-up {options.warmup}, measured {options.steps} steps"
    )

    rows: list[dict[str, Any]] = []
    pictures: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as logs:
        for pp in options.pp:
            runs, skipped = combinations(pp, options.layers, options.virtual)
            for schedule, v, m, why in skipped:
                print(f"pp={pp}: skipping {schedule} v={v} m={m}: {why}")
            job = {
                "pp": pp,
                "runs": runs,
                "model": model,
                "layers": options.layers,
                "vocab": options.vocab,
                "seq": options.seq,
                "batch": options.batch,
                "warmup": options.warmup,
                "steps": options.steps,
            }
            print(f"pp={pp}: {pp} ranks, batch {options.batch} x {options.seq} tokens per step")
            before = cpu_seconds()
            results = run_workers(
                bench_worker,
                (job,),
                LaunchConfig(nproc_per_node=pp),
                log_dir=Path(logs) / f"pp{pp}",
                run_id=f"bench-pp{pp}",
            )[0]
            print(f"pp={pp}: {describe_cpu(before, cpu_seconds())}")
            for result in results:
                rows.append(summarise(pp, result))
                if result["m"] == 2 * pp:
                    pictures.append(draw_timeline(pp, result, options.out))

    print()
    print(
        "bubble: per-rank idle share of the step window (mean over ranks and measured steps; "
        "min-max over ranks); theory: ((p-1)/v)/(m+(p-1)/v); diff: bubble - theory in "
        "points; step s: slowest rank, mean; fwd/bwd ms: mean chunk time; send ms: one-way "
        "gloo send of one microbatch's activation (median ping-pong / 2)"
    )
    print_table(rows)
    print()
    for path in pictures:
        print(f"timeline: {path}")


if __name__ == "__main__":
    main()
