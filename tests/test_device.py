"""The device module: what a rank computes on, from `torch.accelerator`, and the only
runtime module that names a device type or a collective backend."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from meshtrain import device

SRC = Path(__file__).resolve().parents[1] / "src" / "meshtrain"
# The launch configuration's documented values (`launch.backend`) name backends too.
STILL_NAMING = {"config_launch.py"}
NAMES_A_DEVICE = re.compile(r"torch\.cuda\b|[\"'](cuda|nccl|gloo)[\"':]")


def test_no_runtime_module_but_the_device_module_names_a_device_type():
    naming = sorted(
        path.relative_to(SRC).as_posix()
        for path in SRC.rglob("*.py")
        if NAMES_A_DEVICE.search(path.read_text())
    )
    assert set(naming) - STILL_NAMING == {"device.py"}, naming


@pytest.mark.skipif(torch.accelerator.is_available(), reason="what a CPU machine answers")
def test_a_machine_without_an_accelerator_computes_on_the_cpu_over_gloo():
    assert device.accelerator() is None and device.accelerator_count() == 0
    assert device.default_backend() == device.HOST_BACKEND == "gloo"
    assert device.rank_device("gloo", 0) == torch.device("cpu")
    assert device.memory_figures_mb(torch.device("cpu")) == (0.0, 0.0, 0.0)
    assert device.evaluation_device("auto", "nccl") == "cpu"
    with pytest.raises(ValueError, match="no cuda device"):
        device.evaluation_device("cuda:1", "nccl")
    with pytest.raises(ValueError, match="not a device torch knows"):
        device.evaluation_device("gpu", "nccl")
    # A dry run for GPUs stands the CPU in, and for its autocast answers as the GPU would.
    assert device.dry_run_device_type("h100") == ("cuda", None)
    assert device.dry_run_device_type("cpu") == ("cpu", "cpu")
    with device.answering_as_target("cuda"):
        assert torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    assert not torch.cuda.is_available()


def test_an_accelerator_brings_its_own_backend(monkeypatch):
    """What `auto` resolves to follows torch's map of device types to c10d backends, so a
    PrivateUse1 backend registered for its device (torch-neuronx's) is taken as it is."""
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda")
    )
    assert device.accelerator() == "cuda" and device.default_backend() == "nccl"
    assert device.evaluation_device("auto", "nccl") == "cuda"
    assert device.evaluation_device("auto", "gloo") == "cpu"  # trained on the CPU
    assert not device.on_host("nccl") and device.is_accelerator("cuda:0")
