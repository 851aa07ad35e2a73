"""Which runs take the oneDNN Linear converter (`models/cpu_linear.py`), decided without
importing torch: the planner asks for every layout it weighs, and a plan for an
accelerator never needs torch. Only a CPU run that could take oneDNN asks torch whether
this build has it.
"""

from __future__ import annotations

import functools
from pathlib import Path

# The converter's name: in the device profiles' rate tables, run summaries and MLflow tags.
NAME = "onednn_linear"


@functools.cache
def _cpuinfo(key: str) -> str:
    """The first `key` line's value in /proc/cpuinfo; "" where unknown. Read once per key
    and process: the planner asks for every layout it weighs."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return ""


def cpu_vendor() -> str:
    """The x86 vendor string (GenuineIntel, AuthenticAMD, ...); "" where unknown."""
    return _cpuinfo("vendor_id")


def cpu_has_avx512() -> bool:
    """Whether the CPU has AVX-512 (the `avx512f` flag)."""
    return "avx512f" in _cpuinfo("flags").split()


def cpu_matmul_choice(setting: str, *, on_cpu: bool, tensor_parallel: bool = False) -> str | None:
    """Where a run runs its Linear layers' matmuls: "onednn" or "blas" on a CPU (`on_cpu`),
    None on an accelerator (this is a CPU path).

    `auto`: oneDNN on x86-64 CPUs with AVX-512 not made by Intel, where MKL stays on
    AVX2 and is the slow one (on Intel CPUs, and on CPUs without AVX-512, MKL is kept:
    there it is as fast or faster). `onednn`: on any
    CPU where oneDNN is available. `blas`: never. Under tensor parallelism always blas:
    DTensor shards keep DTensor's own path (run on their local shards they matched it
    bitwise, but a tp2 x pp2 run crashed once in gloo's reduce-scatter of such a
    gradient, unexplained).
    """
    if not on_cpu:
        return None
    if setting == "blas" or tensor_parallel or not _onednn_available():
        return "blas"
    if setting == "onednn" or (cpu_vendor() not in ("GenuineIntel", "") and cpu_has_avx512()):
        return "onednn"
    return "blas"


def _onednn_available() -> bool:
    from meshtrain.models.cpu_linear import onednn_available  # noqa: PLC0415  (torch)

    return onednn_available()
