"""bench/gpu_throughput.py, issue #19's GPU measurement, on this machine's CPUs.

The script is meant for a session with CUDA devices, which CI never has; its smoke run
here (the project's default shape, bf16 autocast on the CPU, gloo) runs every side
through the same entry points, so that it still works when a GPU session comes to it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_bench_smoke_run_on_cpu(tmp_path: Path) -> None:
    command = [
        sys.executable,
        str(ROOT / "bench" / "gpu_throughput.py"),
        *("--device", "cpu", "--shape", "default", "--worlds", "1"),
        *("--repeats", "1", "--steps", "1", "--warmup", "1", "--work-dir", str(tmp_path)),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout.split("command:")[-1]
    assert "bf16; cpu" in table
    for side, layout in (
        ("meshtrain", "dp1-tp1-pp1"),
        ("bare", "1 process, no group"),
        ("meshtrain_again", "dp1-tp1-pp1"),
    ):
        row = re.search(rf"^\| {side} \| {layout} \| ([\d,]+) \| [\d,]+ \| .*$", table, re.M)
        assert row, (side, table)
        assert int(row.group(1).replace(",", "")) > 0
    # meshtrain's own summary carries its MFU (the bf16 plan's peak): the run logged it.
    own = re.search(r"^\| meshtrain \| .* \| (\d\.\d{3}) \|$", table, re.M)
    assert own and float(own.group(1)) > 0, table
    assert re.search(r"^meshtrain / bare: \d+\.\d{3}x$", table, re.M)
    assert re.search(r"^meshtrain / meshtrain_again: \d+\.\d{3}x$", table, re.M)
