"""Check that the launch backend's software is installed, before any worker starts."""

from __future__ import annotations

import importlib.util

from meshtrain.config import Refused

NEURON_PACKAGES = ("torch_neuronx", "neuronx_distributed")


class BackendUnavailableError(Refused, RuntimeError):
    """The configured `launch.backend` cannot run on this machine; the message says why."""


def missing_packages(backend: str) -> list[str]:
    """The packages `backend` needs that this machine lacks."""
    if backend != "neuron":
        return []
    return [name for name in NEURON_PACKAGES if importlib.util.find_spec(name) is None]


def check_backend_available(backend: str) -> None:
    """Refuse `neuron` where the AWS Neuron packages are missing (everything before the
    launch -- data, planning for trn devices, plan.json, MLflow -- runs without them)."""
    if backend != "neuron":
        return
    missing = missing_packages(backend)
    if missing:
        raise BackendUnavailableError(
            f"launch.backend=neuron needs {', '.join(missing)} (not installed here). The AWS "
            "Neuron packages come only from AWS's own package index (the PyPI packages of those "
            "names are placeholders): on a Trainium instance (Neuron DLAMI or Deep Learning "
            "Container) run `pip install torch-neuronx neuronx-distributed --extra-index-url "
            "https://pip.repos.neuron.amazonaws.com`, then start the training pipeline again. "
            "This machine can still run `kedro run --env trn1 --pipeline planning`."
        )
    raise BackendUnavailableError(
        "launch.backend=neuron: the Neuron packages are installed, but meshtrain's training "
        "loop has not been ported to XLA devices yet (it runs on gloo and NCCL). The plan "
        "(data/05_model_input/plan.json) holds the layout to use with neuronx-distributed."
    )
