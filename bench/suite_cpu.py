"""Where the test suite's time goes: each test's wall seconds and the CPU seconds the whole
machine spent meanwhile (from /proc/stat, so the ranks, servers and `kedro run`s a test
starts count, and the warm servers' work shows where it is used), and a comparison of
two such records by module.

Record (as a pytest plugin, one process: with `-n 2` two tests share the machine):

    PYTHONPATH=bench .venv/bin/python -m pytest -p suite_cpu --suite-cpu=after.json

Compare two records (a module's CPU and wall seconds before and after, and the totals):

    .venv/bin/python bench/suite_cpu.py before.json after.json

Noisy: other work on the machine counts too. Compare records made on an idle machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import pytest

_HZ = os.sysconf("SC_CLK_TCK")
_records: list[tuple[str, float, float]] = []


def busy_seconds() -> float:
    """CPU seconds the machine has spent busy since boot (all cores)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / _HZ


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite-cpu", default="suite_cpu.json", help="where to write the record")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cpu, wall = busy_seconds(), time.monotonic()
    yield
    _records.append((item.nodeid, time.monotonic() - wall, busy_seconds() - cpu))
    out = Path(item.config.getoption("--suite-cpu"))
    out.write_text(json.dumps([[n, round(w, 2), round(c, 2)] for n, w, c in _records]))


def by_module(path: Path) -> dict[str, tuple[float, float]]:
    """Wall and CPU seconds per test module of a record."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for nodeid, wall, cpu in json.loads(path.read_text()):
        module = totals[nodeid.split("::")[0]]
        module[0] += wall
        module[1] += cpu
    return {name: (wall, cpu) for name, (wall, cpu) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--top", type=int, default=30, help="modules shown, most CPU first")
    args = parser.parse_args()
    before, after = by_module(args.before), by_module(args.after)
    names = sorted(before.keys() | after.keys(), key=lambda n: -after.get(n, (0, 0))[1])
    print("| module | CPU-s before | after | wall s before | after |")
    print("|---|---:|---:|---:|---:|")
    for name in names[: args.top]:
        (wall0, cpu0), (wall1, cpu1) = before.get(name, (0, 0)), after.get(name, (0, 0))
        print(f"| {name} | {cpu0:.1f} | {cpu1:.1f} | {wall0:.1f} | {wall1:.1f} |")
    common = before.keys() & after.keys()  # a partial record compares on its own modules
    total = [sum(r[n][i] for n in common) for r in (before, after) for i in (1, 0)]
    print(
        f"| the {len(common)} modules in both | {total[0]:.1f} | {total[2]:.1f} "
        f"| {total[1]:.1f} | {total[3]:.1f} |"
    )
    print(f"CPU after / before: {total[2] / total[0]:.3f}x")


if __name__ == "__main__":
    main()
