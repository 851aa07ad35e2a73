"""Keep a process quiet (no telemetry) and, for benchmarks and tests, offline.

The one list of the variables meshtrain sets before Kedro, MLflow or the
Hugging Face libraries load: the telemetry opt-outs every process gets
(`disable_telemetry`, called by the Kedro settings and the MLflow tracking
module), and on top of them, for benchmark and test processes, no hub
downloads (models, tokenizers, datasets) and no tokenizer thread pools
fighting the ranks for cores (`use_offline_defaults`). Values the caller's
environment already sets win.
"""

from __future__ import annotations

import os

TELEMETRY_OPT_OUT = {
    "KEDRO_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}

OFFLINE_DEFAULTS = {
    **TELEMETRY_OPT_OUT,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _set_defaults(values: dict[str, str]) -> None:
    for key, value in values.items():
        os.environ.setdefault(key, value)


def disable_telemetry() -> None:
    """Keep Kedro and MLflow from phoning home; call before either is imported."""
    _set_defaults(TELEMETRY_OPT_OUT)


def use_offline_defaults() -> None:
    """Set every `OFFLINE_DEFAULTS` variable the environment does not set already."""
    _set_defaults(OFFLINE_DEFAULTS)
