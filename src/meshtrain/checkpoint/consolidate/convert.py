"""Casting tensor bytes between floating dtypes while they stream, with numpy (no torch).

`--dtype` writes a consolidated model in another precision than the checkpoint
holds (a bf16_master run stores fp32 master weights; users often want bf16
files). fp32 -> bf16 rounds to nearest, ties to even, as torch does, so every
finite or infinite value is bitwise what `tensor.to(torch.bfloat16)` gives (a
NaN stays a quiet NaN, its bits may differ); bf16 -> fp32 is exact; float16
goes through numpy's own conversions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

FLOATING = ("float32", "bfloat16", "float16")

Cast = Callable[[memoryview], bytes]


def _to_float32(block: memoryview, source: str) -> np.ndarray:
    import numpy as np  # noqa: PLC0415  (only a cast needs it: plain copies import none)

    if source == "float32":
        return np.frombuffer(block, np.float32)
    if source == "float16":
        return np.frombuffer(block, np.float16).astype(np.float32)
    bits = np.frombuffer(block, np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


def _from_float32(values: np.ndarray, target: str) -> bytes:
    import numpy as np  # noqa: PLC0415

    if target == "float32":
        return values.astype(np.float32, copy=False).tobytes()
    if target == "float16":
        return values.astype(np.float16).tobytes()
    bits = values.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)  # quiet NaN
    return rounded.tobytes()


def caster(source: str, target: str) -> Cast | None:
    """A function from `source` bytes to `target` bytes; None when they are the same."""
    if source == target:
        return None
    for dtype in (source, target):
        if dtype not in FLOATING:
            raise ValueError(f"cannot cast {dtype} tensors; --dtype casts between {FLOATING}")

    def cast(block: memoryview) -> bytes:
        return _from_float32(_to_float32(block, source), target)

    return cast
