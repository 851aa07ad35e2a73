"""One rank of any world, in this process: a fake process group and fake tensors.

torch's `fake` backend accepts any world size and makes every collective return
at once with its input unchanged; `FakeTensorMode` runs each operator on shapes,
dtypes and devices alone, with no storage behind them. Together they let one CPU
process run the real code of rank R of a 512-rank job: the device mesh, the
parallelised model, the optimizer, a training step.

Fake tensors can carry an accelerator's device type on a machine without one, but
autograd cannot: its engine asks the device's runtime for streams as soon as such a
tensor requires a gradient, and a CPU-only torch has none. So a dry run takes the
target's device type when this torch can run it, else the CPU's, and says which
(`dry_run_device`). On an accelerator two queries answer for the target, not for
this machine (`device.answering_as_target`), and nothing else is patched.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from meshtrain.device import CPU, answering_as_target, dry_run_device_type, is_accelerator

T = TypeVar("T")


def dry_run_device(profile_device: str) -> tuple[torch.device, str]:
    """The device the dry run's fake tensors carry, and why (for the report): the
    profile's accelerator where this torch can run it, else the CPU code path, which is
    also the trainer's on CPU."""
    target, here = dry_run_device_type(profile_device)
    if here == CPU:
        return torch.device(CPU), f"{profile_device}: the trainer's CPU code path"
    if here is not None:
        return torch.device(here, 0), f"{profile_device}: {here}, the cluster's code path"
    return torch.device(CPU), (
        f"{profile_device} trains on {target}, but this torch has no {target} runtime "
        "(autograd needs its streams even for fake tensors): the CPU code path stands in; "
        f"run the dry run where torch has a {target} device to take that one"
    )


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """The default process group as rank `rank` of `world_size`, communicating nothing."""
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process")
    if "fake" not in dist.Backend._plugins:  # torch < 2.13 registers it in its test utilities
        import torch.testing._internal.distributed.fake_pg  # noqa: F401, PLC0415
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def in_own_thread(function: Callable[[], T]) -> T:
    """`function()` in a thread of its own. torch caches what DTensor decides and how it
    redistributes by device mesh, and a mesh compares by its shape, names and thread, not
    its process groups: a dry run after another in the same thread would find the earlier
    one's (destroyed) groups through a new mesh of the same shape."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = function()
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="meshtrain-dry-run")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@contextlib.contextmanager
def fake_tensors(device: torch.device) -> Iterator[FakeTensorMode]:
    """Every tensor made in the block is fake; on CUDA, the two device queries that gate
    bf16 autocast answer for the target (a GPU that has bf16), whatever this machine is."""
    with contextlib.ExitStack() as stack:
        if is_accelerator(device):
            stack.enter_context(answering_as_target(device.type))
        stack.enter_context(real_device_meshes())
        yield stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))


@contextlib.contextmanager
def real_device_meshes() -> Iterator[None]:
    """A `DeviceMesh` keeps its ranks in a small real tensor and finds its own with
    `nonzero`, which fake tensors cannot answer: its methods that make or read that tensor
    (FSDP2 builds meshes as it shards) run outside the fake mode."""
    patches = [
        mock.patch.object(DeviceMesh, name, outside_fake(getattr(DeviceMesh, name)))
        for name in ("__init__", "_concatenate", "__getitem__", "_flatten")
    ]
    real_mesh = property(outside_fake(DeviceMesh.mesh.fget))
    patches.append(mock.patch.object(DeviceMesh, "mesh", real_mesh))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def outside_fake(function: Callable) -> Callable:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return function(*args, **kwargs)

    return run
