"""An accelerator's tensors to host bytes through one pinned buffer per device type,
allocated at the first save and reused by every later one.

A checkpoint's tensors are written (or snapshotted, `checkpoint.background`) from host
memory. `tensor.cpu()` on a CUDA tensor copies into fresh pageable memory, which the
driver stages through a pinned buffer of its own; copying chunk by chunk into one
pinned buffer skips that, and allocates nothing per save. On the CPU the tensor's own
bytes are used as they are.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

BOUNCE_BYTES = 64 << 20
_buffers: dict[str, torch.Tensor] = {}


def bounce_buffer(device_type: str, nbytes: int = BOUNCE_BYTES) -> torch.Tensor:
    """This process's pinned host buffer for copies from `device_type` (pageable where
    pinning is not available)."""
    buffer = _buffers.get(device_type)
    if buffer is None or buffer.numel() < nbytes:
        pinned = torch.accelerator.is_available()
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        _buffers[device_type] = buffer
    return buffer[:nbytes]


def host_bytes(flat: torch.Tensor, buffer: torch.Tensor | None = None) -> Iterator[np.ndarray]:
    """The bytes of `flat` (a contiguous 1-D uint8 tensor) in host memory, in order: a CPU
    tensor's own (unless a `buffer` is given), an accelerator tensor's through the bounce
    buffer, each chunk valid until the next is asked for."""
    if flat.device.type == "cpu" and buffer is None:
        yield flat.numpy()
        return
    if buffer is None:
        buffer = bounce_buffer(flat.device.type)
    for start in range(0, flat.numel(), buffer.numel()):
        piece = flat[start : start + buffer.numel()]
        chunk = buffer[: piece.numel()]
        chunk.copy_(piece)  # a blocking copy: the bytes are there when it returns
        yield chunk.numpy()
