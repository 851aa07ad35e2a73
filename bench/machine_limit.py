"""The machine's limit for fp32 training on CPU: the GEMM rate of P processes x T threads.

P processes are spawned together (torch.multiprocessing, spawn), each with T intra-op
threads; each builds two square fp32 matrices per size n, runs `warmup` untimed
`torch.mm`s, waits at a barrier for the others, then times `repeats` calls one by one.
A process's rate is 2 n^3 FLOPs over its median call; the arrangement's rate is the
sum over its processes, per n. The GEMM rate of an arrangement is the best of its sizes:
what those cores reach on the operation a transformer step spends most of its FLOPs in.
`bench/throughput.py` measures the arrangements its sides run, at its start and its end.

    .venv/bin/python bench/machine_limit.py                  # 1x<cpus> and <cpus>x1, ~10-15 s
    .venv/bin/python bench/machine_limit.py --arrangements 1x1 2x1 --sizes 1024 2048 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp

SIZES = (1024, 2048)


def _gemm_worker(threads: int, sizes: tuple[int, ...], warmup: int, repeats: int, barrier, queue):
    """One process: per size, warm up, meet the others, time `repeats` mm calls."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    rates: dict[int, float] = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        for _ in range(warmup):
            torch.mm(a, b, out=out)
        barrier.wait()
        seconds = []
        for _ in range(repeats):
            began = time.perf_counter()
            torch.mm(a, b, out=out)
            seconds.append(time.perf_counter() - began)
        rates[n] = 2 * n**3 / statistics.median(seconds) / 1e9
    queue.put(rates)


def gemm_rate(
    processes: int,
    threads: int,
    sizes: tuple[int, ...] = SIZES,
    warmup: int = 2,
    repeats: int = 10,
) -> dict[str, Any]:
    """GFLOP/s summed over `processes` concurrent processes of `threads` threads each:
    {"by_size": {n: GFLOP/s}, "gflops": the best size's}."""
    context = mp.get_context("spawn")
    barrier, queue = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(target=_gemm_worker, args=(threads, sizes, warmup, repeats, barrier, queue))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    results = [queue.get() for _ in workers]
    for worker in workers:
        worker.join()
        if worker.exitcode:
            raise RuntimeError(f"a GEMM process exited with {worker.exitcode}")
    by_size = {n: sum(r[n] for r in results) for n in sizes}
    return {"by_size": by_size, "gflops": max(by_size.values())}


def measure(arrangements: list[tuple[int, int]], **kwargs: Any) -> dict[tuple[int, int], dict]:
    """`gemm_rate` of each (processes, threads) in turn."""
    return {(p, t): gemm_rate(p, t, **kwargs) for p, t in arrangements}


def describe(rates: dict[tuple[int, int], dict]) -> list[str]:
    """One line per arrangement: the rate per size and the best."""
    lines = []
    for (p, t), rate in rates.items():
        sizes = ", ".join(f"n={n}: {g:,.1f}" for n, g in rate["by_size"].items())
        lines.append(f"  {p} process(es) x {t} thread(s): {rate['gflops']:,.1f} GFLOP/s ({sizes})")
    return lines


def _arrangement(text: str) -> tuple[int, int]:
    processes, _, threads = text.partition("x")
    if not (processes.isdigit() and threads.isdigit() and int(processes) and int(threads)):
        raise argparse.ArgumentTypeError(f"PxT with positive integers, not {text!r}")
    return int(processes), int(threads)


def main() -> None:
    cpus = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--arrangements",
        type=_arrangement,
        nargs="+",
        default=sorted({(1, cpus), (cpus, 1)}),
        help="processes x threads, e.g. 1x2 2x1 (default: 1x<cpus> and <cpus>x1)",
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    began = time.perf_counter()
    rates = measure(
        args.arrangements, sizes=tuple(args.sizes), warmup=args.warmup, repeats=args.repeats
    )
    print(
        f"fp32 torch.mm GFLOP/s, median of {args.repeats} calls per process after "
        f"{args.warmup} warm-up, summed over the processes; {cpus} CPUs, torch "
        f"{torch.__version__} ({time.perf_counter() - began:.0f}s)"
    )
    print("\n".join(describe(rates)))


if __name__ == "__main__":
    main()
