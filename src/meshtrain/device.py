"""Which device a rank computes on, and what the engine asks of it: its memory figures,
its synchronisation, and the collective backend that serves it.

Everything comes from `torch.accelerator`, which answers for CUDA and for any backend
registered through PyTorch's PrivateUse1 mechanism (torch-neuronx's `neuron` device),
and from torch.distributed's map of device types to c10d backends; without an
accelerator the ranks compute on the CPU over gloo. The engine's runtime modules ask
here instead of naming a device type themselves. torch is imported by the functions
that use it: the planner asks `on_host` without it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CPU = "cpu"
# Collectives on host tensors: the ranks of a CPU job, and the side groups of an
# accelerator job's ranks (the checkpoint writers' agreement).
HOST_BACKEND = "gloo"
# torch's own backends of its built-in accelerators (`torch.distributed`'s map, known
# here without importing torch: the planner runs without it).
_BACKENDS = {"cuda": "nccl", "xpu": "xccl"}
# torch.compile's backend per device type where it is not inductor (torch-neuronx's).
_COMPILE_BACKENDS = {"neuron": "neuron"}
# The device type of the planner's accelerator profiles' ranks (`planner.devices`).
PROFILE_DEVICES = {"h100": "cuda", "h200": "cuda", "trn1": "neuron", "trn2": "neuron"}


def accelerator() -> str | None:
    """This process's accelerator's device type (`cuda`, `neuron`, ...) if one is usable."""
    import torch  # noqa: PLC0415

    found = torch.accelerator.current_accelerator(check_available=True)
    return found.type if found is not None else None


def accelerator_count() -> int:
    import torch  # noqa: PLC0415

    return torch.accelerator.device_count() if accelerator() else 0


def backend_for(device_type: str) -> str:
    """The c10d backend torch registers for `device_type` (nccl for cuda, a PrivateUse1
    backend's own)."""
    import torch.distributed as dist  # noqa: PLC0415

    return dist.get_default_backend_for_device(device_type)


def default_backend() -> str:
    """`launch.backend: auto`: the accelerator's own backend, else gloo on the CPU."""
    found = accelerator()
    return backend_for(found) if found else HOST_BACKEND


def planned_backend(accelerated: bool) -> str:
    """A plan's backend at `launch.backend: auto`: for accelerator ranks this machine's
    accelerator's own, or NCCL where none is here (the built-in GPU profiles are CUDA
    devices); gloo for CPU ranks."""
    if not accelerated:
        return HOST_BACKEND
    found = accelerator()
    return backend_for(found) if found else _BACKENDS["cuda"]


def backend_device(backend: str) -> str | None:
    """The device type whose ranks `backend` serves (nccl: cuda); None for gloo, and for a
    backend that torch does not know here (`neuron` without torch-neuronx)."""
    if backend == HOST_BACKEND:
        return None
    known = dict(_BACKENDS)
    if "torch.distributed" in sys.modules:  # a PrivateUse1 backend registers itself there
        known.update(sys.modules["torch.distributed"].Backend.default_device_backend_map)
    return next((kind for kind, name in known.items() if name == backend and kind != CPU), None)


def on_host(backend: str) -> bool:
    """The ranks of a job on `backend` compute on the CPU."""
    return backend == HOST_BACKEND


def rank_device(backend: str, local_rank: int | None = None) -> torch.device:
    """The device a rank of a job on `backend` computes on; with `local_rank`, that
    accelerator is made the process's current one first (one device per local rank)."""
    import torch  # noqa: PLC0415

    if on_host(backend):
        return torch.device(CPU)
    if local_rank is not None:
        torch.accelerator.set_device_index(local_rank)
    return torch.device(accelerator(), torch.accelerator.current_device_index())


def compile_backend(device: torch.device) -> str:
    """`training.compile`'s backend for `device`: inductor, or the device's own."""
    return _COMPILE_BACKENDS.get(device.type, "inductor")


def is_accelerator(device: torch.device | str) -> bool:
    import torch  # noqa: PLC0415

    return torch.device(device).type != CPU


def synchronize(device: torch.device) -> None:
    import torch  # noqa: PLC0415

    if is_accelerator(device):
        torch.accelerator.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    import torch  # noqa: PLC0415

    torch.accelerator.reset_peak_memory_stats(device)


def peak_allocated_bytes(device: torch.device) -> int:
    """The allocator's peak since the last reset (an accelerator's own count)."""
    import torch  # noqa: PLC0415

    return torch.accelerator.max_memory_allocated(device)


def memory_figures_mb(device: torch.device) -> tuple[float, float, float]:
    """The accelerator allocator's peaks (allocated, reserved) and the device's memory in
    use by anything now, in MiB; zeros on the CPU."""
    import torch  # noqa: PLC0415

    if not is_accelerator(device):
        return 0.0, 0.0, 0.0
    free, total = torch.accelerator.get_memory_info(device)
    return (
        torch.accelerator.max_memory_allocated(device) / 2**20,
        torch.accelerator.max_memory_reserved(device) / 2**20,
        (total - free) / 2**20,
    )


def free_bytes(device: torch.device | str) -> int:
    import torch  # noqa: PLC0415

    return torch.accelerator.get_memory_info(torch.device(device))[0]


def device_name(index: int = 0) -> str:
    """The accelerator's product name ("NVIDIA H100 80GB HBM3"), or "" where unknown."""
    import torch  # noqa: PLC0415

    found = accelerator()
    if not found:
        return ""
    module = torch.get_device_module(found)
    return module.get_device_name(index) if hasattr(module, "get_device_name") else ""


def evaluation_device(requested: str, backend: str | None) -> str:
    """`evaluation.device: auto`: the accelerator where the model trained on one and one
    is here, else the CPU; a named device's type must be this machine's."""
    import torch  # noqa: PLC0415

    found = accelerator()
    if requested == "auto":
        return found if found and backend is not None and not on_host(backend) else CPU
    try:
        kind = torch.device(requested).type
    except RuntimeError:
        raise ValueError(f"{requested!r} is not a device torch knows") from None
    if kind != CPU and kind != found:
        raise ValueError(f"no {kind} device is visible here")
    return requested


def dry_run_device_type(profile: str) -> tuple[str, str | None]:
    """The device type the ranks of device profile `profile` compute on, and the one a dry
    run's fake tensors can carry here: that type where this torch runs it (autograd asks
    the device's runtime for streams even for fake tensors), else the CPU's (None)."""
    kind = PROFILE_DEVICES.get(profile, CPU)
    return kind, kind if kind == CPU or kind == accelerator() else None


@contextlib.contextmanager
def answering_as_target(device_type: str) -> Iterator[None]:
    """`torch.autocast(device_type, bfloat16)` asks whether the device is there and has
    bf16: the dry run's target has both (every accelerator profile), whatever device
    this machine's is."""
    from unittest import mock  # noqa: PLC0415 (the dry run's only)

    import torch  # noqa: PLC0415

    module = torch.get_device_module(device_type)
    with (
        mock.patch.object(module, "is_available", return_value=True),
        mock.patch.object(module, "is_bf16_supported", return_value=True),
    ):
        yield
