"""Start-up: how long a user waits before meshtrain answers, and before ranks are ready.

Commands, this tree against another commit: each figure is the wall time of a whole
command, as a user meets it, run `--repeats` times on each side: the other commit
(`--base`, checked out in a temporary git worktree and run with this venv, its own
`src/` first on the path), this tree, and this tree again (the A/A control: what the
machine's noise alone moves). The order of the sides reverses on odd repeats.
- refused: `kedro run --params consolidation.dtype=int8`, refused before any node;
- plan: `python -m meshtrain plan` for Llama-3.1-8B on 8 H100s (README's example).

Ranks, at 2 and 4 ranks on this machine: seconds from `run_workers` until every rank
has imported the trainer (the rest of the way to the first step is the same either
way), and the ranks' memory with the warm server's (the sum of their proportional set
sizes, which counts a page shared copy-on-write once, and of their resident sets), for
ranks spawned
(`launch.warm_ranks=false`), forked from a warm server started for the launch (a `kedro
run`), from a server already running (a test session), and spawned again (A/A).

First step, at 2 and 4 ranks: seconds from `kedro run --pipeline training` until rank
0 prints its first step (on this tree's data/, planned by each tree for that many ranks
first), for
the base commit, this tree with spawned ranks, with warm ones, and warm again (A/A).

Printed: min / median / max per side, and the ratios of the medians.

    .venv/bin/kedro run                                     # data/ for the first step
    .venv/bin/python bench/startup.py --base 014483f        # ~20 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing.forkserver as forkserver
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from meshtrain.config import LaunchConfig
from meshtrain.launch.elastic import run_workers

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "refused kedro run": (
        [sys.executable, "-m", "kedro", "run", "--params", "consolidation.dtype=int8"],
        "consolidation.dtype",  # in the refusal, with a non-zero exit
    ),
    "python -m meshtrain plan": (
        [
            sys.executable,
            "-m",
            "meshtrain",
            "plan",
            "--model",
            "examples/model_configs/llama-3.1-8b.json",
            "--devices",
            "8",
            "--device",
            "h100",
            "--seq-len",
            "4096",
            "--global-batch",
            "256",
            "--bf16",
        ],
        "dp",  # the chosen layout's name
    ),
}

QUIET = {
    "KEDRO_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A detached checkout of `rev` beside this one, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="mt-startup-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(path), rev],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            (path / "conf" / "local").mkdir(parents=True, exist_ok=True)
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT)


def timed(tree: Path, command: list[str], expect: str) -> float:
    """Seconds `command` takes in `tree` (its own package first on the path)."""
    env = {**os.environ, **QUIET, "PYTHONPATH": str(tree / "src")}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if expect not in done.stdout + done.stderr:
        raise SystemExit(f"{' '.join(command[1:4])} in {tree}: no {expect!r} in its output")
    return seconds


def alternated(
    sides: tuple[tuple[str, Any], ...], repeats: int, measure: Callable[[Any], float]
) -> dict[str, list[float]]:
    """Each side (name, what `measure` takes) measured `repeats` times, in reversed order on
    odd repeats, so a drift of the machine's speed weighs on every side alike."""
    times: dict[str, list[float]] = {name: [] for name, _ in sides}
    for repeat in range(repeats):
        for side in sides if repeat % 2 == 0 else sides[::-1]:
            times[side[0]].append(measure(side))
    return times


def print_sides(title: str, times: dict[str, list[float]]) -> None:
    print(title)
    for side, values in times.items():
        print(f"  {side:<24} {summary(values)}")


def summary(values: list[float]) -> str:
    return f"{min(values):5.2f} / {statistics.median(values):5.2f} / {max(values):5.2f} s"


@record
def rank_ready() -> dict[str, Any]:
    """On a rank: import what a training rank imports; when, and the rank's memory."""
    import meshtrain.launch.worker  # noqa: F401, PLC0415  (a no-op on a warm rank)

    return {"ready": time.time(), **memory_mib(os.getpid())}


def memory_mib(pid: int) -> dict[str, float]:
    """A process's proportional and resident set sizes, in MiB."""
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().split("\n")
    kib = {line.split(":")[0]: int(line.split()[1]) for line in rollup if line.endswith("kB")}
    return {"pss": kib["Pss"] / 1024, "rss": kib["Rss"] / 1024}


def launch_ranks(world: int, side: str, root: Path) -> tuple[float, float, float]:
    """(seconds until every rank is ready, MiB of PSS, MiB of RSS): the ranks' summed,
    with the warm server's (which holds the pages they share)."""
    if side == "warm, server started for the launch":
        forkserver._forkserver._stop()
    warm = side.startswith("warm")
    launch = LaunchConfig(nproc_per_node=world, warm_ranks=warm)
    start = time.time()
    ranks = run_workers(rank_ready, (), launch, log_dir=root / "logs", run_id="startup")
    ready = max(r["ready"] for r in ranks.values()) - start
    memory = list(ranks.values())
    if warm:
        memory.append(memory_mib(forkserver._forkserver._forkserver_pid))
    return ready, sum(m["pss"] for m in memory), sum(m["rss"] for m in memory)


RANK_SIDES = (
    "spawned",
    "warm, server started for the launch",
    "warm, server running",
    "spawned again",
)


def rank_figures(repeats: int) -> None:
    with tempfile.TemporaryDirectory(prefix="mt-ranks-") as tmp:
        for world in (2, 4):
            ready: dict[str, list[float]] = {side: [] for side in RANK_SIDES}
            pss: dict[str, list[float]] = {side: [] for side in RANK_SIDES}
            rss: dict[str, list[float]] = {side: [] for side in RANK_SIDES}
            for repeat in range(repeats):
                order = RANK_SIDES if repeat % 2 == 0 else tuple(reversed(RANK_SIDES))
                for side in order:
                    seconds, pss_mib, rss_mib = launch_ranks(world, side, Path(tmp))
                    ready[side].append(seconds)
                    pss[side].append(pss_mib)
                    rss[side].append(rss_mib)
            print(f"ranks ready, {world} ranks (min / median / max of {repeats})")
            for side in RANK_SIDES:
                print(
                    f"  {side:<36} {summary(ready[side])}; PSS "
                    f"{statistics.median(pss[side]):,.0f} MiB, RSS "
                    f"{statistics.median(rss[side]):,.0f} MiB (medians, ranks and server)"
                )
            median = {side: statistics.median(values) for side, values in ready.items()}
            spawned = median["spawned"]
            print(
                f"  warm / spawned: server started {median[RANK_SIDES[1]] / spawned:.2f}, "
                f"running {median[RANK_SIDES[2]] / spawned:.2f}; "
                f"A/A {median['spawned again'] / spawned:.2f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=("commands", "ranks", "first-step"), default=None)
    args = parser.parse_args()
    if args.only in (None, "commands"):
        command_figures(args.base, args.repeats)
    if args.only in (None, "ranks"):
        rank_figures(args.repeats)
    if args.only in (None, "first-step"):
        first_step_figures(args.base, args.repeats)


def command_figures(base_rev: str, repeats: int) -> None:
    with worktree(base_rev) as base:
        sides = (("base", base), ("this tree", ROOT), ("this tree again", ROOT))
        for name, (command, expect) in COMMANDS.items():
            times = alternated(
                sides, repeats, lambda side, c=command, e=expect: timed(side[1], c, e)
            )
            print_sides(f"{name} (min / median / max of {repeats})", times)
            median = {side: statistics.median(values) for side, values in times.items()}
            print(
                f"  this / base {median['this tree'] / median['base']:.2f}, "
                f"A/A {median['this tree again'] / median['this tree']:.2f}",
                flush=True,
            )


def until_first_step(tree: Path, world: int, params: str) -> float:
    """Seconds from `kedro run --pipeline training` in `tree` (on this tree's data/) to rank
    0's first step line; the run then finishes its two steps."""
    params = f"launch.nproc_per_node={world},training.max_steps=2,training.log_every=1{params}"
    command = [sys.executable, "-m", "kedro", "run", "--pipeline", "training", "--params", params]
    env = {**os.environ, **QUIET, "PYTHONPATH": str(tree / "src")}
    start = time.perf_counter()
    run = subprocess.Popen(
        command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seconds = None
    for line in run.stdout:
        if seconds is None and "[rank0] step 1/" in line:
            seconds = time.perf_counter() - start
    if run.wait() != 0 or seconds is None:
        raise SystemExit(f"kedro run --pipeline training in {tree} failed (rc {run.returncode})")
    return seconds


FIRST_STEP_SIDES = (
    ("base", ""),
    ("this tree, spawned", ",launch.warm_ranks=false"),
    ("this tree, warm", ""),
    ("this tree, warm again", ""),
)


def first_step_figures(base_rev: str, repeats: int) -> None:
    with worktree(base_rev) as base:
        # This tree's data (its blocks and tokenizer), each tree planning it itself: a
        # plan.json is refused by a tree whose plan inputs it was not made from.
        shutil.rmtree(base / "data")
        unused = shutil.ignore_patterns("06_models", "07_model_output", "08_reporting")
        shutil.copytree(ROOT / "data", base / "data", ignore=unused)
        for world in (2, 4):
            plan = [sys.executable, "-m", "kedro", "run", "--pipeline", "planning", "--params"]
            for tree in (ROOT, base):
                timed(tree, [*plan, f"launch.nproc_per_node={world}"], "plan")
            times = alternated(
                FIRST_STEP_SIDES,
                repeats,
                lambda side, w=world: until_first_step(
                    base if side[0] == "base" else ROOT, w, side[1]
                ),
            )
            print_sides(f"first step, {world} ranks (min / median / max of {repeats})", times)
            median = {side: statistics.median(values) for side, values in times.items()}
            print(
                f"  warm / base {median['this tree, warm'] / median['base']:.2f}, "
                f"warm / spawned {median['this tree, warm'] / median['this tree, spawned']:.2f}"
                f", A/A {median['this tree, warm again'] / median['this tree, warm']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
