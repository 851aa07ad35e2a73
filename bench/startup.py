"""Start-up: how long a user waits before meshtrain answers, this tree against another.

Each figure is the wall time of a whole command, as a user meets it, run `--repeats`
times on each side: another commit (`--base`, checked out in a temporary git worktree
and run with this venv, its own `src/` first on the path), this tree, and this tree
again (the A/A control: what the machine's noise alone moves). The order of the sides
reverses on odd repeats. Printed: min / median / max per side, and the ratios of the
medians.

    .venv/bin/python bench/startup.py --base 014483f        # ~3 min on 2 cores

The commands:
- refused: `kedro run --params consolidation.dtype=int8`, refused before any node;
- plan: `python -m meshtrain plan` for Llama-3.1-8B on 8 H100s (README's example).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

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


def summary(values: list[float]) -> str:
    return f"{min(values):5.2f} / {statistics.median(values):5.2f} / {max(values):5.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with worktree(args.base) as base:
        sides = (("base", base), ("this tree", ROOT), ("this tree again", ROOT))
        for name, (command, expect) in COMMANDS.items():
            times: dict[str, list[float]] = {side: [] for side, _ in sides}
            for repeat in range(args.repeats):
                order = sides if repeat % 2 == 0 else tuple(reversed(sides))
                for side, tree in order:
                    times[side].append(timed(tree, command, expect))
            print(f"{name} (min / median / max of {args.repeats})")
            for side, values in times.items():
                print(f"  {side:<16} {summary(values)}")
            median = {side: statistics.median(values) for side, values in times.items()}
            print(
                f"  this / base {median['this tree'] / median['base']:.2f}, "
                f"A/A {median['this tree again'] / median['this tree']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
