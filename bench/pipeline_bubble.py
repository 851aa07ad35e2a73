"""Pipeline-parallel bubble benchmark: measured idle fraction beside theory.

For each pipeline size pp (world size = pp, dp = tp = 1) one process group is
spawned with `meshtrain.launch.elastic.run_workers` (process start-up costs more than a
measurement, so every schedule and microbatch count of that pp runs inside the
same group). For each schedule -- GPipe, 1F1B and interleaved 1F1B with v
virtual stages per rank -- and each microbatch count m in {pp, 2pp, 4pp}, the real
`meshtrain.trainer.Trainer` is built from the spec `kedro run` would make (balanced
stages) and trains: 3 steps first (past its memory and timeline probes), then
`--steps` measured `train_step`s with the runner's `SpanRecorder` on. The bubble of
a step is, per rank, the share of the step's
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
    .venv/bin/python bench/pipeline_bubble.py --hidden 64 --layers 4 --seq 32 --pp 2 --steps 1
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
from contextlib import suppress  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_runs import planned_side, step_and_log, token_blocks, trainer_group  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from meshtrain.config import LaunchConfig  # noqa: E402
from meshtrain.distributed.pipeline_parallel import (  # noqa: E402
    Span,
    idle_fraction,
    theoretical_bubble,
)
from meshtrain.launch.elastic import run_workers  # noqa: E402
from meshtrain.trainer import Trainer  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PROBED = 3  # the Trainer's own probes run on its steps 1 (memory) and 2 (timeline)


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


def measure(spec: Any, steps: int) -> dict | None:
    """The real Trainer of one (schedule, v, m): its probed steps, then `steps` measured
    ones; rank 0 gets the spans of every rank and step, the other ranks None."""
    trainer = Trainer(spec)
    trainer.train_start = time.perf_counter()
    for step in range(PROBED):
        step_and_log(trainer, step)
    recorder = trainer.pm.runner.recorder
    measured: list[tuple[list[Span], float]] = []
    for step in range(PROBED, PROBED + steps):
        recorder.spans, recorder.enabled = [], True
        dist.barrier()  # every rank starts the step together
        start = time.perf_counter()
        trainer.train_step(step)
        measured.append((list(recorder.spans), time.perf_counter() - start))
        recorder.enabled = False
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (trainer.dims.pp_rank, measured))
    layout = trainer.layout
    if dist.get_rank() != 0:
        return None
    by_rank = dict(gathered)
    return {
        "schedule": layout.pipeline_schedule,
        "v": layout.pipeline_parallel_virtual_stages,
        "m": layout.pipeline_parallel_num_microbatches,
        # [step] -> {pp rank: spans}
        "spans": [{r: by_rank[r][i][0] for r in by_rank} for i in range(steps)],
        # the step's time: the slowest rank's, from the common start
        "step_s": [max(by_rank[r][i][1] for r in by_rank) for i in range(steps)],
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
def bench_worker(specs: list[Any], job: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Entry point of a spawned rank: every (schedule, m) of this pipeline size."""
    with trainer_group(specs[0], threads=1):  # one core per rank: no fight over threads
        sizes = sorted({job["batch"] // m for _, _, m in job["runs"]})
        shapes = {size: (size, job["seq"], job["hidden"]) for size in sizes}
        send_ms = {size: one_way_send_ms(shape) for size, shape in shapes.items()}
        results = []
        for spec, (schedule, v, m) in zip(specs, job["runs"], strict=True):
            result = measure(spec, job["steps"])
            if result is not None:
                print(f"  pp={job['pp']} {schedule} v={v} m={m} done", flush=True)
                result["send_ms"] = send_ms[job["batch"] // m]
            results.append(result)
        return results if dist.get_rank() == 0 else None


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


def pp_specs(pp: int, runs: list, options: argparse.Namespace, model: dict, root: Path):
    """One planned spec per (schedule, v, m) of this pipeline size, on shared blocks."""
    count = (PROBED + options.steps + 1) * options.batch + 4
    blocks = token_blocks(root / f"blocks-pp{pp}", count, options.vocab, options.seq)
    return [
        planned_side(
            blocks,
            root,
            f"pp{pp}-{schedule}-m{m}",
            world=pp,
            parallel={
                "pipeline_parallel_size": pp,
                "pipeline_schedule": schedule,
                "pipeline_parallel_num_microbatches": m,
                "pipeline_parallel_virtual_stages": v,
            },
            training={
                "per_device_train_batch_size": options.batch,
                "max_steps": PROBED + options.steps,
            },
            shape=model,
            vocab=options.vocab,
            block=options.seq,
        )[0]
        for schedule, v, m in runs
    ]


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    intermediate = options.intermediate or int(round(options.hidden * 8 / 3 / 64)) * 64
    model = {
        "hidden_size": options.hidden,
        "num_hidden_layers": options.layers,
        "num_attention_heads": options.heads,
        "num_key_value_heads": options.kv_heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": max(512, options.seq),
        "tie_word_embeddings": False,
    }
    print(f"command: .venv/bin/python {shlex.join(sys.argv)}")
    print(
        f"llama: {model}, vocab {options.vocab}, seq {options.seq}; torch {torch.__version__}, "
        f"{os.cpu_count()} cpu cores, 1 thread per rank, gloo; measured {options.steps} steps"
    )
    rows: list[dict[str, Any]] = []
    pictures: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as tmp:
        for pp in options.pp:
            runs, skipped = combinations(pp, options.layers, options.virtual)
            for schedule, v, m, why in skipped:
                print(f"pp={pp}: skipping {schedule} v={v} m={m}: {why}")
            specs = pp_specs(pp, runs, options, model, Path(tmp))
            job = {"pp": pp, "runs": runs, "hidden": options.hidden, "seq": options.seq}
            job |= {"batch": options.batch, "steps": options.steps}
            print(f"pp={pp}: {pp} ranks, batch {options.batch} x {options.seq} tokens per step")
            before = cpu_seconds()
            results = run_workers(
                bench_worker,
                (specs, job),
                LaunchConfig(nproc_per_node=pp),
                log_dir=Path(tmp) / "logs" / f"pp{pp}",
                run_id=f"bench-pp{pp}",
            )[0]
            print(f"pp={pp}: {describe_cpu(before, cpu_seconds())}")
            for result in results:
                rows.append(summarise(pp, result))
                if result["m"] == 2 * pp:
                    pictures.append(draw_timeline(pp, result, options.out))
    print(
        "\nbubble: per-rank idle share of the step window (mean over ranks and measured steps; "
        "min-max over ranks); theory: ((p-1)/v)/(m+(p-1)/v); diff: bubble - theory in "
        "points; step s: slowest rank, mean; fwd/bwd ms: mean chunk time; send ms: one-way "
        "gloo send of one microbatch's activation (median ping-pong / 2)"
    )
    print_table(rows)
    print("\n".join(f"timeline: {path}" for path in pictures))


if __name__ == "__main__":
    main()
