"""Pipeline-parallel bubble benchmark: measured idle fraction beside theory.

Per pipeline size pp (world = pp, dp = tp = 1) one spawned gloo group; in it, per
schedule (`--schedules`: GPipe, 1F1B, interleaved 1F1B with v virtual stages, and the
zero-bubble ones, interleaved_zb with v, zbv and dualpipev with two stages a rank in a V)
and microbatch count m in {pp, 2pp, 4pp} where the schedule takes it, the real `Trainer`
(balanced stages) trains past its probed steps, then `--steps` `train_step`s with the
runner's `SpanRecorder` on. A rank's bubble is its idle share of the step's window
(first chunk start to last chunk end, over the ranks), beside the theory (the closed
form, or for a zero-bubble schedule the planner's replay of torch's order on balanced
stages) and the planner's own step time and pipeline share of it; docs/benchmarks.md
("Pipeline parallelism") says what counts as idle. One timeline picture per (pp,
schedule) at m = 2pp goes to `--out`.

    .venv/bin/python bench/pipeline_bubble.py [--hidden 256] [--layers 8] [--seq 128] ...
    .venv/bin/python bench/pipeline_bubble.py --hidden 64 --layers 4 --seq 32 --batch 8 \\
        --pp 2 --steps 1                                          # the smoke run
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_runs import (  # (bench/bench_runs.py, which sets the offline defaults)
    add_model_arguments,
    llama_fields,
    one_way_send_s,
    planned_side,
    step_and_log,
    token_blocks,
    trainer_group,
)
from torch.distributed.elastic.multiprocessing.errors import record

from meshtrain.config import LaunchConfig
from meshtrain.distributed.pipeline_parallel import Span, idle_fraction
from meshtrain.launch.elastic import run_workers
from meshtrain.pipeline_schedules import SCHEDULES, microbatch_rule, stages_per_rank
from meshtrain.planner.schedule_walk import balanced_bubble
from meshtrain.trainer import Trainer

DEFAULT_SCHEDULES = ("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")
PROBED = 3  # the Trainer's own probes run on its steps 1 (memory) and 2 (timeline)


def microbatch_counts(pp: int) -> list[int]:
    return [pp, 2 * pp, 4 * pp]


def combinations(
    pp: int, layers: int, virtual: int, schedules: list[str]
) -> tuple[list[tuple[str, int, int]], list]:
    """(schedule, v, m) to measure for this pp, and the ones skipped with the reason."""
    runs, skipped = [], []
    for schedule in schedules:
        v = stages_per_rank(schedule, virtual)
        for m in microbatch_counts(pp):
            reason = microbatch_rule(schedule, m, pp)
            if layers < pp * v:
                skipped.append((schedule, v, m, f"{layers} layers < {pp * v} stages"))
            elif reason:
                skipped.append((schedule, v, m, reason))
            else:
                runs.append((schedule, v, m))
    return runs, skipped


def measure(spec: Any, steps: int) -> dict | None:
    """The real Trainer of one (schedule, v, m): its probed steps, then `steps` measured
    ones; rank 0 gets the spans of every rank and step, the other ranks None."""
    trainer = Trainer(spec)
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


@record
def bench_worker(specs: list[Any], job: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Entry point of a spawned rank: every (schedule, m) of this pipeline size."""
    with trainer_group(specs[0], threads=1):  # one core per rank: no fight over threads
        sizes = sorted({job["batch"] // m for _, _, m in job["runs"]})
        shapes = {size: (size, job["seq"], job["hidden"]) for size in sizes}
        send_s = {size: one_way_send_s(shape) for size, shape in shapes.items()}
        results = []
        for spec, (schedule, v, m) in zip(specs, job["runs"], strict=True):
            result = measure(spec, job["steps"])
            if result is not None:
                print(f"  pp={job['pp']} {schedule} v={v} m={m} done", flush=True)
                result["send_ms"] = 1e3 * send_s[job["batch"] // m]
            results.append(result)
        return results if dist.get_rank() == 0 else None


def summarise(pp: int, result: dict[str, Any]) -> dict[str, Any]:
    """Per-rank idle fraction averaged over the measured steps, chunk times, theory."""
    per_step = [idle_fraction(spans) for spans in result["spans"]]
    ranks = sorted(per_step[0])
    per_rank = [statistics.mean(step[r] for step in per_step) for r in ranks]
    every = [s for spans in result["spans"] for rank in spans.values() for s in rank]
    forward = [s.end - s.start for s in every if s.kind == "forward"]
    backward = [s.end - s.start for s in every if s.kind != "forward"]
    measured = statistics.mean(per_rank)
    theory = balanced_bubble(result["schedule"], pp, result["m"], result["v"])
    step_s = statistics.mean(result["step_s"])
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
        "step_s": step_s,
        "tokens_per_s": result["tokens"] / step_s,
        "planned_step_s": result["planned"]["step_s"],
        "planned_bubble": result["planned"]["pipeline_s"] / result["planned"]["step_s"],
        "send_ms": result["send_ms"],
        "forward_ms": 1e3 * statistics.mean(forward),
        "backward_ms": 1e3 * statistics.mean(backward),
    }


def draw_timeline(pp: int, result: dict[str, Any], out: Path) -> Path:
    from meshtrain.tracking.plots import pipeline_timeline

    spans = result["spans"][-1]  # the last measured step
    idle = idle_fraction(spans)
    measured = statistics.mean(idle.values())
    schedule, v, m = result["schedule"], result["v"], result["m"]
    theory = balanced_bubble(schedule, pp, m, v)
    label = f"{schedule} (v={v})" if v > 1 else schedule
    return pipeline_timeline(
        spans,
        out / f"pipeline_timeline_{schedule}_pp{pp}.png",
        f"{label}, pp={pp}, {m} microbatches: measured bubble {measured:.0%}, theory {theory:.0%}",
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'pp':>2}  {'schedule':<16} {'v':>1}  {'m':>2}  {'bubble':>6}  {'min-max':>11}  "
        f"{'theory':>6}  {'diff':>6}  {'step s':>6}  {'tokens/s':>8}  {'plan s':>6}  "
        f"{'plan bub':>8}  {'fwd/bwd ms':>10}  {'send ms':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        span = f"{row['bubble_min']:.1%}-{row['bubble_max']:.1%}"
        chunks = f"{row['forward_ms']:.0f}/{row['backward_ms']:.0f}"
        print(
            f"{row['pp']:>2}  {row['schedule']:<16} {row['v']:>1}  {row['m']:>2}  "
            f"{row['bubble']:>6.1%}  {span:>11}  {row['theory']:>6.1%}  "
            f"{row['diff_points']:>+6.1f}  {row['step_s']:>6.2f}  {row['tokens_per_s']:>8.0f}  "
            f"{row['planned_step_s']:>6.2f}  {row['planned_bubble']:>8.1%}  {chunks:>10}  "
            f"{row['send_ms']:>7.2f}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, 256, None, 8, 4, 4, 512, 128, 16)  # --batch: for every pp
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--virtual", type=int, default=2, help="v of the interleaved schedules")
    parser.add_argument(
        "--schedules", nargs="+", default=list(DEFAULT_SCHEDULES), choices=SCHEDULES
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(tempfile.gettempdir()) / "meshtrain-bench" / "pipeline_bubble",
        help="folder for the timeline pictures",
    )
    options = parser.parse_args(argv)
    for pp in options.pp:
        if pp < 2 or options.batch % (4 * pp):
            parser.error(f"pp={pp}: pp must be >= 2 and --batch divisible by {4 * pp}")
    return options


def pp_specs(pp: int, runs: list, options: argparse.Namespace, model: dict, root: Path):
    """One planned spec per (schedule, v, m) of this pipeline size, on shared blocks, and
    its plan's time estimate."""
    count = (PROBED + options.steps + 1) * options.batch + 4
    blocks = token_blocks(root / f"blocks-pp{pp}", count, options.vocab, options.seq)
    sides = [
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
        )
        for schedule, v, m in runs
    ]
    return [spec for spec, _ in sides], [plan.time_estimate for _, plan in sides]


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    model = llama_fields(options)
    print(f"command: .venv/bin/python {shlex.join(sys.argv)}")
    print(
        f"llama: {model}, vocab {options.vocab}, seq {options.seq}; torch {torch.__version__}, "
        f"{os.cpu_count()} cpu cores, 1 thread per rank, gloo; measured {options.steps} steps"
    )
    rows: list[dict[str, Any]] = []
    pictures: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as tmp:
        for pp in options.pp:
            runs, skipped = combinations(pp, options.layers, options.virtual, options.schedules)
            for schedule, v, m, why in skipped:
                print(f"pp={pp}: skipping {schedule} v={v} m={m}: {why}")
            specs, planned = pp_specs(pp, runs, options, model, Path(tmp))
            job = {"pp": pp, "runs": runs, "hidden": options.hidden, "seq": options.seq}
            job |= {"batch": options.batch, "steps": options.steps}
            print(f"pp={pp}: {pp} ranks, batch {options.batch} x {options.seq} tokens per step")
            started = time.perf_counter()
            results = run_workers(
                bench_worker,
                (specs, job),
                LaunchConfig(nproc_per_node=pp),
                log_dir=Path(tmp) / "logs" / f"pp{pp}",
                run_id=f"bench-pp{pp}",
            )[0]
            # (Not "what other processes used": warm ranks are not this process's children.)
            print(f"pp={pp}: {time.perf_counter() - started:.0f}s with process start-up")
            for result, estimate in zip(results, planned, strict=True):
                result |= {"planned": estimate, "tokens": options.batch * options.seq}
                rows.append(summarise(pp, result))
                if result["m"] == 2 * pp:
                    pictures.append(draw_timeline(pp, result, options.out))
    print(
        "\nbubble: per-rank idle share of the step window (mean over ranks and measured steps; "
        "min-max over ranks); theory: ((p-1)/v)/(m+(p-1)/v), for a zero-bubble schedule the "
        "planner's replay of torch's order; diff: bubble - theory in points; step s: "
        "slowest rank, mean; plan s, plan bub: the planner's step time and its pipeline "
        "share; fwd/bwd ms: mean chunk time (a weight-gradient chunk counts as backward); "
        "send ms: one-way gloo send of one microbatch's activation (median ping-pong / 2)"
    )
    print_table(rows)
    print("\n".join(f"timeline: {path}" for path in pictures))


if __name__ == "__main__":
    main()
