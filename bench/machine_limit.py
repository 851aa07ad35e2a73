"""The machine's limit for fp32 training on CPU: the GEMM rate of P processes x T threads.

P spawned processes of T intra-op threads each time n x n fp32 products per library
(`blas`: `torch.mm`; `onednn`: what meshtrain's Linear layers run where
`training.cpu_matmul` picks it), after a warm-up and a barrier; a process's rate is
2 n^3 FLOPs over its median call, an arrangement's the sum over its processes, and its
GEMM rate the best library and size. `bench/throughput.py` reads it for its MFU.

    .venv/bin/python bench/machine_limit.py                  # 1x<cpus> and <cpus>x1, ~15-20 s
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

from meshtrain.models.cpu_linear import onednn_available, onednn_mm_nt

SIZES = (1024, 2048)
LIBRARIES = ("blas", "onednn") if onednn_available() else ("blas",)


def _product(library: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
    """One n x n x n product on `library` (oneDNN's is a @ b.T, the same FLOPs)."""
    if library == "onednn":
        return lambda: onednn_mm_nt(a, b)
    return lambda: torch.mm(a, b, out=out)


def _gemm_worker(
    threads: int,
    sizes: tuple[int, ...],
    libraries: tuple[str, ...],
    warmup: int,
    repeats: int,
    barrier,
    queue,
):
    """One process: per size and library, warm up, meet the others, time `repeats` calls."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    rates: dict[tuple[str, int], float] = {}
    for n in sizes:
        a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        for library in libraries:
            product = _product(library, a, b, out)
            for _ in range(warmup):
                product()
            barrier.wait()
            seconds = []
            for _ in range(repeats):
                began = time.perf_counter()
                product()
                seconds.append(time.perf_counter() - began)
            rates[library, n] = 2 * n**3 / statistics.median(seconds) / 1e9
    queue.put(rates)


def gemm_rate(
    processes: int,
    threads: int,
    sizes: tuple[int, ...] = SIZES,
    libraries: tuple[str, ...] = LIBRARIES,
    warmup: int = 2,
    repeats: int = 10,
) -> dict[str, Any]:
    """GFLOP/s summed over `processes` concurrent processes of `threads` threads each:
    {"by_library": {library: {n: GFLOP/s}}, "best_library": the fastest's name,
    "gflops": the best library's best size}."""
    context = mp.get_context("spawn")
    barrier, queue = context.Barrier(processes), context.Queue()
    args = (threads, sizes, libraries, warmup, repeats, barrier, queue)
    workers = [context.Process(target=_gemm_worker, args=args) for _ in range(processes)]
    for worker in workers:
        worker.start()
    results = [queue.get() for _ in workers]
    for worker in workers:
        worker.join()
        if worker.exitcode:
            raise RuntimeError(f"a GEMM process exited with {worker.exitcode}")
    by_library = {
        library: {n: sum(r[library, n] for r in results) for n in sizes} for library in libraries
    }
    best = max(libraries, key=lambda library: max(by_library[library].values()))
    return {
        "by_library": by_library,
        "best_library": best,
        "gflops": max(by_library[best].values()),
    }


def measure(arrangements: list[tuple[int, int]], **kwargs: Any) -> dict[tuple[int, int], dict]:
    """`gemm_rate` of each (processes, threads) in turn."""
    return {(p, t): gemm_rate(p, t, **kwargs) for p, t in arrangements}


def describe(rates: dict[tuple[int, int], dict]) -> list[str]:
    """One line per arrangement: the best rate, and per library the rate per size."""
    lines = []
    for (p, t), rate in rates.items():
        libraries = "; ".join(
            f"{library} " + ", ".join(f"n={n}: {g:,.1f}" for n, g in by_size.items())
            for library, by_size in rate["by_library"].items()
        )
        lines.append(
            f"  {p} process(es) x {t} thread(s): {rate['gflops']:,.1f} GFLOP/s "
            f"({rate['best_library']}; {libraries})"
        )
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
    parser.add_argument(
        "--libraries", nargs="+", choices=LIBRARIES, default=list(LIBRARIES), help="GEMM libraries"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    began = time.perf_counter()
    rates = measure(
        args.arrangements,
        sizes=tuple(args.sizes),
        libraries=tuple(args.libraries),
        warmup=args.warmup,
        repeats=args.repeats,
    )
    print(
        f"fp32 GEMM GFLOP/s, median of {args.repeats} calls per process after "
        f"{args.warmup} warm-up, summed over the processes; {cpus} CPUs, torch "
        f"{torch.__version__} ({time.perf_counter() - began:.0f}s)"
    )
    print("\n".join(describe(rates)))


if __name__ == "__main__":
    main()
