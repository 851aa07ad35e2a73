"""Ranks and cores: what two ranks per core cost, the figure behind the planner's warning.

`launch.nproc_per_node` larger than the machine's cores is planned (the plan's memory
is held against the host, `planner/host.py`), but warned about with this measurement:
meshtrain's real Trainer on the `--shape` model (the project's default by default), data
parallel at as many ranks as cores, then at twice as many, and the first again (A/A);
the order reverses on odd repeats. Each job takes `batch` blocks per rank per step, so
tokens/s compare the jobs' throughput.

    .venv/bin/python bench/ranks_per_core.py       # ~3 min on 2 cores
"""

from __future__ import annotations

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import datasets  # noqa: E402
import throughput  # noqa: E402  (bench/throughput.py: the meshtrain side and its timing)
from bench_runs import token_blocks, work_root  # noqa: E402
from shapes import SHAPE_FIELDS, SHAPES  # noqa: E402

from meshtrain.config import RunConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    shape = {name: SHAPES[args.shape][name] for name in SHAPE_FIELDS}
    sides = (("one per core", cores), ("two per core", 2 * cores), ("one per core again", cores))
    with contextlib.ExitStack() as stack:
        root = work_root(stack, args.work_dir, "mt-ranks-")
        (root / "runs").mkdir()
        per_run = (args.warmup + args.steps + 3) * shape["batch"] * 2 * cores
        token_blocks(root / "blocks", 2 * per_run, shape["vocab"], shape["block"])
        blocks = datasets.load_from_disk(str(root / "blocks"))
        rates: dict[str, list[float]] = {name: [] for name, _ in sides}
        for repeat in range(args.repeats):
            order = sides if repeat % 2 == 0 else tuple(reversed(sides))
            print(f"repeat {repeat + 1}: {' -> '.join(name for name, _ in order)}", flush=True)
            for name, world in order:
                job = {
                    **shape,
                    "world": world,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "threads": "auto",
                    "bucket_mb": RunConfig.from_params().training.grad_bucket_mb,
                    "device": "cpu",
                }
                tag = f"r{repeat + 1}-{name.replace(' ', '_')}"
                result = throughput.run_one("meshtrain", job, blocks, root, tag, False)
                rates[name].append(result["tokens_per_s"])
        means = {name: statistics.fmean(values) for name, values in rates.items()}
        print()
        print(f"command: .venv/bin/python {' '.join(sys.argv)}")
        print(f"{cores} cores; --shape {args.shape}: {shape}; {time.strftime('%Y-%m-%d %H:%M')}")
        print("| job | ranks | tokens/s per repeat | mean |")
        print("|---|---:|---|---:|")
        for name, world in sides:
            values = ", ".join(f"{value:,.0f}" for value in rates[name])
            print(f"| {name} | {world} | {values} | {means[name]:,.0f} |")
        base = means["one per core"]
        print(f"two per core / one per core: {means['two per core'] / base:.3f}x")
        print(f"one per core again / one per core (A/A): {means['one per core again'] / base:.3f}x")


if __name__ == "__main__":
    main()
