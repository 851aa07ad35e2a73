"""CPU seconds of the end-to-end tests' training `kedro run`s (`tests/warm_kedro.py`:
each forked from a server that imported Kedro and the engine), by how the run's
warm-rank server starts: forked from the run (`launch.warm.fork_server`, the tests'
way) or a new interpreter that imports the engine again (a cold run's way), side by
side, with an A/A control.

    .venv/bin/python bench/kedro_runs.py --repeats 3

Each figure is the machine's busy CPU seconds (/proc/stat: the run, its server and its
ranks) and the wall seconds of `kedro run --pipeline training` on the tests' small
run, after one run that prepares the data and starts the tests' server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from suite_cpu import busy_seconds  # noqa: E402

from tests import warm_kedro  # noqa: E402
from tests.kedro_project import SMALL_RUN, kedro_run, make_project  # noqa: E402

SIDES = {"forked": "0", "new interpreter": "1", "forked again": "0"}


def one_run(project: Path, name: str) -> tuple[float, float]:
    cpu, wall = busy_seconds(), time.monotonic()
    done = kedro_run(
        project, "--pipeline", "training", "--params", f"{SMALL_RUN},training.run_name={name}"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return busy_seconds() - cpu, time.monotonic() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    project = make_project(Path(tempfile.mkdtemp(prefix="kedro-runs-")) / "project")
    done = kedro_run(project, "--params", f"{SMALL_RUN},training.run_name=prepare")
    assert done.returncode == 0, done.stderr[-3000:]
    seen: dict[str, list[tuple[float, float]]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats):
        order = list(SIDES) if repeat % 2 == 0 else list(reversed(SIDES))
        for side in order:
            os.environ[warm_kedro.NEW_RANK_SERVER] = SIDES[side]
            seen[side].append(one_run(project, f"r{repeat}-{side.replace(' ', '-')}"))
    print("| the run's warm-rank server | CPU-s min / median / max | wall s median |")
    print("|---|---|---|")
    for side, runs in seen.items():
        cpu = sorted(c for c, _ in runs)
        wall = statistics.median(w for _, w in runs)
        print(
            f"| {side} | {cpu[0]:.1f} / {statistics.median(cpu):.1f} / {cpu[-1]:.1f} | {wall:.1f} |"
        )
    median = {side: statistics.median(c for c, _ in runs) for side, runs in seen.items()}
    print(
        f"forked / new interpreter: {median['forked'] / median['new interpreter']:.2f}x "
        f"(A/A forked again / forked: {median['forked again'] / median['forked']:.2f})"
    )


if __name__ == "__main__":
    main()
