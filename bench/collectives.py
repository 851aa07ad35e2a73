"""Gradient collectives on this machine's backend, side by side: what ZeRO-1 and plain
data parallelism could use to average a flat gradient buffer, and the parameter
all-gather after a ZeRO-1 update.

On one process group (default 2 ranks, gloo, 1 thread each), for a buffer the size of
the default model's (1,787,008 fp32 elements), in alternating rounds:

* `all_reduce`: the whole buffer (data parallelism without ZeRO-1);
* `reduce_scatter_single`: each rank gets the sum of its equal range;
* `reduce to owners`: one `reduce` per owner range, to that owner, started
  asynchronously and then waited for (what `meshtrain.distributed.data_parallel`
  does with a bucket size at least the owned range);
* `reduce to owners, 1 MiB buckets`: the same cut into buckets of about 1 MiB;
* `all_to_all + sum`: `all_to_all_single` of the buffer and a local sum;
* `all_gather_single, in place`: the parameter gather after a ZeRO-1 update.

Prints the median and the best milliseconds per call of each. Nothing is asserted.

    .venv/bin/python bench/collectives.py
    .venv/bin/python bench/collectives.py --numel 50000000 --ranks 2 --rounds 4
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _candidates(numel: int, rank: int, world: int) -> dict[str, Callable[[], None]]:
    grads = torch.randn(numel - numel % world)
    per_rank = grads.numel() // world
    shard = torch.empty(per_rank)
    scratch = torch.empty_like(grads)
    bucket = (2**20) // grads.element_size()
    owners = [(r * per_rank, (r + 1) * per_rank) for r in range(world)]
    small = [
        (lo, min(hi, start + bucket), r)
        for r, (lo, hi) in enumerate(owners)
        for start in range(lo, hi, bucket)
    ]

    def to_owners(pieces: list[tuple[int, int, int]]) -> None:
        _wait([dist.reduce(grads[lo:hi], dst, async_op=True) for lo, hi, dst in pieces])

    def all_to_all_sum() -> None:
        dist.all_to_all_single(scratch, grads)
        torch.sum(scratch.view(world, -1), 0, out=shard)

    return {
        "all_reduce": lambda: dist.all_reduce(grads),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(shard, grads),
        "reduce to owners": lambda: to_owners([(lo, hi, r) for r, (lo, hi) in enumerate(owners)]),
        "reduce to owners, 1 MiB buckets": lambda: to_owners(small),
        "all_to_all + sum": all_to_all_sum,
        "all_gather_single, in place": lambda: dist.all_gather_single(
            grads, grads[rank * per_rank : (rank + 1) * per_rank]
        ),
    }


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend, rank=rank, world_size=args.ranks)
    try:
        candidates = _candidates(args.numel, rank, args.ranks)
        times: dict[str, list[float]] = {name: [] for name in candidates}
        for round_ in range(args.rounds + 1):  # the first round warms up
            names = list(candidates) if round_ % 2 == 0 else list(reversed(candidates))
            for name in names:
                dist.barrier()
                began = time.perf_counter()
                for _ in range(args.calls):
                    candidates[name]()
                if round_:
                    times[name].append((time.perf_counter() - began) / args.calls * 1000)
        if rank == 0:
            print(
                f"{args.ranks} ranks, {args.backend}, {args.numel:,} fp32 elements "
                f"({args.numel * 4 / 2**20:.1f} MiB), {args.rounds} rounds of {args.calls} "
                f"calls, {args.threads} thread(s) per rank; ms per call"
            )
            print("| collective | median | best |")
            print("|---|---:|---:|")
            for name, values in times.items():
                print(f"| {name} | {statistics.median(values):.1f} | {min(values):.1f} |")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1_787_008)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.numel < args.ranks or args.ranks < 2:
        parser.error("--ranks must be at least 2 and --numel at least --ranks")
    mp.spawn(_worker, args=(args, _free_port()), nprocs=args.ranks)


if __name__ == "__main__":
    main()
